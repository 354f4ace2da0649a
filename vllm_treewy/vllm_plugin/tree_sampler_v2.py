"""Tree acceptance on Model Runner V2's logits layout: the sampling path of `tree_runner_v2`'s hook 3 (its module
docstring, 3., says why it is exact): one draw per logits row from V2's sampler, the one-call walk over them, V2's
output rows, and the compaction, GDN slots' accepted leaves and acceptance for the drafter. Everything after V2's
draws that has static shapes is one function, `accept_and_commit_tree_rows`: run eagerly, or replayed as a CUDA graph
for steps whose requests are all tree rows (`tree_accept_graphs`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm_treewy.spec_decode.acceptance import TreeAcceptance
from vllm_treewy.spec_decode.tree_drafting import accepted_path_sources
from vllm_treewy.spec_decode.tree_sampling import sampled_tree_acceptance_of_draws
from vllm_treewy.vllm_plugin.runner_v2 import leaf_count_groups
from vllm_treewy.vllm_plugin.tree_speculator_v2 import TreeRunStateV2
from vllm_treewy.vllm_plugin.tree_step import TreeStep, device_arange

# -- acceptance on V2's logits layout --------------------------------------------------------------------------

@dataclass
class TreeSampling:
    sampled: torch.Tensor  # [num_reqs, 1 + num_speculative_steps] V2's layout: emitted tokens, -1 after
    num_sampled: torch.Tensor  # [num_reqs] int32 emitted tokens per row (before V2's chunked-prefill correction)
    acceptance: TreeAcceptance  # the tree rows'
    chain_rows: torch.Tensor  # [num_logits] int64 logits rows with each tree row's block laid out as its path


def accept_tree_rows(step: TreeStep, row_draws: torch.Tensor, cu_num_logits: torch.Tensor, input_ids: torch.Tensor,
                     num_speculative_steps: int) -> TreeSampling:
    """The walk over one draw per logits row (`row_draws [num_logits]`, V2's packed rows: request r owns rows
    `cu_num_logits[r] .. cu_num_logits[r + 1]`, a tree row its verified block in block order). `input_ids`: the
    step's token ids (a tree row's drafts at its block tokens 1 .. N). Device ops of shapes the host knows."""
    num_requests, block_len = step.num_requests, step.block_len
    device = row_draws.device
    cu = cu_num_logits.long()
    num_reqs, num_logits = cu.numel() - 1, row_draws.numel()
    from vllm_treewy.vllm_plugin.tree_sampler import PLACEHOLDER_TOKEN, tree_output_rows, walk_tables

    block_rows = cu[step.request_indices][:, None] + device_arange(block_len, device)  # [R, 1 + N]
    drafts = input_ids[step.token_indices.view(num_requests, block_len)[:, 1:]].long()  # [R, N]
    # the walk over every node's draw at once (uniform_tree_acceptance: a fixed number of ops, whatever the depth)
    acceptance = sampled_tree_acceptance_of_draws(walk_tables(step.tree.parents, device), drafts,
                                                  row_draws[block_rows].long())
    drafts = drafts.reshape(-1)  # [R * N]

    sampled = torch.full((num_reqs, 1 + num_speculative_steps), PLACEHOLDER_TOKEN, dtype=torch.long, device=device)
    sampled[:, 0] = row_draws[cu[1:] - 1].long()  # every other row's one draw (its last logits row)
    sampled[step.request_indices, : step.depth + 1] = tree_output_rows(step, drafts, acceptance)
    num_sampled = torch.ones(num_reqs, dtype=torch.int32, device=device)
    num_sampled[step.request_indices] = (acceptance.num_accepted + 1).to(torch.int32)
    chain_rows = device_arange(num_logits, device).clone()
    chain_rows[block_rows.reshape(-1)] = block_rows.gather(
        1, accepted_path_sources(acceptance.accepted_nodes, block_len)).reshape(-1)
    return TreeSampling(sampled, num_sampled, acceptance, chain_rows)


def accept_and_commit_tree_rows(step: TreeStep, row_draws: torch.Tensor, cu_num_logits: torch.Tensor,
                                input_ids: torch.Tensor, num_speculative_steps: int, idx_mapping: torch.Tensor,
                                gdn_groups) -> TreeSampling:
    """Everything of a tree step after V2's draws that has static shapes: the walk (`accept_tree_rows`), the accepted
    paths' K/V compaction (`commit_accepted_path`, the layers recorded in `step`) and each tree row's accepted leaf
    into its GDN slots (`record_accepted_leaves`). `idx_mapping [num_reqs]`: V2's batch row -> request state;
    `gdn_groups`: `(count state, V2's block table [max_num_reqs, max_blocks] by request state)` per counted GDN
    group (column 0 of a request's row is its slot). Device ops of host-known shapes, no host sync: the one body
    that runs eagerly, or inside a CUDA graph over padded buffers (`tree_accept_graphs`)."""
    from vllm_treewy.vllm_plugin.tree_sampler import commit_accepted_path, record_accepted_leaves

    result = accept_tree_rows(step, row_draws, cu_num_logits, input_ids, num_speculative_steps)
    commit_accepted_path(step, result.acceptance)
    tree_rows = idx_mapping[step.request_indices]
    for counts, block_table in gdn_groups:
        record_accepted_leaves(counts, block_table[tree_rows, 0], result.acceptance)
    return result


def sample_tree_step(runner, hidden_states: torch.Tensor, input_batch, step: TreeStep, state: TreeRunStateV2):
    """V2's `sample` for a step with tree rows: `(SamplerOutput, num_sampled, num_rejected)` as V2's rejection
    sampler gives them; then the compaction, the GDN slots' accepted leaves, and the acceptance for the drafter.
    A step whose requests are all tree rows replays the captured graph of `accept_and_commit_tree_rows` where one
    holds the batch (`TreeAcceptGraphs.replay`); any other runs it eagerly."""
    from vllm.v1.worker.gpu.input_batch import get_num_sampled_and_rejected
    from vllm.v1.worker.gpu.sample.output import SamplerOutput
    from vllm.v1.worker.gpu.sample.states import NO_LOGPROBS

    sampler = runner.sampler
    logits = runner.model.compute_logits(hidden_states[input_batch.logits_indices])
    rows = input_batch.logits_indices
    upper_bound = input_batch.seq_lens_cpu_upper_bound.numpy()
    draws, processed = sampler.sample(
        logits, input_batch.expanded_idx_mapping, input_batch.idx_mapping, input_batch.idx_mapping_np,
        input_batch.positions[rows], input_batch.input_ids[rows], input_batch.expanded_local_pos, upper_bound)
    graphs = state.accept_graphs
    result = None if graphs is None else graphs.replay(step, draws, input_batch)
    if result is None:
        result = accept_and_commit_tree_rows(step, draws, input_batch.cu_num_logits, input_batch.input_ids,
                                             runner.num_speculative_steps, input_batch.idx_mapping,
                                             leaf_count_groups(runner))
    num_sampled, num_rejected = get_num_sampled_and_rejected(
        result.num_sampled, input_batch.seq_lens, input_batch.cu_num_logits, input_batch.idx_mapping,
        sampler.req_states.prefill_len.gpu)
    logprobs = None
    max_num_logprobs = sampler.sampling_states.max_num_logprobs(input_batch.idx_mapping_np)
    if max_num_logprobs != NO_LOGPROBS:
        from vllm.config.model import PROCESSED_LOGPROBS_MODES

        source = processed if sampler.logprobs_mode in PROCESSED_LOGPROBS_MODES else logits
        logprobs = runner.rejection_sampler._get_logprobs_tensors(
            result.sampled, num_sampled, source[result.chain_rows], input_batch.cu_num_logits,
            input_batch.cu_num_logits_np, max_num_logprobs)
    state.accepted = (step, result.acceptance)
    output = SamplerOutput(sampled_token_ids=result.sampled, logprobs_tensors=logprobs, num_nans=None,
                           num_sampled=num_sampled, num_rejected=num_rejected)
    return output, num_sampled, num_rejected
