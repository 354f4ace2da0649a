"""The inputs of one MTP drafting level over every request's level block, in plain torch: the twin of
`level_inputs_triton` (the CPU path and the specification).

A drafting level forwards the MTP head over each request's level block (`spec_decode.tree_drafting`): the root (the
bonus token, with the target's hidden state at the last accepted token), then the level tree's n nodes in node order,
each with its token and, as its hidden input, the head's output at its parent. Request r's block occupies rows
r (1 + n) .. of the head's flat input buffers (V2's persistent ones), so the level's query layout and lengths follow.
"""

from __future__ import annotations

import torch


def level_inputs_torch(root_tokens: torch.Tensor, root_hidden: torch.Tensor, node_tokens: torch.Tensor,
                       outputs: torch.Tensor, parent_blocks: torch.Tensor, depths: torch.Tensor,
                       root_positions: torch.Tensor, max_position: int, input_ids: torch.Tensor,
                       hidden_states: torch.Tensor, positions: torch.Tensor, query_start_loc: torch.Tensor,
                       seq_lens: torch.Tensor) -> None:
    """Writes a level's inputs for R requests and a level tree of n nodes (block length 1 + n):

    - ``input_ids [R (1 + n)]``: the root's token (``root_tokens [R]``), then the nodes' (``node_tokens [R, n]``);
    - ``hidden_states [R (1 + n), H]``: ``root_hidden [R, H]``, then ``outputs [R, W, H]`` (the head's outputs by
      verified-block index, 0 = the root) at each node's parent block (``parent_blocks [n]``);
    - ``positions [R (1 + n)]``: root position + the block token's depth (``depths [1 + n]``), at most
      ``max_position``;
    - ``query_start_loc [R + 1]``: r (1 + n); ``seq_lens [R]``: root position + 1 + n.

    Device ops of static shapes (capturable); the outputs are views of persistent buffers, written in place."""
    num_requests, block_len = root_positions.shape[0], depths.shape[0]
    ids = input_ids.view(num_requests, block_len)
    ids[:, 0] = root_tokens
    ids[:, 1:] = node_tokens
    hidden = hidden_states.view(num_requests, block_len, -1)
    hidden[:, 0] = root_hidden
    hidden[:, 1:] = outputs[:, parent_blocks]
    positions.view(num_requests, block_len).copy_((root_positions[:, None] + depths).clamp(max=max_position))
    query_start_loc.copy_(torch.arange(num_requests + 1, device=root_positions.device) * block_len)
    seq_lens.copy_(root_positions + block_len)
