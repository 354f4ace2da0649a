"""Reconstruct under vLLM's prefix caching of GDN states (`mamba_cache_mode="align"`, vLLM's default for Qwen3.5 /
Qwen3-Next whenever prefix caching is on, as it is by default on GPU), in vLLM's V1 runner.

What vLLM 0.32 does in align mode (V1, its own MTP: store_all; `v1/core/single_type_kv_cache_manager.MambaManager`,
`v1/worker/mamba_utils`, `v1/attention/backends/utils.mamba_get_block_table_tensor`):
- A request's GDN block table is indexed by position: column c stands for the state after (c + 1) * block_size
  tokens, the block whose hash a later request's prefix-cache hit finds (with MTP vLLM drops the last matching
  block). The request holds the running block (column (seq_len - 1) // block_size of the step's tokens, drafts
  included), the previous step's one until the request passes it, and store_all's k speculative blocks after the
  running one: 2 + k pages per request in vLLM's report (2 without speculation). Prefill chunks end on boundaries,
  so a chunk's final state is a boundary state in place.
- Before each forward (`preprocess_mamba`), a request whose running column moved copies its state into the new
  running block: conv and SSM state from column `prev + num_accepted - 1` (store_all's block of the accepted
  token; the conv window shifted by as much). A hit restores the same way: the hit block is the previous column.
- After sampling (`postprocess_mamba_align_gpu`, one launch), a row whose accepted tokens reached a boundary copies
  the state after the boundary token (store_all's block of that draft position) into the boundary's block, and a
  row whose boundary block is its running block gets num_accepted = 1 for the next step's offset. The GDN metadata
  (`gdn_attn`) carries the running column and the k after it as `spec_state_indices_tensor` and the accepted
  counts as `num_accepted_tokens`; it has no block-index fields of its own.

What reconstruct does instead (one state block per request, as align mode keeps without speculation: 2 pages in
vLLM's report):
- The migration to a new running block is vLLM's own copy, at offset 0 (the slot holds the committed state and
  the last verify's pseudo-value buffer, not a state per draft position), of every state on the page: the runner's
  copy functions (`GPUModelRunner._get_mamba_state_copy_funcs`) get the buffer's three states (factors, conv
  inputs, count) after the conv and SSM states, so the pending commit travels with the slot. vLLM's per-request
  path of that copy (its batch memcpy) runs: the runner's align buffers are made without the speculative
  post-processing context (`_get_mamba_bufs`), whose fused Triton copies vLLM's CPU backend does not have.
- After sampling, right where vLLM's post-processing ran and before the scheduler can hand a boundary block to a
  hit, every GDN layer's accepted counts and boundary states in one launch
  (`kernels.bookkeeping.boundary_states_triton`; on CPU its torch twin): the state after the boundary's node,
  rebuilt from the slot's committed state and the step's factors by the closed form (the commit of a node on the
  accepted path), and its conv window, into the boundary's block. Where that block is the slot itself (the row accepted
  a whole block's last token) the commit happens there and then, and the slot's count says nothing is pending. vLLM's
  own post-processing is skipped; the accepted counts it keeps on the host stay 1, so its migration copies at offset 0.
  The commit of the accepted node itself stays fused into the next verify.
- A cache hit restores through vLLM's migration copy and prefill, as without speculation; the restored page's count
  is zeroed by the prefill row (`step_metadata`), and a boundary block is written with count 0 anyway.

On Model Runner V2 (`vllm/v1/worker/gpu/model_states/mamba_hybrid.py`: its own align mode, on the device):
- V2 keeps a running column per request (`_mamba_state_idx_gpu`) and a per-request accepted count
  (`num_accepted_tokens_gpu`). Before the forward, `preprocess_state` emits each request's source column (the last
  running one) and offset (accepted - 1), advances the column and, where it moved, copies every state its copy
  functions name from the source column (shifted by the offset) into the new one
  (`MambaSpecDecodeGPUContext.run_fused_precopy`). Its copy functions come from the model
  (`initialize_kv_cache`); reconstruct's add the buffer's three states, as on V1.
- After sampling, `postprocess_state` stores each row's sampled count (accepted + 1) as that accepted count and
  runs store_all's boundary copy (`run_fused_postprocess_align`). Reconstruct skips both: V2's accepted counts stay
  1 (it seeds them 1 and its pre-copy only resets them to 1), so the pre-copy migrates at offset 0, and the GDN
  metadata gets 1s as on V1. The boundary states and counts are written right after, from V2's
  `postprocess_sampled` (`runner_v2`), by the same kernel as on V1, with V2's tensors: the step's seq lens (its
  persistent input buffer, batch rows), `idx_mapping` to each row's block-table row, the sampled counts, and the
  rows' drafts from their slots' counts (one more launch: `sampled_rows`). Device tensors only, no host sync; both
  run outside V2's graphs (after sampling), as V2's own align post-processing does.
- With pipeline parallelism, V2's earlier ranks post-process a step pp_size steps later, after later steps rewrote
  the batch's seq lens: reconstruct with prefix caching keeps to the V1 runner there (the V2 feature check lists
  it).

Draft trees (reconstruct; store_all trees are refused with prefix caching, `gdn_layer`): a tree row's verified block
is the root and N nodes in node order, and its accepted path, the ancestors of the accepted leaf, is what reaches a
boundary. The same kernel runs with the commit table the verify follows (`commit_table`) and each row's commit count
(`tree_commit_counts`: 1 + the accepted leaf's block index for tree rows, a chain step's counts offset by 1 + N with
`draft_tree_max_batch_size`): on V1 from `accepted_counts` after vLLM's own update, on V2 from `runner_v2`'s
postprocess_sampled hook with V2's tensors (after the tree sampler and its acceptance graphs, outside them); the tree
sampler then leaves the slots' counts to it (the slot is the running column, not column 0). vLLM's pre-copy and
skipped post-processing are the chains': nothing in them depends on the draft shape. The runner-independent parts
(the kernels, `boundary_layers`) take tensors only.
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from vllm_treewy.kernels.bookkeeping import dispatch
from vllm_treewy.kernels.bookkeeping.boundary_states_torch import (
    BoundaryLayer,
    record_accepted_and_boundaries_torch,
    sampled_rows,
)
from vllm_treewy.vllm_plugin import sampling_tables
from vllm_treewy.vllm_plugin.config import reconstructs_mamba_state
from vllm_treewy.vllm_plugin.patch_points import (
    MAMBA_ALIGN_POSTPROCESS,
    MAMBA_GROUPS,
    MAMBA_TEMPORAL_COPY_SPEC,
    MAMBA_VALIDATE_STATE_COPY_FUNCS,
    RUNNER_MAMBA_BUFFERS,
    RUNNER_MAMBA_STATE_COPY_FUNCS,
    V2_MAMBA_INITIALIZE_KV_CACHE,
    V2_MAMBA_POSTPROCESS_STATE,
    V2_UNSUPPORTED_FEATURES,
)
from vllm_treewy.vllm_plugin.pseudo_value_buffer import BufferLayout, GDNPage

ALIGN = "align"


def caches_gdn_prefixes(cache_config) -> bool:
    """True if vLLM caches GDN states at block boundaries (prefix caching on a hybrid model: align mode)."""
    return cache_config.mamba_cache_mode == ALIGN


def boundary_layers(layers, block_tables) -> list[BoundaryLayer]:
    """`BoundaryLayer` views of reconstruct GDN layers (`ReconstructGatedDeltaNetAttention`), each beside its
    KV-cache group's device block table (batch rows)."""
    return [BoundaryLayer(layer.ssm_state(), layer.pseudo_value_buffer().factors, layer.conv_history(),
                          layer.pseudo_value_buffer().conv_inputs, GDNPage.of(layer.kv_cache).counts.view(-1),
                          block_table)
            for layer, block_table in zip(layers, block_tables)]


