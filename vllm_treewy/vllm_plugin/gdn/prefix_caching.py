"""Reconstruct under vLLM's prefix caching of GDN states (`mamba_cache_mode="align"`, vLLM's default for Qwen3.5 /
Qwen3-Next whenever prefix caching is on, as it is by default on GPU): what both runners share (the boundary
layers and their table, the commit table, the tree rows' commit counts, the buffer's copy functions). The V1
runner's hooks are `v1.prefix_caching`, Model Runner V2's `v2.prefix_caching`.

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
  is zeroed by the prefill row (`gdn.step_metadata`), and a boundary block is written with count 0 anyway.

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
  `postprocess_sampled` (`v2.accepted_counts`), by the same kernel as on V1, with V2's tensors: the step's seq lens (its
  persistent input buffer, batch rows), `idx_mapping` to each row's block-table row, the sampled counts, and the
  rows' drafts from their slots' counts (one more launch: `sampled_rows`). Device tensors only, no host sync; both
  run outside V2's graphs (after sampling), as V2's own align post-processing does.
- With pipeline parallelism, V2's earlier ranks post-process a step pp_size steps later, after later steps rewrote
  the batch's seq lens: reconstruct with prefix caching keeps to the V1 runner there (the V2 feature check lists
  it).

Draft trees (reconstruct; store_all trees are refused with prefix caching, `gdn.layer`): a tree row's verified block
is the root and N nodes in node order, and its accepted path, the ancestors of the accepted leaf, is what reaches a
boundary. The same kernel runs with the commit table the verify follows (`commit_table`) and each row's commit count
(`tree_commit_counts`: 1 + the accepted leaf's block index for tree rows, a chain step's counts offset by 1 + N with
`draft_tree_max_batch_size`): on V1 from `v1.accepted_counts` after vLLM's own update, on V2 from `v2.accepted_counts`'s
postprocess_sampled hook with V2's tensors (after the tree sampler and its acceptance graphs, outside them); the tree
sampler then leaves the slots' counts to it (the slot is the running column, not column 0). vLLM's pre-copy and
skipped post-processing are the chains': nothing in them depends on the draft shape. The runner-independent parts
(the kernels, `boundary_layers`) take tensors only.
"""

from __future__ import annotations

import torch

from vllm_treewy.kernels.bookkeeping.boundary_states_torch import BoundaryLayer
from vllm_treewy.kernels.bookkeeping import dispatch
from vllm_treewy.kernels.bookkeeping.boundary_states_triton import boundary_table
from vllm_treewy.vllm_plugin.config import reconstructs_mamba_state
from vllm_treewy.vllm_plugin.gdn.groups import first_gdn_layer, gdn_groups
from vllm_treewy.vllm_plugin.gdn.pseudo_value_buffer import BufferLayout, GDNPage
from vllm_treewy.vllm_plugin.patch_points import MAMBA_TEMPORAL_COPY_SPEC

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


def runner_boundary_layers(runner, block_table_of=None):
    """(the runner's reconstruct GDN layers as `BoundaryLayer`s, each beside its group's device block table
    `block_table_of(group id)` (default: the V1 runner's, batch rows), their Triton table or None where the torch
    twin runs (`dispatch.launches_triton`: CPU), the GDN block size): one of the runner's `SamplingTables`. The first
    view is the first group's first layer, whose count state that group's count update writes
    (`gdn.step_metadata.counts_layer`).

    Built once per KV cache: again only where the first GDN layer's bound KV cache or a GDN group's block table is
    another object than it was built from. Both are made in the runner's `initialize_kv_cache`, and neither moves
    between steps: vLLM binds every layer's KV cache in one pass there (`bind_kv_cache_to_layers`: a rebinding of any
    GDN layer is one of the first too), and the block tables keep their addresses for the runner's life (Model Runner
    V2 keeps them in a table of pointers built once, `BlockTables.block_table_ptrs`). So a step walks neither the
    layers nor their states: it compares the first layer's KV cache and each GDN group's block table."""
    if block_table_of is None:
        def block_table_of(group_id):
            return runner.input_batch.block_table[group_id].block_table.gpu

    groups = list(gdn_groups(runner))
    first = first_gdn_layer(runner)
    if first is None:
        return [], None, None
    sources = (first.kv_cache, *(block_table_of(group_id) for group_id, _ in groups))

    def build():
        layers, block_tables, block_size = [], [], None
        forward_context = runner.compilation_config.static_forward_context
        for group_id, group in groups:
            block_size = group.kv_cache_spec.block_size
            for name in group.layer_names:
                if getattr(forward_context[name], "reconstructs_state", False):
                    layers.append(forward_context[name])
                    block_tables.append(block_table_of(group_id))
        if not layers:
            return [], None, block_size, sources
        views = boundary_layers(layers, block_tables)
        table = boundary_table(views) if dispatch.launches_triton(views[0].counts) else None
        return views, table, block_size, sources  # `sources` kept: their ids stay theirs while the entry lives

    tables = getattr(first, "sampling_tables", None)  # `sampling_tables.of_runner`
    views, table, block_size, _ = (build() if tables is None  # no layer keeps slot counts: nothing to keep
                                   else tables.get("boundary", tuple(map(id, sources)), build))
    return views, table, block_size


def commit_table(runner, device) -> torch.Tensor:
    """The commit table the GDN verify follows (`gdn.step_metadata.GroupStepBuffers.commit_ancestors`, the first GDN
    group's counts layer's: one table for every group, built once), for the boundary kernels' tree rows."""
    layer = first_gdn_layer(runner)
    if layer is not None:
        return layer.step_buffers.commit_ancestors(device)
    raise RuntimeError("a draft tree's boundary states need a GDN group")


def tree_commit_counts(accepted: torch.Tensor, num_reqs: int, chain_offset: int, accepted_tree=None) -> torch.Tensor:
    """`[num_reqs]` int32: the count each row's slot records in a draft-tree config (what `v1.sampler.
    record_accepted_leaves` and `v1.accepted_counts.record_chain_accepted_counts` write without prefix caching): vLLM's
    accepted count (`accepted`: a root-only row's 1 names node 0 in either shape), + `chain_offset` in a chain step
    of `draft_tree_max_batch_size`, and for the tree rows of `accepted_tree` ((TreeStep, TreeAcceptance), the tree
    sampler's) 1 + the verified-block index of the accepted leaf. Device ops, no host sync."""
    counts = accepted[:num_reqs].to(torch.int32) + chain_offset
    if accepted_tree is not None:
        step, acceptance = accepted_tree
        counts[step.request_indices] = (acceptance.last_accepted_node + 2).to(torch.int32)
    return counts


def with_buffer_copies(funcs):
    """vLLM's copy functions per mamba type, followed by a whole-block copy for each of the pseudo-value buffer's
    factors, conv inputs and count (the page's states in `GDNPage` order): the migration to a new running block takes
    the pending commit with it (at offset 0: the runner's accepted counts stay 1)."""
    extra = (MAMBA_TEMPORAL_COPY_SPEC.resolve(),) * len(BufferLayout.dtypes(torch.float32))
    return {mamba_type: (*copy_funcs, *extra) for mamba_type, copy_funcs in funcs.items()}


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
