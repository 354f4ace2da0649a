"""Tree acceptance on Model Runner V2's logits layout, after V2's draws: the walk and V2's output rows
(`kernels.tree_acceptance_*`), the accepted paths' K/V compaction (`trees.sampling.commit_accepted_path`) and each tree
row's accepted leaf into its GDN slots (`v2.accepted_counts.CountedGroups`). On CUDA one launch each, plus one per
paged attention layer for the compaction; device ops of host-known shapes, no host sync: the one body that runs
eagerly (`v2.sampler`) or inside a CUDA graph over padded buffers (`v2.accept_graphs`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from vllm_treewy.kernels.bookkeeping import dispatch
from vllm_treewy.kernels.tree_acceptance_torch import SyntheticDraw, TreeRows, tree_acceptance_torch
from vllm_treewy.kernels.tree_acceptance_triton import tree_acceptance_triton
from vllm_treewy.vllm_plugin.trees.sampling import commit_accepted_path, rate_index, walk_tables
from vllm_treewy.vllm_plugin.trees.step import TreeStep
from vllm_treewy.vllm_plugin.trees.synthetic import SyntheticTreeRates

if TYPE_CHECKING:
    from vllm_treewy.vllm_plugin.v2.accepted_counts import CountedGroups


def accept_tree_rows(step: TreeStep, row_draws: torch.Tensor, cu_num_logits: torch.Tensor, input_ids: torch.Tensor,
                     num_speculative_steps: int, synthetic: SyntheticDraw | None = None) -> TreeRows:
    """The walk over one draw per logits row (`row_draws [num_logits]`, V2's packed rows: request r owns rows
    `cu_num_logits[r] .. cu_num_logits[r + 1]`, a tree row its verified block in block order) and V2's output rows
    (`kernels.tree_acceptance_torch`'s contract; its Triton twin on CUDA). `input_ids`: the step's token ids (a tree
    row's drafts at its block tokens 1 .. N). `synthetic` (benchmarks only, `spec_decode.synthetic_acceptance`): the
    tree rows' rates and uniforms, which then decide the accepted paths instead of the draws; the draws still give
    the bonus."""
    device = row_draws.device
    tables = walk_tables(step.tree.parents, device)
    token_indices = step.token_indices.view(step.num_requests, step.block_len)
    accept = tree_acceptance_triton if dispatch.launches_triton(row_draws) else tree_acceptance_torch
    return accept(row_draws, cu_num_logits, step.request_indices, token_indices, input_ids, tables,
                  num_speculative_steps, synthetic)


def accept_and_commit_tree_rows(step: TreeStep, row_draws: torch.Tensor, cu_num_logits: torch.Tensor,
                                input_ids: torch.Tensor, num_speculative_steps: int, idx_mapping: torch.Tensor,
                                leaf_counts: CountedGroups | None, synthetic: SyntheticTreeRates | None = None
                                ) -> TreeRows:
    """Everything of a tree step after V2's draws that has static shapes: the walk and output rows
    (`accept_tree_rows`), the accepted paths' K/V compaction (`commit_accepted_path`, the layers recorded in `step`) and
    each tree row's accepted leaf into its GDN slots (`leaf_counts`, `v2.accepted_counts.leaf_counts_of`: no group
    with prefix caching, whose hook records them after sampling; None: nothing recorded, the graphs' warm-up).
    `idx_mapping [num_reqs]`: V2's batch row -> request state. `synthetic`: the engine's synthetic tree acceptance
    rates by request state (benchmarks only; None: real acceptance), read for the tree rows by their states; only the
    accept decision changes, everything after it is the same."""
    draw = None
    if synthetic is not None:
        index = rate_index(step.tree.parents, row_draws.device)
        uniforms = torch.rand(step.num_requests, step.tree.num_nodes, dtype=torch.float64, device=row_draws.device)
        draw = SyntheticDraw(uniforms, synthetic.by_slot, idx_mapping, index.index)
    result = accept_tree_rows(step, row_draws, cu_num_logits, input_ids, num_speculative_steps, draw)
    commit_accepted_path(step, result.acceptance)
    if leaf_counts is not None:
        leaf_counts.record(idx_mapping, result.leaf_counts)
    return result
