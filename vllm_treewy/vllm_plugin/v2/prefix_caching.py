"""Reconstruct under vLLM's prefix caching of GDN states (align mode): Model Runner V2's hooks. The design, and what
V2's align mode does (`vllm/v1/worker/gpu/model_states/mamba_hybrid.py`), is `gdn.prefix_caching`'s docstring; the
parts both runners share live there.

- V2's copy functions (`initialize_kv_cache`) get the pseudo-value buffer's states, as V1's do.
- V2's `postprocess_state` is skipped under reconstruct; the counts and boundary states are written right after
  sampling by `record_after_sampling_v2`, from `v2.accepted_counts`'s `postprocess_sampled` hook.
- V2's feature check lists reconstruct with prefix caching and pipeline parallelism (V1 runs it).
"""

from __future__ import annotations

import functools

import torch
from vllm.v1.attention.backends.utils import NULL_BLOCK_ID

from vllm_treewy.kernels.bookkeeping.boundary_states_torch import record_accepted_and_boundaries_torch, sampled_rows
from vllm_treewy.kernels.bookkeeping.boundary_states_triton import (
    record_accepted_and_boundaries_triton,
    sampled_rows_triton,
)
from vllm_treewy.vllm_plugin.config import reconstructs_mamba_state
from vllm_treewy.vllm_plugin.gdn.prefix_caching import (
    caches_gdn_prefixes,
    commit_table,
    runner_boundary_layers,
    tree_commit_counts,
    v2_unsupported_with_prefix_caching,
    with_buffer_copies,
)
from vllm_treewy.vllm_plugin.patch_points import (
    MAMBA_GROUPS,
    MAMBA_VALIDATE_STATE_COPY_FUNCS,
    V2_MAMBA_INITIALIZE_KV_CACHE,
    V2_MAMBA_POSTPROCESS_STATE,
    V2_UNSUPPORTED_FEATURES,
)


def record_after_sampling_v2(runner, idx_mapping: torch.Tensor, num_sampled: torch.Tensor, tree=None,
                             accepted_tree=None, chain_offset: int = 0) -> None:
    """Model Runner V2, right after sampling (`postprocess_sampled`, before the drafter proposes): what
    `record_after_sampling` does on V1, for V2's batch rows `idx_mapping [rows]` (each row's request state, whose
    block-table row V2 keeps for the request's life; -1: skip) and sampled counts `num_sampled [rows]` (accepted +
    1). The step's seq lens are V2's persistent input buffer (batch rows, as the forward had them); the rows' drafts
    come from the first group's slot counts (`sampled_rows`). A draft-tree config passes its `tree`, the tree
    sampler's `accepted_tree` ((TreeStep, TreeAcceptance), batch rows; None in a step without tree rows) and a chain
    step's `chain_offset` (`tree_commit_counts`); the kernels then follow the commit table. Device tensors only, no
    host sync; CUDA: one more launch (the counts) for trees."""
    views, table, block_size = runner_boundary_layers(
        runner, lambda group_id: runner.block_tables.block_tables[group_id].gpu)
    if not views:
        return
    num_rows = idx_mapping.shape[0]
    seq_lens = runner.input_buffers.seq_lens
    counts_layer = views[0]
    rows = (counts_layer.counts, counts_layer.block_table, idx_mapping, seq_lens, num_sampled, num_rows)
    commit_ancestors = None if tree is None else commit_table(runner, idx_mapping.device)

    def counts_of(accepted):
        return accepted if tree is None else tree_commit_counts(accepted, num_rows, chain_offset, accepted_tree)

    if table is None:
        drafts, accepted = sampled_rows(*rows, block_size=block_size, null_block=NULL_BLOCK_ID)
        record_accepted_and_boundaries_torch(views, seq_lens, drafts, counts_of(accepted), num_rows,
                                             block_size=block_size, null_block=NULL_BLOCK_ID,
                                             idx_mapping=idx_mapping, commit_ancestors=commit_ancestors)
    else:
        drafts, accepted = sampled_rows_triton(*rows, block_size=block_size, null_block=NULL_BLOCK_ID)
        record_accepted_and_boundaries_triton(views, table, seq_lens, drafts, counts_of(accepted), num_rows,
                                              block_size=block_size, null_block=NULL_BLOCK_ID,
                                              idx_mapping=idx_mapping, commit_ancestors=commit_ancestors)


def _reconstructs_in_align_mode_v2(model_state) -> bool:
    """A V2 model state in align mode (`MambaHybridModelState._align_mode`) under reconstruct."""
    return model_state._align_mode and reconstructs_mamba_state(model_state.vllm_config.speculative_config)


def _v2_copying_pseudo_value_buffer(original):
    @functools.wraps(original)
    def initialize_kv_cache(self, kv_cache_config, block_tables):
        if _reconstructs_in_align_mode_v2(self) and self._mamba_state_copy_funcs is None:
            if self.recoverssm is not None:
                raise ValueError("mamba_state_commit='reconstruct' does not run with use_kda_recoverssm")
            # V2's own choice (the model's copy functions), then the buffer's; V2 keeps them for its fused
            # pre-copy's state table and takes them as they are from here on (the profiling KV cache's teardown
            # keeps them too)
            groups = MAMBA_GROUPS.resolve()(kv_cache_config)
            funcs = with_buffer_copies(self.model.get_mamba_state_copy_funcs({spec.mamba_type for spec in groups}))
            MAMBA_VALIDATE_STATE_COPY_FUNCS.resolve()(groups, funcs)
            self._mamba_state_copy_funcs = funcs
        return original(self, kv_cache_config, block_tables)

    return initialize_kv_cache


def _v2_keeping_offset_zero(original):
    @functools.wraps(original)
    def postprocess_state(self, idx_mapping, num_sampled, num_computed_tokens=None):
        if not _reconstructs_in_align_mode_v2(self):
            return original(self, idx_mapping, num_sampled, num_computed_tokens)
        # reconstruct: V2's accepted counts stay 1 (its pre-copy migrates at offset 0) and store_all's boundary copy
        # does not run; `record_after_sampling_v2` writes the boundary states (recoverssm, KDA's, is refused above)
        return None

    return postprocess_state


def _v2_unsupported_with_prefix_caching(original):
    @functools.wraps(original)
    def unsupported_features(self) -> list[str]:
        features = original(self)
        feature = v2_unsupported_with_prefix_caching(self)
        if feature is not None:
            features.append(feature)
        return features

    return unsupported_features


def install(model_state_hooks: bool) -> None:
    """V2's feature check (every process); with `model_state_hooks` (CUDA, where V2 runs) V2's model-state hooks
    (its boundary writer is `v2.accepted_counts`'s postprocess_sampled hook)."""
    V2_UNSUPPORTED_FEATURES.wrap(_v2_unsupported_with_prefix_caching)
    if model_state_hooks:
        V2_MAMBA_INITIALIZE_KV_CACHE.wrap(_v2_copying_pseudo_value_buffer)
        V2_MAMBA_POSTPROCESS_STATE.wrap(_v2_keeping_offset_zero)
