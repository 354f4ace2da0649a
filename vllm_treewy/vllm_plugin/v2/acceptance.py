"""Tree acceptance on Model Runner V2's logits layout, after V2's draws: the walk, the accepted paths' K/V compaction
and each tree row's accepted leaf into its GDN slots. Device ops of host-known shapes, no host sync: the one body that
runs eagerly (`v2.sampler`) or inside a CUDA graph over padded buffers (`v2.accept_graphs`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm_treewy.spec_decode.acceptance import TreeAcceptance
from vllm_treewy.spec_decode.tree_drafting import accepted_path_sources
from vllm_treewy.spec_decode.synthetic_acceptance import synthetic_tree_acceptance
from vllm_treewy.spec_decode.tree_sampling import sampled_tree_acceptance_of_draws
from vllm_treewy.vllm_plugin.trees.sampling import (
    PLACEHOLDER_TOKEN,
    commit_accepted_path,
    rate_index,
    record_accepted_leaves,
    tree_output_rows,
    walk_tables,
)
from vllm_treewy.vllm_plugin.trees.step import TreeStep
from vllm_treewy.vllm_plugin.trees.synthetic import SyntheticTreeRates


@dataclass
class TreeSampling:
    sampled: torch.Tensor  # [num_reqs, 1 + num_speculative_steps] V2's layout: emitted tokens, -1 after
    num_sampled: torch.Tensor  # [num_reqs] int32 emitted tokens per row (before V2's chunked-prefill correction)
    acceptance: TreeAcceptance  # the tree rows'
    chain_rows: torch.Tensor  # [num_logits] int64 logits rows with each tree row's block laid out as its path


def accept_tree_rows(step: TreeStep, row_draws: torch.Tensor, cu_num_logits: torch.Tensor, input_ids: torch.Tensor,
                     num_speculative_steps: int, synthetic_rates: torch.Tensor | None = None) -> TreeSampling:
    """The walk over one draw per logits row (`row_draws [num_logits]`, V2's packed rows: request r owns rows
    `cu_num_logits[r] .. cu_num_logits[r + 1]`, a tree row its verified block in block order). `input_ids`: the
    step's token ids (a tree row's drafts at its block tokens 1 .. N). `synthetic_rates [R, 2, D]` (benchmarks only,
    `spec_decode.synthetic_acceptance`): the tree rows' rates, which then decide the accepted paths instead of the
    draws (one uniform per node from the default generator: graph-capturable); the draws still give the bonus.
    Device ops of shapes the host knows."""
    num_requests, block_len = step.num_requests, step.block_len
    device = row_draws.device
    cu = cu_num_logits.long()
    num_reqs, num_logits = cu.numel() - 1, row_draws.numel()
    block_rows = cu[step.request_indices][:, None] + torch.arange(block_len, device=device)  # [R, 1 + N]
    drafts = input_ids[step.token_indices.view(num_requests, block_len)[:, 1:]].long()  # [R, N]
    # the walk over every node's draw at once (uniform_tree_acceptance: a fixed number of ops, whatever the depth)
    tables, block_draws = walk_tables(step.tree.parents, device), row_draws[block_rows].long()
    if synthetic_rates is None:
        acceptance = sampled_tree_acceptance_of_draws(tables, drafts, block_draws)
    else:
        uniforms = torch.rand(num_requests, step.tree.num_nodes, dtype=torch.float64, device=device)
        acceptance = synthetic_tree_acceptance(tables, rate_index(step.tree.parents, device), synthetic_rates,
                                               uniforms, block_draws)
    drafts = drafts.reshape(-1)  # [R * N]

    sampled = torch.full((num_reqs, 1 + num_speculative_steps), PLACEHOLDER_TOKEN, dtype=torch.long, device=device)
    sampled[:, 0] = row_draws[cu[1:] - 1].long()  # every other row's one draw (its last logits row)
    sampled[step.request_indices, : step.depth + 1] = tree_output_rows(step, drafts, acceptance)
    num_sampled = torch.ones(num_reqs, dtype=torch.int32, device=device)
    num_sampled[step.request_indices] = (acceptance.num_accepted + 1).to(torch.int32)
    chain_rows = torch.arange(num_logits, device=device)
    chain_rows[block_rows.reshape(-1)] = block_rows.gather(
        1, accepted_path_sources(acceptance.accepted_nodes, block_len)).reshape(-1)
    return TreeSampling(sampled, num_sampled, acceptance, chain_rows)


def accept_and_commit_tree_rows(step: TreeStep, row_draws: torch.Tensor, cu_num_logits: torch.Tensor,
                                input_ids: torch.Tensor, num_speculative_steps: int, idx_mapping: torch.Tensor,
                                gdn_groups, synthetic: SyntheticTreeRates | None = None) -> TreeSampling:
    """Everything of a tree step after V2's draws that has static shapes: the walk (`accept_tree_rows`), the accepted
    paths' K/V compaction (`commit_accepted_path`, the layers recorded in `step`) and each tree row's accepted leaf
    into its GDN slots (`record_accepted_leaves`). `idx_mapping [num_reqs]`: V2's batch row -> request state;
    `gdn_groups`: `(count state, V2's block table [max_num_reqs, max_blocks] by request state)` per counted GDN
    group (column 0 of a request's row is its slot). Device ops of host-known shapes, no host sync: the one body
    that runs eagerly, or inside a CUDA graph over padded buffers (`v2.accept_graphs`). `synthetic`: the engine's
    synthetic tree acceptance rates by request state (benchmarks only; None: real acceptance), gathered for the tree
    rows; only the accept decision changes, everything after it is the same."""
    tree_rows = idx_mapping[step.request_indices]
    rates = None if synthetic is None else synthetic.of_slots(tree_rows)
    result = accept_tree_rows(step, row_draws, cu_num_logits, input_ids, num_speculative_steps, rates)
    commit_accepted_path(step, result.acceptance)
    for counts, block_table in gdn_groups:
        record_accepted_leaves(counts, block_table[tree_rows, 0], result.acceptance)
    return result
