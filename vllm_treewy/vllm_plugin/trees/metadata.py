"""vLLM's per-step metadata objects with the step's tree on them, as fields of a subclass (not attributes added to
vLLM's objects): `with_tree(metadata, tree_step=..., tree_qq_bias=...)` returns a copy of vLLM's dataclass as a
subclass that has the tree fields (`tree_step`, `tree_qq_bias` for TRITON_ATTN, `tree_block_ancestors` and
`tree_prefix_lens` for FLASH_ATTN: the prefix pass's committed lengths, computed once per step for all the layers
that share the metadata); `tree_step_of` / `tree_qq_bias_of` / `tree_block_ancestors_of` / `tree_prefix_lens_of`
read them from any metadata (None on vLLM's own). Used for the step's `SpecDecodeMetadata` (to `_sample`) and the
attention metadata (to the forwards); `replace_metadata` puts such copies into vLLM's per-layer metadata dicts."""

from __future__ import annotations

import dataclasses
import functools


@functools.cache
def _with_tree_fields(cls: type) -> type:
    tree_cls = dataclasses.make_dataclass(
        f"Tree{cls.__name__}", [("tree_step", object, dataclasses.field(default=None)),
                                ("tree_qq_bias", object, dataclasses.field(default=None)),
                                ("tree_block_ancestors", object, dataclasses.field(default=None)),
                                ("tree_prefix_lens", object, dataclasses.field(default=None))], bases=(cls,))
    tree_cls.vllm_class = cls
    return tree_cls


def with_tree(metadata, **tree_fields):
    """A copy of `metadata` (a vLLM dataclass, or such a copy) with the given tree fields set, the other tree fields
    kept; vLLM's fields (tensors included) are shared, not copied."""
    base = getattr(type(metadata), "vllm_class", type(metadata))
    fields = dataclasses.fields(base)
    values = {"tree_step": tree_step_of(metadata), "tree_qq_bias": tree_qq_bias_of(metadata),
              "tree_block_ancestors": tree_block_ancestors_of(metadata),
              "tree_prefix_lens": tree_prefix_lens_of(metadata), **tree_fields}
    copy = _with_tree_fields(base)(**{f.name: getattr(metadata, f.name) for f in fields if f.init}, **values)
    for f in fields:
        if not f.init:
            object.__setattr__(copy, f.name, getattr(metadata, f.name))
    return copy


def tree_step_of(metadata):
    return getattr(metadata, "tree_step", None)


def tree_qq_bias_of(metadata):
    return getattr(metadata, "tree_qq_bias", None)


def tree_block_ancestors_of(metadata):
    return getattr(metadata, "tree_block_ancestors", None)


def tree_prefix_lens_of(metadata):
    return getattr(metadata, "tree_prefix_lens", None)


def replace_metadata(attn_metadata, replacement) -> None:
    """Replaces, in place, each layer's metadata in vLLM's per-layer dict (or list of them: one per micro-batch) by
    `replacement(name, metadata)` (None: keep); layers that share one metadata object share its replacement."""
    done = {}
    for per_layer in attn_metadata if isinstance(attn_metadata, list) else [attn_metadata]:
        for name, metadata in list(per_layer.items()):
            if id(metadata) not in done:
                done[id(metadata)] = replacement(name, metadata)
            if done[id(metadata)] is not None:
                per_layer[name] = done[id(metadata)]
