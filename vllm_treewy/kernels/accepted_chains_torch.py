"""The MTP drafter's first-pass inputs with every tree row's verified block laid out as its accepted path's chain, in
plain torch: the twin of `accepted_chains_triton` (the CPU path and the specification).

After a tree step the drafter's first pass (vLLM's chain pass over the step's tokens) must see each tree row's
accepted path as if it had been verified as a chain (`spec_decode.tree_drafting.accepted_path_sources`): row i of the
row's verified block takes the token id and hidden state of the path's i-th token (root = 0; a path's node indices
increase along it, so a row reads its own block row or a later one) and the position root + i; rows past the path keep
their own inputs (vLLM's rejected-token padding). Every other token of the step (other requests, padding) keeps its
inputs.
"""

from __future__ import annotations

import torch

from ..spec_decode.tree_drafting import accepted_path_sources


def accepted_chains_torch(block_rows: torch.Tensor, accepted_nodes: torch.Tensor, root_positions: torch.Tensor,
                          token_ids: torch.Tensor, positions: torch.Tensor, hidden_states: torch.Tensor,
                          out_ids: torch.Tensor, out_positions: torch.Tensor, out_hidden: torch.Tensor) -> None:
    """Writes the chain inputs of a step of T tokens whose R tree rows verify blocks of L tokens:

    - ``block_rows [R, L]`` int64: the step's token row of every verified-block token (a tree row's block, root first);
    - ``accepted_nodes [R, D]``: each tree row's accepted path, local node indices root to leaf, -1 padding
      (`TreeAcceptance.accepted_nodes`); ``root_positions [R]`` int64: each root's position;
    - ``token_ids [T]``, ``positions [T]``, ``hidden_states [T, H]``: the step's inputs;
    - ``out_ids [T]``, ``out_positions [T]``, ``out_hidden [T, H]`` (the inputs' dtypes): the chains', written in
      place (views of persistent buffers; they must not overlap the inputs).

    Device ops, no host sync."""
    num_requests, block_len = block_rows.shape
    index = torch.arange(token_ids.shape[0], device=token_ids.device)
    index[block_rows.reshape(-1)] = block_rows.gather(1, accepted_path_sources(accepted_nodes, block_len)).reshape(-1)
    torch.index_select(token_ids, 0, index, out=out_ids)
    torch.index_select(hidden_states, 0, index, out=out_hidden)
    out_positions.copy_(positions)
    out_positions[block_rows.reshape(-1)] = (
        root_positions[:, None] + torch.arange(block_len, device=positions.device)).reshape(-1).to(out_positions.dtype)
