"""Reconstruct-on-commit on vLLM's CPU GDN path.

vLLM's CPU GDN op looks its speculative half up as the module global `_spec_forward` at call time; for layers
under reconstruct it is answered by the layer's `speculative_step` (torch: the previous step's commit, then the
closed-form verify), and likewise for a store_all draft tree (a state per node from its parent's), while vLLM's own
code still handles the prefill tokens of the batch. Those read and write the conv history in the first width-1
columns of the conv state and the SSM state in the request's first block, which is where reconstruct's commit keeps
them and where a store_all tree starts after a prefill.
"""

from __future__ import annotations

import functools

from vllm_treewy.vllm_plugin.patch_points import CPU_GDN_SPEC_FORWARD


def _dispatching(original_spec_forward):
    @functools.wraps(original_spec_forward)
    def spec_forward(layer, metadata, mixed_qkv_spec, b_spec, a_spec, *args, **kwargs):
        if getattr(layer, "keeps_slot_counts", False):
            return layer.speculative_step(metadata, mixed_qkv_spec, a_spec, b_spec)
        return original_spec_forward(layer, metadata, mixed_qkv_spec, b_spec, a_spec, *args, **kwargs)

    return spec_forward


def install() -> None:
    CPU_GDN_SPEC_FORWARD.wrap(_dispatching)