def _runner_boundary_layers(runner, block_table_of=None):
    """(the runner's reconstruct GDN layers as `BoundaryLayer`s, each beside its group's device block table
    `block_table_of(group id)` (default: the V1 runner's, batch rows), their Triton table or None where the torch
    twin runs (`dispatch.launches_triton`: CPU), the GDN block size): one of the runner's `SamplingTables`, built
    again only where a layer's state or a block table moved. The first view is the first group's first layer, whose
    count state that group's count update writes (`step_metadata.counts_layer`)."""
    from vllm.v1.kv_cache_interface import MambaSpec

    if block_table_of is None:
        def block_table_of(group_id):
            return runner.input_batch.block_table[group_id].block_table.gpu

    layers, block_tables, block_size = [], [], None
    forward_context = runner.compilation_config.static_forward_context
    for group_id, group in enumerate(runner.kv_cache_config.kv_cache_groups):
        if not isinstance(group.kv_cache_spec, MambaSpec):
            continue
        block_size = group.kv_cache_spec.block_size
        for name in group.layer_names:
            if getattr(forward_context[name], "reconstructs_state", False):
                layers.append(forward_context[name])
                block_tables.append(block_table_of(group_id))
    if not layers:
        return [], None, block_size

    def build():
        views = boundary_layers(layers, block_tables)
        table = None
        if dispatch.launches_triton(views[0].counts):
            from vllm_treewy.kernels.bookkeeping.boundary_states_triton import boundary_table

            table = boundary_table(views)
        return views, table, block_size

    addresses = tuple(t.data_ptr() for t in (*(GDNPage.of(layer.kv_cache).ssm_state for layer in layers),
                                             *block_tables))
    return sampling_tables.of_runner(runner).get("boundary", addresses, build)


