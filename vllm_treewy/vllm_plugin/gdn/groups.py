"""The runner's GDN groups: the KV-cache groups of GDN layers (vLLM's `MambaSpec` groups) and their first layers,
which hold what a group keeps once (its count state, `gdn.step_metadata.counts_layer`; the first group's first layer
also the runner's `gdn.sampling_tables` and the commit table's buffers). Both runners (V1 and Model Runner V2) are
read through the same fields: `compilation_config.static_forward_context` and `kv_cache_config.kv_cache_groups`.
"""

from __future__ import annotations

from collections.abc import Iterator

from vllm.v1.kv_cache_interface import MambaSpec

from vllm_treewy.vllm_plugin.config import DraftShape


def gdn_groups(runner) -> Iterator[tuple[int, object]]:
    """(group id, vLLM's `KVCacheGroupSpec`) per KV-cache group of GDN layers, in the runner's group order."""
    for group_id, group in enumerate(runner.kv_cache_config.kv_cache_groups):
        if isinstance(group.kv_cache_spec, MambaSpec):
            yield group_id, group


def first_layers(runner) -> Iterator[tuple[int, object]]:
    """(group id, the group's first layer) per GDN group: the layer its GDN metadata builder reads."""
    layers = runner.compilation_config.static_forward_context
    for group_id, group in gdn_groups(runner):
        yield group_id, layers[group.layer_names[0]]


def first_gdn_layer(runner):
    """The first layer of the runner's first GDN group; None where the model has no GDN group."""
    return next((layer for _, layer in first_layers(runner)), None)


def step_buffers_of_runner(runner):
    """The runner's first GDN layer's `gdn.step_metadata.GroupStepBuffers` (the config's `DraftShape` and commit
    source, read from the config once, at the layer's construction): for the hooks of a config whose GDN layers keep
    slot counts (reconstruct, store_all draft trees)."""
    layer = first_gdn_layer(runner)
    if getattr(layer, "step_buffers", None) is None:
        raise RuntimeError("the draft shape of a config that keeps GDN slot counts is its first GDN layer's; the "
                           "runner has no such layer")
    return layer.step_buffers


def draft_shape_of_runner(runner) -> DraftShape:
    """The config's `DraftShape` as the runner's first GDN layer holds it (`step_buffers_of_runner`)."""
    return step_buffers_of_runner(runner).shape


def counted_gdn_groups(runner):
    """(group id, count state) per KV-cache group of GDN layers that keep slot counts (reconstruct, store_all draft
    trees): the count lives in the group's first layer, the one its GDN metadata builder reads
    (`gdn.step_metadata.counts_layer`)."""
    for group_id, layer in first_layers(runner):
        counts = layer.verified_node_counts() if getattr(layer, "keeps_slot_counts", False) else None
        if counts is not None:
            yield group_id, counts
