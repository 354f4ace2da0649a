"""Reconstruct-on-commit on vLLM's CPU GDN path.

vLLM's CPU GDN op looks its speculative half up as the module global `_spec_forward` at call time; for layers
under reconstruct it is answered by the layer's `speculative_step` (torch: the previous step's commit, then the
closed-form verify), while vLLM's own code still handles the prefill tokens of the batch. Those read and write the
conv history in the first width-1 columns of the conv state and the SSM state in the request's one block, which is
where the commit keeps them.
"""

from __future__ import annotations

import functools

from vllm_treewy.vllm_plugin.patch_points import CPU_GDN_SPEC_FORWARD


def _dispatching(original_spec_forward):
    @functools.wraps(original_spec_forward)
    def spec_forward(layer, metadata, mixed_qkv_spec, b_spec, a_spec, *args, **kwargs):
        if getattr(layer, "reconstructs_state", False):
            return layer.speculative_step(metadata, mixed_qkv_spec, a_spec, b_spec)
        return original_spec_forward(layer, metadata, mixed_qkv_spec, b_spec, a_spec, *args, **kwargs)

    return spec_forward


def install() -> None:
    CPU_GDN_SPEC_FORWARD.wrap(_dispatching)
