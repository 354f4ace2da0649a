"""Reconstruct under vLLM's prefix caching of GDN states (align mode): the V1 runner's hooks. The design, and what
vLLM's align mode does on each runner, is `gdn.prefix_caching`'s docstring; the parts both runners share live there.

- The runner's copy functions get the pseudo-value buffer's states (`gdn.prefix_caching.with_buffer_copies`), and
  its align buffers come without the speculative post-processing context (vLLM's CPU backend has no fused copies).
- After sampling (`v1.accepted_counts`'s hook): every GDN layer's accepted counts and block-boundary states in one
  launch (`record_after_sampling`); vLLM's own post-processing is skipped, its host counts stay 1.
"""

from __future__ import annotations

import dataclasses
import functools

import torch
from vllm.v1.attention.backends.utils import NULL_BLOCK_ID

from vllm_treewy.kernels.bookkeeping.boundary_states_torch import record_accepted_and_boundaries_torch
from vllm_treewy.kernels.bookkeeping.boundary_states_triton import record_accepted_and_boundaries_triton
from vllm_treewy.vllm_plugin.config import reconstructs_mamba_state
from vllm_treewy.vllm_plugin.gdn.prefix_caching import runner_boundary_layers, with_buffer_copies
from vllm_treewy.vllm_plugin.patch_points import (
    MAMBA_ALIGN_POSTPROCESS,
    RUNNER_MAMBA_BUFFERS,
    RUNNER_MAMBA_STATE_COPY_FUNCS,
)


def record_after_sampling(runner, num_reqs: int, commit_counts: torch.Tensor | None = None,
                          commit_ancestors: torch.Tensor | None = None) -> None:
    """After vLLM counted this step's accepted tokens per row: each speculative row's count into its slot and the
    boundary states its accepted tokens reached, in every GDN layer (one launch on CUDA). Device tensors only.
    Draft-tree configs pass the commit table and each row's count (`tree_commit_counts`): the boundary node is the
    accepted path's node at the boundary's depth (`kernels.bookkeeping.boundary_states_torch`)."""
    views, table, block_size = runner_boundary_layers(runner)
    if not views:
        return
    counts = runner.num_accepted_tokens.gpu if commit_counts is None else commit_counts
    args = (runner.seq_lens, runner.num_decode_draft_tokens.gpu, counts, num_reqs)
    if table is None:
        record_accepted_and_boundaries_torch(views, *args, block_size=block_size, null_block=NULL_BLOCK_ID,
                                             commit_ancestors=commit_ancestors)
    else:
        record_accepted_and_boundaries_triton(views, table, *args, block_size=block_size, null_block=NULL_BLOCK_ID,
                                              commit_ancestors=commit_ancestors)


def _copying_pseudo_value_buffer(original):
    @functools.wraps(original)
    def get_mamba_state_copy_funcs(self):
        funcs = original(self)
        if not reconstructs_mamba_state(self.speculative_config):
            return funcs
        return with_buffer_copies(funcs)

    return get_mamba_state_copy_funcs


def _without_speculative_postprocess(original):
    @functools.wraps(original)
    def get_mamba_bufs(self):
        buffers = original(self)
        if reconstructs_mamba_state(self.speculative_config) and buffers.postprocess_align is not None:
            self._mamba_bufs = buffers = dataclasses.replace(buffers, postprocess_align=None)
        return buffers

    return get_mamba_bufs


def _keeping_offset_zero(original):
    @functools.wraps(original)
    def postprocess_mamba_align_gpu(*, bufs, num_reqs, num_accepted_tokens_cpu_tensor, **kwargs):
        if bufs.postprocess_align is not None:  # vLLM's own (store_all); reconstruct's buffers have none
            return original(bufs=bufs, num_reqs=num_reqs, num_accepted_tokens_cpu_tensor=num_accepted_tokens_cpu_tensor,
                            **kwargs)
        # reconstruct: the boundary states are `record_after_sampling`'s; the next migration copies at offset 0
        num_accepted_tokens_cpu_tensor[:num_reqs].fill_(1)

    return postprocess_mamba_align_gpu


def install() -> None:
    """The V1 runner's hooks (every process)."""
    RUNNER_MAMBA_STATE_COPY_FUNCS.wrap(_copying_pseudo_value_buffer)
    RUNNER_MAMBA_BUFFERS.wrap(_without_speculative_postprocess)
    MAMBA_ALIGN_POSTPROCESS.wrap(_keeping_offset_zero)
