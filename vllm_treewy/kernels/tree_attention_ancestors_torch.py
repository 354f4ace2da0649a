"""The ancestor pass of two-pass tree attention, with the merge, in plain torch: every token of a step attends to its
ancestors and itself among the step's new tokens, merged by log-sum-exp with the prefix pass's output over its
request's committed prefix, into the caller's output rows (twin of `tree_attention_ancestors_triton`; the math is in
`tree_attention_reference`).

A verified block is one request's 1 + N new tokens of a step: the root (block index 0) and the draft nodes in node
order, back to back in the step's token axis from the request's `query_start_loc`. `block_ancestors [1 + N, A]`
(int32, the tree's, static): row i lists the block indices of i's ancestors and itself (column 0: i), -1 padding;
A = max_depth + 1. `tree_token_ancestors` turns it into per-token indices into the step's key/value rows: tokens of
requests whose query holds exactly 1 + N tokens get their ancestors' rows; every other token (a one-token decode, the
padding past the batch) gets itself alone, which is exact for a one-token query.

Three steps, as the contract (the Triton kernel does them in one program per token and KV head): `ancestor_attention`
(the ancestor keys' softmax output and log-sum-exp, fp32), `kernels.attention_merge_torch` (the union's softmax from
the two partial ones; a prefix without keys, log-sum-exp +inf or -inf, contributes nothing whatever its output row
holds), and the merged rows written into `output` for tokens before `query_start_loc[-1]` only (a CUDA graph's
padding rows keep what they held). Device ops of static shapes, no host sync: capturable (it allocates its
temporaries).
"""

from __future__ import annotations

import torch

from .attention_merge_torch import merge_attention_states_torch


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


def ancestor_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, query_start_loc: torch.Tensor,
    block_ancestors: torch.Tensor, scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(output [T, H, D] fp32, lse [H, T] fp32)`: each token's attention over its ancestors and itself among the
    step's new tokens alone, the rows `tree_token_ancestors(query_start_loc, T, block_ancestors)` names.

    `query [T, H, D]`, `key`/`value [T, H_kv, D]` (the step's new tokens, H a multiple of H_kv: query head h reads
    KV head h // (H / H_kv)); `query_start_loc [R + 1]`, `block_ancestors [1 + N, A]` (module docstring). `lse`:
    natural log of the sum of exp(scale * q.k). Computed in fp32 and returned unrounded (the merge's input)."""
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
    return output, lse.transpose(0, 1).contiguous()


def tree_attention_ancestors_torch(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, query_start_loc: torch.Tensor,
    block_ancestors: torch.Tensor, prefix_output: torch.Tensor, prefix_lse: torch.Tensor, output: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Writes each token's attention over the union of its request's committed prefix and its ancestors-and-self
    into `output` (in `output`'s dtype) and returns `output`; rows at or past `query_start_loc[-1]` keep what they
    held.

    `query [T, H, D]`, `key`/`value [T, H_kv, D]`, `query_start_loc [R + 1]`, `block_ancestors [1 + N, A]`:
    `ancestor_attention`'s. `prefix_output [T, H, D]` and `prefix_lse [H, T]` (fp32): the prefix pass's softmax
    output and log-sum-exp over each token's committed prefix (FlashAttention's varlen output and `softmax_lse`); a
    token without prefix keys has log-sum-exp +inf or -inf and any output row (NaN included). `output`: `[T, H, D]`
    or `[T, H * D]`. Computed in fp32, rounded once into `output`."""
    num_tokens, num_heads, head_size = query.shape
    suffix_output, suffix_lse = ancestor_attention(query, key, value, query_start_loc, block_ancestors, scale)
    merged = merge_attention_states_torch(torch.empty_like(suffix_output), prefix_output, prefix_lse, suffix_output,
                                          suffix_lse)
    rows = output.view(num_tokens, num_heads, head_size)
    in_batch = torch.arange(num_tokens, device=query.device) < query_start_loc[-1]
    rows.copy_(torch.where(in_batch[:, None, None], merged.to(rows.dtype), rows))
    return output