def commit_table(runner, tree, device) -> torch.Tensor:
    """The commit table the GDN verify follows (`step_metadata.GroupStepBuffers.commit_ancestors`, the first GDN
    group's counts layer's: one table for every group, built once), for the boundary kernels' tree rows."""
    from vllm.v1.kv_cache_interface import MambaSpec

    from vllm_treewy.vllm_plugin.step_metadata import chain_count_offset

    with_chain = chain_count_offset(runner.speculative_config) > 0
    forward_context = runner.compilation_config.static_forward_context
    for group in runner.kv_cache_config.kv_cache_groups:
        if isinstance(group.kv_cache_spec, MambaSpec):
            return forward_context[group.layer_names[0]].step_buffers.commit_ancestors(tree, with_chain, device)
    raise RuntimeError("a draft tree's boundary states need a GDN group")


def record_after_sampling(runner, num_reqs: int, commit_counts: torch.Tensor | None = None,
                          commit_ancestors: torch.Tensor | None = None) -> None:
    """After vLLM counted this step's accepted tokens per row: each speculative row's count into its slot and the
    boundary states its accepted tokens reached, in every GDN layer (one launch on CUDA). Device tensors only.
    Draft-tree configs pass the commit table and each row's count (`tree_commit_counts`): the boundary node is the
    accepted path's node at the boundary's depth (`kernels.bookkeeping.boundary_states_torch`)."""
    from vllm.v1.attention.backends.utils import NULL_BLOCK_ID

    views, table, block_size = _runner_boundary_layers(runner)
    if not views:
        return
    counts = runner.num_accepted_tokens.gpu if commit_counts is None else commit_counts
    args = (runner.seq_lens, runner.num_decode_draft_tokens.gpu, counts, num_reqs)
    if table is None:
        record_accepted_and_boundaries_torch(views, *args, block_size=block_size, null_block=NULL_BLOCK_ID,
                                             commit_ancestors=commit_ancestors)
    else:
        from vllm_treewy.kernels.bookkeeping.boundary_states_triton import record_accepted_and_boundaries_triton

        record_accepted_and_boundaries_triton(views, table, *args, block_size=block_size, null_block=NULL_BLOCK_ID,
                                              commit_ancestors=commit_ancestors)


