"""Tree acceptance on a runner's logits layout after the draws, in plain torch: the twin of `tree_acceptance_triton`
(the CPU path and the specification; the CUDA path is the one-launch kernel).

Layout (vLLM Model Runner V2's, nothing of vLLM imported): a step of ``num_reqs`` batch rows, batch row b owning the
logits rows ``cu_num_logits[b] .. cu_num_logits[b + 1]``, each with one draw (``draws``: the target's token there,
sampled or greedy). The tree rows (``request_indices [R]``, ascending) verify a whole draft tree of N nodes: their
logits rows are their verified blocks (root, then the nodes in node order, ``spec_decode.acceptance``'s numbering) and
their drafts sit at the step's token rows ``token_indices [R, 1 + N]`` (block tokens 1 .. N) of ``input_ids``.

Per tree row the walk of ``spec_decode.acceptance`` over the draws (``uniform_tree_acceptance``: from the root, move
to the first child carrying the draw at the current node; stop where none does; the draw there is the bonus), or,
for benchmarks, synthetic acceptance (``spec_decode.synthetic_acceptance``: node n *carries* iff ``uniforms[r, n] <
rates[slots[b], rate_index[n]]``, whatever the tokens; the draws still give the bonus). Outputs, per batch row:

- ``sampled [num_reqs, 1 + num_speculative_steps]`` int64: a tree row's accepted path's tokens, then its bonus, then
  -1 (`PLACEHOLDER_TOKEN`); any other row its last logits row's draw, then -1;
- ``num_sampled [num_reqs]`` int32: accepted drafts + 1 (1 for other rows);
- ``leaf_counts [num_reqs]`` int32: a tree row's count for its GDN slots, 1 + the verified-block index of its
  accepted leaf (1: only the root); 0 for other rows (`slot_counts_*.record_sampled_counts_*` writes max(count, 1)
  into slots that hold a count: a one-token row's own);
- ``chain_rows [num_logits]`` int64: the logits row each row takes when a tree row's block is laid out as its
  accepted path (row i of the block: the block's row of its path's i-th token, root first; rows past the path, and
  every other row, themselves);
- ``acceptance``: the tree rows' `TreeAcceptance`.

No host sync, static shapes (a tree's depth is a Python int).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..spec_decode.acceptance import TreeAcceptance, UniformWalkTables, uniform_tree_acceptance, walk_of_matches
from ..spec_decode.tree_drafting import accepted_path_sources

PLACEHOLDER_TOKEN = -1  # vLLM's padding of sampled token rows


class SyntheticDraw(NamedTuple):
    """What synthetic acceptance decides with (a benchmark tool, `spec_decode.synthetic_acceptance`)."""

    uniforms: torch.Tensor  # [R, N] float64 in [0, 1), one per tree row and node
    rates: torch.Tensor  # [S, 2, D] float32 conditional rates by request state (row 0 first child, 1 later siblings)
    slots: torch.Tensor  # [num_reqs] each batch row's request state (V2's idx_mapping)
    rate_index: torch.Tensor  # [N] int64 each node's index into a state's flattened rates (`NodeRateIndex`)


class TreeRows(NamedTuple):
    sampled: torch.Tensor  # [num_reqs, 1 + num_speculative_steps] int64
    num_sampled: torch.Tensor  # [num_reqs] int32
    leaf_counts: torch.Tensor  # [num_reqs] int32
    chain_rows: torch.Tensor  # [num_logits] int64
    acceptance: TreeAcceptance  # the tree rows' (int64)


def tree_acceptance_torch(draws: torch.Tensor, cu_num_logits: torch.Tensor, request_indices: torch.Tensor,
                          token_indices: torch.Tensor, input_ids: torch.Tensor, tables: UniformWalkTables,
                          num_speculative_steps: int, synthetic: SyntheticDraw | None = None) -> TreeRows:
    """The module docstring's outputs. ``draws [num_logits]``; ``cu_num_logits [num_reqs + 1]``;
    ``request_indices [R]`` int64 (R >= 1); ``token_indices [R, 1 + N]`` int64; ``input_ids [T]``; ``tables``: the
    tree's `UniformWalkTables` on the device (N >= 1 nodes, depth D <= num_speculative_steps)."""
    device = draws.device
    block_len = 1 + tables.parent_blocks.numel()
    cu = cu_num_logits.long()
    num_reqs, num_logits = cu.numel() - 1, draws.numel()
    rows = request_indices.long()
    block_rows = cu[rows][:, None] + torch.arange(block_len, device=device)  # [R, 1 + N]
    block_draws = draws[block_rows].long()
    drafts = input_ids[token_indices.long()[:, 1:]].long()  # [R, N]
    if synthetic is None:
        acceptance = uniform_tree_acceptance(tables, drafts, block_draws)
    else:
        rates = synthetic.rates.reshape(synthetic.rates.shape[0], -1)[synthetic.slots.long()[rows]]
        carries = synthetic.uniforms < rates[:, synthetic.rate_index].to(synthetic.uniforms.dtype)
        acceptance = walk_of_matches(tables, carries, block_draws)

    depth = acceptance.accepted_nodes.shape[1]
    sampled = torch.full((num_reqs, 1 + num_speculative_steps), PLACEHOLDER_TOKEN, dtype=torch.long, device=device)
    sampled[:, 0] = draws[cu[1:] - 1].long()  # every other row's one draw (its last logits row)
    sampled[rows, : depth + 1] = output_rows(drafts, acceptance)
    num_sampled = torch.ones(num_reqs, dtype=torch.int32, device=device)
    num_sampled[rows] = (acceptance.num_accepted + 1).to(torch.int32)
    leaf_counts = torch.zeros(num_reqs, dtype=torch.int32, device=device)
    leaf_counts[rows] = (acceptance.last_accepted_node + 2).to(torch.int32)
    chain_rows = torch.arange(num_logits, device=device)
    chain_rows[block_rows.reshape(-1)] = block_rows.gather(
        1, accepted_path_sources(acceptance.accepted_nodes, block_len)).reshape(-1)
    return TreeRows(sampled, num_sampled, leaf_counts, chain_rows, acceptance)


def output_rows(drafts: torch.Tensor, acceptance: TreeAcceptance) -> torch.Tensor:
    """`[R, D + 1]` int64 rows `[path tokens..., bonus, -1...]` of the tree rows (`drafts [R, N]` int64, node order;
    `acceptance` theirs, D its depth)."""
    path = acceptance.accepted_nodes
    path_tokens = torch.where(path >= 0, drafts.gather(1, path.clamp(min=0)), PLACEHOLDER_TOKEN)
    rows = torch.cat([path_tokens, torch.full_like(path_tokens[:, :1], PLACEHOLDER_TOKEN)], dim=1)
    rows.scatter_(1, acceptance.num_accepted[:, None], acceptance.bonus_tokens[:, None])
    return rows
