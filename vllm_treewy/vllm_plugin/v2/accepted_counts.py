"""The adapter's hooks in vLLM's Model Runner V2 (`vllm/v1/worker/gpu/`), the runner vLLM picks by default on CUDA.

Reconstruct chains run there on the parts every runner shares: the GDN layer (`gdn.layer`: the fused step, the page's
pseudo-value buffer and count state) and the per-step commit nodes and counts that vLLM's GDN metadata builder
derives (`gdn.step_metadata`: V2 calls the same builder's `build`, at FULL-graph capture too). What V2 does its own way:

- Further GDN groups: V2 builds the first GDN group's metadata and, for every further group of the same spec,
  re-gathers only the state indices from it (`GDNAttentionMetadataBuilder.update_block_table`, at capture too, so
  that the FULL graphs share the batch-level buffers). Each group has its own slots and count state (in its first
  layer's pages), so the re-gathered metadata gets the group's own commit nodes and count update, as `build` gives
  them (`gdn.step_metadata.with_commit_nodes`, into the group's builder's own persistent buffers).
- The accepted counts: V2 counts each batch row's sampled tokens on the device (`num_sampled`, accepted drafts + 1)
  and hands them to `GPUModelRunner.postprocess_sampled` right after sampling, before the drafter proposes; its own
  post-processing there keeps each request's accepted count (`num_accepted_tokens`, per request state, for the
  request's life) and hands it to the GDN metadata builder at the request's next step. Chains without prefix caching
  commit from that count (`gdn.step_metadata.uses_runner_accepted_counts`): nothing of ours runs after sampling.
  Draft trees record each row's accepted leaf in its slots instead (`v2.runner`'s tree sampler; a chain step of
  `draft_tree_max_batch_size` the sampled counts offset by 1 + N, `record_sampled_counts`: one launch for every
  group), and with prefix caching of GDN states (align mode) the slot is the request's running block, which moves:
  there `v2.prefix_caching.record_after_sampling_v2` writes the counts and the block-boundary states (V2's own align
  post-processing is skipped there, so its accepted counts stay 1); for draft trees too, with the commit table and the
  tree sampler's accepted leaves, outside the acceptance graphs (`leaf_counts_of`: the graphs then record no counts).
  V2 keeps a request's block-table row for the request's life (`idx_mapping` maps batch rows to them) and, under its
  default async scheduling, prepares the next step on the host before this one's tokens are known: device tensors
  only, no host sync.
- FULL decode graphs: V2 replays a FULL decode graph only for a batch whose rows all decode (a prefill keeps the
  batch out, `decode_graph_eligible`; a one-token prompt tail that runs as a decode is a speculative row of the GDN
  builder too), i.e. the batches the builder stages into its graph buffers, and the commit nodes with them. V1's
  runner needed `v1.full_graph_batches` for a prompt chunk of a decode's length; V2's dispatch never lets one in.
- Draft trees run on V2 through `v2.runner`'s hooks (VLLM_USE_V2_MODEL_RUNNER=0 puts them on the V1 runner's,
  `v1.runner`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from vllm_treewy.kernels.bookkeeping import dispatch, slot_counts_torch, slot_counts_triton
from vllm_treewy.vllm_plugin.config import keeps_slot_counts, reconstructs_mamba_state
from vllm_treewy.vllm_plugin.gdn.groups import counted_gdn_groups, step_buffers_of_runner
from vllm_treewy.vllm_plugin.gdn.prefix_caching import caches_gdn_prefixes
from vllm_treewy.vllm_plugin.gdn.sampling_tables import count_table_of
from vllm_treewy.vllm_plugin.gdn.step_metadata import with_commit_nodes
from vllm_treewy.vllm_plugin.patch_points import GDN_METADATA_UPDATE_BLOCK_TABLE, V2_RUNNER_POSTPROCESS_SAMPLED
from vllm_treewy.vllm_plugin.v2.prefix_caching import record_after_sampling_v2


def gdn_groups_of(runner) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`(count state, V2's block table by request state)` per GDN group that keeps slot counts (column 0 of a
    request's row is its slot)."""
    return [(counts, runner.block_tables.block_tables[group_id].gpu) for group_id, counts in counted_gdn_groups(runner)]


