"""Reconstruct-on-commit on vLLM's CPU GDN path.

vLLM's CPU GDN op looks its speculative half up as the module global `_spec_forward` at call time; for layers
under reconstruct it is answered by the layer's `verify_spec_chains` (torch closed form, no state written),
while vLLM's own code still handles the prefill and plain decode tokens of the batch. Those read and write the
conv history in the first width-1 columns of the conv state and the SSM state in the request's one block,
which is where the commit keeps them.
"""

from __future__ import annotations

import functools

from vllm_treewy.vllm_plugin.patch_points import CPU_GDN_SPEC_AWARE, CPU_GDN_SPEC_FORWARD


def _dispatching(original_spec_aware, original_spec_forward):
    @functools.wraps(original_spec_aware)
    def spec_aware(layer, metadata, *args, **kwargs):
        if getattr(layer, "reconstructs_state", False):
            layer.pending_step = None  # an earlier pass that was never sampled (warm-up runs)
        return original_spec_aware(layer, metadata, *args, **kwargs)

    @functools.wraps(original_spec_forward)
    def spec_forward(layer, metadata, mixed_qkv_spec, b_spec, a_spec, *args, **kwargs):
        if getattr(layer, "reconstructs_state", False):
            return layer.verify_spec_chains(metadata, mixed_qkv_spec, a_spec, b_spec)
        return original_spec_forward(layer, metadata, mixed_qkv_spec, b_spec, a_spec, *args, **kwargs)

    spec_aware.reconstruct_dispatch = spec_forward.reconstruct_dispatch = True
    return spec_aware, spec_forward


def install() -> None:
    if getattr(CPU_GDN_SPEC_FORWARD.resolve(), "reconstruct_dispatch", False):
        return
    spec_aware, spec_forward = _dispatching(CPU_GDN_SPEC_AWARE.resolve(), CPU_GDN_SPEC_FORWARD.resolve())
    CPU_GDN_SPEC_AWARE.replace(spec_aware)
    CPU_GDN_SPEC_FORWARD.replace(spec_forward)
