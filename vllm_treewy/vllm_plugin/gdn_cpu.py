"""Reconstruct-on-commit on vLLM's CPU GDN path.

vLLM's CPU GDN op looks its speculative half up as the module global `_spec_forward` at call time; for layers
under reconstruct it is answered by the layer's `verify_spec_chains` (torch closed form, no state written),
while vLLM's own code still handles the prefill and plain decode tokens of the batch. Those read and write the
conv history in the first width-1 columns of the conv state and the SSM state in the request's one block,
which is where the commit keeps them.
"""

from __future__ import annotations

import vllm.model_executor.layers.mamba.ops.cpu.gdn_attention as cpu_gdn


def _dispatching(original_spec_aware, original_spec_forward):
    def spec_aware(layer, metadata, *args, **kwargs):
        if getattr(layer, "reconstructs_state", False):
            layer.pending_step = None  # an earlier pass that was never sampled (warm-up runs)
        return original_spec_aware(layer, metadata, *args, **kwargs)

    def spec_forward(layer, metadata, mixed_qkv_spec, b_spec, a_spec, *args, **kwargs):
        if getattr(layer, "reconstructs_state", False):
            return layer.verify_spec_chains(metadata, mixed_qkv_spec, a_spec, b_spec)
        return original_spec_forward(layer, metadata, mixed_qkv_spec, b_spec, a_spec, *args, **kwargs)

    spec_aware.reconstruct_dispatch = spec_forward.reconstruct_dispatch = True
    return spec_aware, spec_forward


def install() -> None:
    if getattr(cpu_gdn._spec_forward, "reconstruct_dispatch", False):
        return
    cpu_gdn._cpu_gdn_attention_spec_aware, cpu_gdn._spec_forward = _dispatching(
        cpu_gdn._cpu_gdn_attention_spec_aware, cpu_gdn._spec_forward
    )