@dataclass
class CountedGroups:
    """GDN groups that keep slot counts: `(count state, V2's block table [max_num_reqs, max_blocks] by request state)`
    each (column 0 of a request's row is its slot), and on CUDA their `count_table` (`gdn.sampling_tables`: built
    again only where an address moved), with which one launch writes every group. What the after-sampling hook and the
    tree acceptance (eager or in its graphs, which keep the object) write counts through."""

    groups: list[tuple[torch.Tensor, torch.Tensor]]
    table: torch.Tensor | None = None

    @classmethod
    def of(cls, runner, groups: list[tuple[torch.Tensor, torch.Tensor]]) -> CountedGroups:
        launches = bool(groups) and dispatch.launches_triton(groups[0][0])
        return cls(groups, count_table_of(runner, groups) if launches else None)

    def record(self, idx_mapping: torch.Tensor, counts: torch.Tensor) -> None:
        """`counts [rows]` (at least 1 is written) into the slot of every batch row whose request state
        (`idx_mapping [rows]`, -1 to skip) holds a count in every group (`record_sampled_counts_*`). Device tensors
        only; CUDA: one launch."""
        if not self.groups:
            return
        num_rows = idx_mapping.shape[0]
        if self.table is not None:
            slot_counts_triton.record_sampled_counts_triton(self.table, idx_mapping, counts, num_rows)
        else:
            slot_counts_torch.record_sampled_counts_torch(self.groups, idx_mapping, counts, num_rows)


def leaf_counts_of(runner) -> CountedGroups:
    """The GDN groups (`gdn_groups_of`) whose slots the tree sampler and its acceptance graphs write the accepted
    leaves' counts into; none with prefix caching of GDN states (align mode), where the slot is the request's running
    column and the counts and boundary states are `v2.prefix_caching.record_after_sampling_v2`'s, after sampling."""
    return CountedGroups.of(runner, [] if caches_gdn_prefixes(runner.cache_config) else gdn_groups_of(runner))


def record_sampled_counts(runner, idx_mapping: torch.Tensor, num_sampled: torch.Tensor, offset: int = 0) -> None:
    """After V2's sampler counted this step's tokens per batch row (`num_sampled [rows]`; `idx_mapping [rows]`: each
    row's request state, -1 to skip): the speculative rows' counts (+ `offset`, `config.DraftShape.chain_count_offset`:
    a chain step of a tree config) into their slots in every GDN group that keeps slot counts. A row speculated this
    step iff its slot holds a count (the step's count update gave it its node count, every other row's slot 0), so no
    per-row flag is needed. Device tensors only; CUDA: one launch for every group."""
    groups = CountedGroups.of(runner, gdn_groups_of(runner))
    if offset and groups.groups:
        # a row that sampled nothing verified its root (the kernels' max(num_sampled, 1)), then the offset
        num_sampled = num_sampled[: idx_mapping.shape[0]].clamp(min=1) + offset
    groups.record(idx_mapping, num_sampled)


def _recording_sampled_counts(original):
    @functools.wraps(original)
    def postprocess_sampled(self, idx_mapping, sampled_tokens, num_sampled, num_rejected, *args, **kwargs):
        original(self, idx_mapping, sampled_tokens, num_sampled, num_rejected, *args, **kwargs)
        if not reconstructs_mamba_state(self.speculative_config):
            return
        buffers = step_buffers_of_runner(self)
        shape = buffers.shape
        tree = shape.tree
        if caches_gdn_prefixes(self.cache_config):  # the running slot moves with the request
            if tree is None:
                record_after_sampling_v2(self, idx_mapping, num_sampled)
            else:  # a tree step's accepted leaves (its sampler left the counts here), or a chain step's counts
                accepted = self.speculator.tree_state.accepted
                record_after_sampling_v2(
                    self, idx_mapping, num_sampled, tree=tree, accepted_tree=accepted,
                    chain_offset=shape.chain_count_offset if accepted is None else 0)
        elif tree is None:
            # the next step's count update commits from V2's own accepted counts (`gdn.step_metadata`)
            if not buffers.runner_accepted_counts:
                raise RuntimeError("reconstruct chains on Model Runner V2 commit from V2's accepted counts, but the "
                                   "GDN layers were built for another runner (VllmConfig.use_v2_model_runner)")
        elif shape.has_chain_steps and self.speculator.tree_state.accepted is None:
            # a chain step of draft_tree_max_batch_size: V2 samples, then postprocesses, then proposes, so the tree
            # acceptance is there for the drafter exactly after a tree step (whose counts are the tree sampler's)
            record_sampled_counts(self, idx_mapping, num_sampled, shape.chain_count_offset)

    return postprocess_sampled


def _regathering_commit_nodes(original):
    @functools.wraps(original)
    def update_block_table(self, metadata, blk_table, slot_mapping):
        updated = original(self, metadata, blk_table, slot_mapping)
        if not keeps_slot_counts(self.vllm_config.speculative_config):
            return updated
        # the first group's metadata says which shape the step verifies
        return with_commit_nodes(self, updated, getattr(metadata, "tree_ancestors", None) is not None)

    return update_block_table


def install() -> None:
    """CUDA only (V2 runs there): the metadata and sampling hooks."""
    GDN_METADATA_UPDATE_BLOCK_TABLE.wrap(_regathering_commit_nodes)
    V2_RUNNER_POSTPROCESS_SAMPLED.wrap(_recording_sampled_counts)
