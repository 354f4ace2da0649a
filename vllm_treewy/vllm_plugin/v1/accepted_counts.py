"""Each speculative request's accepted count, recorded in its GDN slot right after sampling: the V1 runner's hook
(vLLM's CPU backend runs V1; on Model Runner V2 chains commit from V2's own accepted counts, `gdn.step_metadata`).

The next step's commit needs the node each slot accepted. vLLM's own per-row count (`num_accepted_tokens`) is not
enough: a running request that a step leaves unscheduled (its token budget spent) leaves vLLM's persistent batch,
and vLLM re-adds it with a count of 1 (`GPUModelRunner._update_states`, `InputBatch.add_request`), so a commit
that read it would rebuild the state at the wrong node (`tests/plugin/gdn/test_step_metadata.py`). The slot does not
move, so the count state of the pseudo-value buffer (in vLLM's KV cache) keeps it until the request's next step:
1 + the accepted node's index in the verified block (chains: vLLM's accepted count; draft trees: written by the
tree sampler). With a tree's `draft_tree_max_batch_size`, a step without tree rows verifies chains, whose counts go
in with `config.DraftShape.chain_count_offset` (the commit table's chain rows follow the tree's); a step with tree rows
has no chain rows (`trees.budget`) and leaves its counts to the tree sampler. With prefix caching (align mode) every
config's counts and block-boundary states are `v1.prefix_caching.record_after_sampling`'s (trees: with the commit
table and the tree sampler's accepted leaves). Device work right after vLLM's own
update, no host sync; for chains on CUDA one Triton launch for every group
(`kernels.bookkeeping.slot_counts_triton`).
"""

from __future__ import annotations

import functools

import torch

from vllm_treewy.kernels.bookkeeping import dispatch, slot_counts_torch, slot_counts_triton
from vllm_treewy.vllm_plugin.config import DraftShape, reconstructs_mamba_state
from vllm_treewy.vllm_plugin.gdn.groups import counted_gdn_groups, draft_shape_of_runner
from vllm_treewy.vllm_plugin.gdn.prefix_caching import caches_gdn_prefixes, commit_table, tree_commit_counts
from vllm_treewy.vllm_plugin.gdn.sampling_tables import count_table_of
from vllm_treewy.vllm_plugin.patch_points import RUNNER_AFTER_SAMPLING
from vllm_treewy.vllm_plugin.trees.run_state import tree_state_of
from vllm_treewy.vllm_plugin.v1 import prefix_caching


def gdn_slot_counts(runner, rows: torch.Tensor):
    """(count state, state slots of the batch `rows`) per KV-cache group of GDN layers that keep slot counts."""
    num_reqs = runner.input_batch.num_reqs
    for group_id, counts in counted_gdn_groups(runner):
        # Column 0 is the slot that holds the count (no prefix caching): reconstruct's one block per request, a
        # store_all tree's first of 1 + N.
        yield counts, runner.input_batch.block_table[group_id].get_device_tensor(num_reqs)[rows, 0]


def gdn_counts_and_block_tables(runner) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(count state, the group's whole device block table) per KV-cache group of GDN layers that keep slot counts
    (reconstruct, store_all draft trees): column 0 of a batch row is its slot."""
    return [(counts, runner.input_batch.block_table[group_id].block_table.gpu)
            for group_id, counts in counted_gdn_groups(runner)]


def record_chain_accepted_counts(runner, num_reqs: int, offset: int = 0) -> None:
    """After vLLM counted this step's accepted tokens per row (its `num_reqs` rows): the speculative rows' counts
    (+ `offset`, `config.DraftShape.chain_count_offset`) into their slots (rows that verified no drafts, e.g. prefills,
    keep their slot's count). Device tensors only: no host sync. CUDA: one launch for every group (it runs every
    step, outside the graphs)."""
    groups = gdn_counts_and_block_tables(runner)
    if not groups:
        return
    draft_tokens, accepted = runner.num_decode_draft_tokens.gpu, runner.num_accepted_tokens.gpu
    if offset:
        accepted = accepted[:num_reqs] + offset
    if dispatch.launches_triton(groups[0][0]):
        slot_counts_triton.record_accepted_counts_triton(count_table_of(runner, groups), draft_tokens, accepted,
                                                         num_reqs)
    else:
        slot_counts_torch.record_accepted_counts_torch(groups, draft_tokens, accepted, num_reqs)


def chain_step_of_tree_config(shape: DraftShape, scheduler_output) -> bool:
    """Whether a step of a tree config with `draft_tree_max_batch_size` verified chains (`DraftShape.verifies_tree`
    over the drafts the scheduler gave each request)."""
    drafts = [len(d) for d in scheduler_output.scheduled_spec_decode_tokens.values()]
    return shape.has_chain_steps and not shape.verifies_tree(drafts)


def _recording_accepted_counts(original):
    @functools.wraps(original)
    def update_states_after_model_execute(self, output_token_ids, scheduler_output):
        original(self, output_token_ids, scheduler_output)
        if not reconstructs_mamba_state(self.speculative_config):
            return
        shape = draft_shape_of_runner(self)
        tree = shape.tree
        num_reqs = output_token_ids.size(0)
        if caches_gdn_prefixes(self.cache_config):  # the running slot moves with the request
            if tree is None:
                prefix_caching.record_after_sampling(self, num_reqs)
            else:  # the tree sampler left the counts here (`v1.runner`)
                chain_step = chain_step_of_tree_config(shape, scheduler_output)
                counts = tree_commit_counts(
                    self.num_accepted_tokens.gpu, num_reqs, shape.chain_count_offset if chain_step else 0,
                    None if chain_step else tree_state_of(self).accepted)
                prefix_caching.record_after_sampling(self, num_reqs, counts, commit_table(self, counts.device))
        elif tree is None:
            record_chain_accepted_counts(self, num_reqs)
        elif chain_step_of_tree_config(shape, scheduler_output):
            record_chain_accepted_counts(self, num_reqs, shape.chain_count_offset)

    return update_states_after_model_execute


def install() -> None:
    RUNNER_AFTER_SAMPLING.wrap(_recording_accepted_counts)