def tree_commit_counts(accepted: torch.Tensor, num_reqs: int, chain_offset: int, accepted_tree=None) -> torch.Tensor:
    """`[num_reqs]` int32: the count each row's slot records in a draft-tree config (what `tree_sampler.
    record_accepted_leaves` and `accepted_counts.record_chain_accepted_counts` write without prefix caching): vLLM's
    accepted count (`accepted`: a root-only row's 1 names node 0 in either shape), + `chain_offset` in a chain step
    of `draft_tree_max_batch_size`, and for the tree rows of `accepted_tree` ((TreeStep, TreeAcceptance), the tree
    sampler's) 1 + the verified-block index of the accepted leaf. Device ops, no host sync."""
    counts = accepted[:num_reqs].to(torch.int32) + chain_offset
    if accepted_tree is not None:
        step, acceptance = accepted_tree
        counts[step.request_indices] = (acceptance.last_accepted_node + 2).to(torch.int32)
    return counts


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
    from vllm.v1.attention.backends.utils import NULL_BLOCK_ID

    views, table, block_size = _runner_boundary_layers(
        runner, lambda group_id: runner.block_tables.block_tables[group_id].gpu)
    if not views:
        return
    num_rows = idx_mapping.shape[0]
    seq_lens = runner.input_buffers.seq_lens
    counts_layer = views[0]
    rows = (counts_layer.counts, counts_layer.block_table, idx_mapping, seq_lens, num_sampled, num_rows)
    commit_ancestors = None if tree is None else commit_table(runner, tree, idx_mapping.device)

    def counts_of(accepted):
        return accepted if tree is None else tree_commit_counts(accepted, num_rows, chain_offset, accepted_tree)

    if table is None:
        drafts, accepted = sampled_rows(*rows, block_size=block_size, null_block=NULL_BLOCK_ID)
        record_accepted_and_boundaries_torch(views, seq_lens, drafts, counts_of(accepted), num_rows,
                                             block_size=block_size, null_block=NULL_BLOCK_ID,
                                             idx_mapping=idx_mapping, commit_ancestors=commit_ancestors)
    else:
        from vllm_treewy.kernels.bookkeeping.boundary_states_triton import (
            record_accepted_and_boundaries_triton,
            sampled_rows_triton,
        )

        drafts, accepted = sampled_rows_triton(*rows, block_size=block_size, null_block=NULL_BLOCK_ID)
        record_accepted_and_boundaries_triton(views, table, seq_lens, drafts, counts_of(accepted), num_rows,
                                              block_size=block_size, null_block=NULL_BLOCK_ID,
                                              idx_mapping=idx_mapping, commit_ancestors=commit_ancestors)


def with_buffer_copies(funcs):
    """vLLM's copy functions per mamba type, followed by a whole-block copy for each of the pseudo-value buffer's
    factors, conv inputs and count (the page's states in `GDNPage` order): the migration to a new running block takes
    the pending commit with it (at offset 0: the runner's accepted counts stay 1)."""
    extra = (MAMBA_TEMPORAL_COPY_SPEC.resolve(),) * len(BufferLayout.dtypes(torch.float32))
    return {mamba_type: (*copy_funcs, *extra) for mamba_type, copy_funcs in funcs.items()}


def _copying_pseudo_value_buffer(original):
    @functools.wraps(original)
    def get_mamba_state_copy_funcs(self):
        funcs = original(self)
        if not reconstructs_mamba_state(self.speculative_config):
            return funcs
        return with_buffer_copies(funcs)

    return get_mamba_state_copy_funcs


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


def v2_unsupported_with_prefix_caching(vllm_config) -> str | None:
    """The feature vLLM's V2 check lists for reconstruct with prefix caching of GDN states: only with pipeline
    parallelism (the module docstring says why); None otherwise."""
    cache_config = vllm_config.cache_config
    if not reconstructs_mamba_state(vllm_config.speculative_config):
        return None
    if not (cache_config.enable_prefix_caching or caches_gdn_prefixes(cache_config)):
        return None
    if vllm_config.parallel_config.pipeline_parallel_size <= 1:
        return None
    return ("mamba_state_commit='reconstruct' with prefix caching and pipeline parallelism (V2's earlier ranks "
            "post-process a step after later steps rewrote its seq lens; vllm-treewy's V1 runner hooks write the GDN "
            "block-boundary states)")


def _v2_unsupported_with_prefix_caching(original):
    @functools.wraps(original)
    def unsupported_features(self) -> list[str]:
        features = original(self)
        feature = v2_unsupported_with_prefix_caching(self)
        if feature is not None:
            features.append(feature)
        return features

    return unsupported_features


def install(runner_v2_hooks: bool) -> None:
    """The V2 feature check and the V1 runner's hooks (every process); with `runner_v2_hooks` (CUDA, where V2 runs)
    V2's model-state hooks (its boundary writer is `runner_v2`'s postprocess_sampled hook)."""
    V2_UNSUPPORTED_FEATURES.wrap(_v2_unsupported_with_prefix_caching)
    RUNNER_MAMBA_STATE_COPY_FUNCS.wrap(_copying_pseudo_value_buffer)
    RUNNER_MAMBA_BUFFERS.wrap(_without_speculative_postprocess)
    MAMBA_ALIGN_POSTPROCESS.wrap(_keeping_offset_zero)
    if runner_v2_hooks:
        V2_MAMBA_INITIALIZE_KV_CACHE.wrap(_v2_copying_pseudo_value_buffer)
        V2_MAMBA_POSTPROCESS_STATE.wrap(_v2_keeping_offset_zero)
