"""The prefix pass of two-pass tree attention, in plain torch: every query token attends, non-causally, to its
request's first `seqused_k` positions in a paged KV cache, returning its output and log-sum-exp.

On CUDA this pass is the attention backend's own paged kernel (FlashAttention's varlen function with `causal=False`
and `return_softmax_lse=True`); this is its stand-in on CPU and in tests, with the same layout: `key_cache` /
`value_cache [num_blocks, block_size, H_kv, D]` (any strides), request r's position p at
`block_table[r, p // block_size]`, offset `p % block_size`. A request whose `seqused_k` is 0 gets output 0 and
log-sum-exp -inf (FlashAttention 3 writes +inf there; a merge reads both as "no keys").
"""

from __future__ import annotations

import torch


def paged_prefix_attention_torch(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    *,
    cu_seqlens_q: torch.Tensor,
    seqused_k: torch.Tensor,
    block_table: torch.Tensor,
    max_seqlen_k: int,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(output [T, H, D] in query's dtype, lse [H, T] fp32)`; tokens past `cu_seqlens_q[-1]` get 0 and -inf.

    `query [T, H, D]`: request r's queries at rows `cu_seqlens_q[r] : cu_seqlens_q[r + 1]` (`cu_seqlens_q [R + 1]`);
    `seqused_k [R]`: its visible prefix length (<= `max_seqlen_k`, a Python int bound that fixes the padded shape);
    `block_table [R, max_blocks]`. GQA as `tree_attention_ancestors_torch`. fp32 compute; memory
    `[T, H, max_seqlen_k]` scores: a reference-grade path, not a fast one."""
    num_tokens, num_heads, head_size = query.shape
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    group = num_heads // num_kv_heads
    starts = cu_seqlens_q.long()
    num_requests = starts.numel() - 1
    tokens = torch.arange(num_tokens, device=query.device)
    request = torch.searchsorted(starts[1:], tokens, right=True).clamp(max=max(num_requests - 1, 0))
    is_query = tokens < starts[-1]
    positions = torch.arange(max(max_seqlen_k, 1), device=query.device)
    blocks = block_table.long()[:, : -(-positions.numel() // block_size)]
    slots = blocks[:, positions // block_size], positions % block_size  # [R, P] each
    keys = key_cache[slots].float().repeat_interleave(group, dim=2)  # [R, P, H, D]
    values = value_cache[slots].float().repeat_interleave(group, dim=2)
    visible = (positions[None, :] < seqused_k.long()[request][:, None]) & is_query[:, None]  # [T, P]
    scores = torch.einsum("thd,tphd->thp", query.float(), keys[request]) * scale
    scores = scores.masked_fill(~visible[:, None, :], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [T, H]; -inf where nothing is visible
    probabilities = torch.where(visible[:, None, :], torch.exp(scores - lse[..., None]), 0.0)
    # Unwritten positions may hold anything, NaN included; 0 * NaN would leak into the row.
    values = torch.where(visible[:, :, None, None], values[request], 0.0)
    output = torch.einsum("thp,tphd->thd", probabilities, values)
    return output.to(query.dtype), lse.transpose(0, 1).contiguous()
