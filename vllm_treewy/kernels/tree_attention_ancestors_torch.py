"""The ancestor pass of two-pass tree attention, in plain torch: every token of a step attends to its ancestors and
itself among the step's new tokens, returning its output and log-sum-exp (twin of
`tree_attention_ancestors_triton`; the math is in `tree_attention_reference`).

A verified block is one request's 1 + N new tokens of a step: the root (block index 0) and the draft nodes in node
order, back to back in the step's token axis from the request's `query_start_loc`. `block_ancestors [1 + N, A]`
(int32, the tree's, static): row i lists the block indices of i's ancestors and itself (column 0: i), -1 padding;
A = max_depth + 1. `tree_token_ancestors` turns it into per-token indices into the step's key/value rows: tokens of
requests whose query holds exactly 1 + N tokens get their ancestors' rows; every other token (a one-token decode, the
padding past the batch) gets itself alone, which is exact for a one-token query. Device ops of static shapes, no
host sync: capturable.
"""

from __future__ import annotations

import torch


def tree_token_ancestors(query_start_loc: torch.Tensor, num_tokens: int, block_ancestors: torch.Tensor) -> torch.Tensor:
    """`[num_tokens, A]` int64: the key rows each token attends to in the ancestor pass (column 0: itself), -1 padding.

    `query_start_loc [R + 1]` int: the requests' queries back to back (vLLM's metadata field, padded requests have
    empty queries); `block_ancestors [1 + N, A]`: the tree's ancestor table (module docstring)."""
    block_len, width = block_ancestors.shape
    starts = query_start_loc.long()
    tokens = torch.arange(num_tokens, device=starts.device)
    request = torch.searchsorted(starts[1:], tokens, right=True).clamp(max=starts.numel() - 2)
    start = starts[request]
    index = tokens - start
    in_block = (starts[request + 1] - start == block_len) & (tokens < starts[-1])
    table = block_ancestors.long()[index.clamp(max=block_len - 1)]
    from_block = torch.where(table >= 0, start[:, None] + table, -1)
    alone = torch.full_like(from_block, -1)
    alone[:, 0] = tokens
    return torch.where(in_block[:, None], from_block, alone)


def tree_attention_ancestors_torch(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, query_start_loc: torch.Tensor,
    block_ancestors: torch.Tensor, scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(output [T, H, D], lse [H, T])`: each token's attention over its ancestors and itself among the step's new
    tokens, the rows `tree_token_ancestors(query_start_loc, T, block_ancestors)` names.

    `query [T, H, D]`, `key`/`value [T, H_kv, D]` (the step's new tokens, H a multiple of H_kv: query head h reads
    KV head h // (H / H_kv)); `query_start_loc [R + 1]`, `block_ancestors [1 + N, A]` (module docstring). `output`
    in query's dtype, `lse` fp32 (natural log of the sum of exp(scale * q.k)); computed in fp32."""
    num_tokens, num_heads, head_size = query.shape
    ancestors = tree_token_ancestors(query_start_loc, num_tokens, block_ancestors)
    group = num_heads // key.shape[1]
    valid = ancestors >= 0
    rows = ancestors.clamp(min=0)
    keys = key.float()[rows].repeat_interleave(group, dim=2)  # [T, A, H, D]
    values = value.float()[rows].repeat_interleave(group, dim=2)
    scores = torch.einsum("thd,tahd->tha", query.float(), keys) * scale
    scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [T, H]
    probabilities = torch.exp(scores - lse[..., None])
    output = torch.einsum("tha,tahd->thd", probabilities, values)
    return output.to(query.dtype), lse.transpose(0, 1).contiguous()

