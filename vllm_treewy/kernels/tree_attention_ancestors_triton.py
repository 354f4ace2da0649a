"""The ancestor pass of two-pass tree attention in one Triton launch: every token attends to its ancestors and itself
among the step's new tokens (`tree_attention_ancestors_torch` is its twin and states the layout), returning its output
and log-sum-exp for the merge with the prefix pass.

One program per (token, query head). The program finds the token's request in `query_start_loc` by binary search
(SEARCH_STEPS halvings, enough for any batch vLLM schedules) and, when that request's query is a verified block
(1 + N tokens), its ancestors' key rows from the tree's `block_ancestors` row; any other token (a one-token decode,
the padding past the batch) attends to itself alone: `tree_token_ancestors`' rule, computed in the program so that
the pass is one launch per attention layer with no index ops before it. Then the at most A = max_depth + 1 key rows are gathered by index, scored, soft-maxed and
their values summed, in fp32. Static grid from the token and head counts; topology as tensors; no host sync:
capturable.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


SEARCH_STEPS = 24  # binary-search halvings over the requests: batches of up to 2^24 - 1 requests


@triton.jit(do_not_specialize=["num_requests"])
def _tree_attention_ancestors_kernel(
    query, key, value, query_start_loc, block_ancestors, output, lse, scale, num_requests,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh, stride_b, stride_lh,
    GROUP: tl.constexpr, HEAD_SIZE: tl.constexpr, BLOCK_LEN: tl.constexpr, A: tl.constexpr, BLOCK_A: tl.constexpr,
    BLOCK_D: tl.constexpr, STEPS: tl.constexpr,
):
    token = tl.program_id(0)
    head = tl.program_id(1)
    kv_head = head // GROUP
    # the token's request: how many queries end at or before it (query_start_loc[1:] <= token), at most R - 1
    low = token * 0
    high = token * 0 + num_requests
    for _ in tl.static_range(STEPS):
        searching = low < high
        middle = (low + high) // 2
        end = tl.load(query_start_loc + 1 + middle, mask=searching, other=0)
        after = searching & (end <= token)
        high = tl.where(searching & (end > token), middle, high)
        low = tl.where(after, middle + 1, low)
    request = tl.minimum(low, num_requests - 1)
    start = tl.load(query_start_loc + request)
    in_block = ((tl.load(query_start_loc + request + 1) - start) == BLOCK_LEN) & (
        token < tl.load(query_start_loc + num_requests))
    a = tl.arange(0, BLOCK_A)
    index = tl.minimum(tl.maximum(token - start, 0), BLOCK_LEN - 1)
    table = tl.load(block_ancestors + index * stride_b + a, mask=a < A, other=-1)
    from_block = tl.where(table >= 0, start + table, -1)
    alone = tl.where(a == 0, token, -1)
    rows = tl.where(in_block, from_block, alone).to(tl.int64)
    live = rows >= 0

    d = tl.arange(0, BLOCK_D)
    d_in = d < HEAD_SIZE
    q = tl.load(query + token * stride_qt + head * stride_qh + d, mask=d_in, other=0.0).to(tl.float32)
    kv_mask = live[:, None] & d_in[None, :]
    k = tl.load(key + rows[:, None] * stride_kt + kv_head * stride_kh + d[None, :], mask=kv_mask, other=0.0)
    scores = tl.sum(k.to(tl.float32) * q[None, :], axis=1) * scale
    scores = tl.where(live, scores, float("-inf"))
    top = tl.max(scores, axis=0)
    weights = tl.where(live, tl.exp(scores - top), 0.0)
    total = tl.sum(weights, axis=0)
    v = tl.load(value + rows[:, None] * stride_vt + kv_head * stride_vh + d[None, :], mask=kv_mask, other=0.0)
    out = tl.sum(weights[:, None] * v.to(tl.float32), axis=0) / total
    tl.store(output + token * stride_ot + head * stride_oh + d, out.to(output.dtype.element_ty), mask=d_in)
    tl.store(lse + head * stride_lh + token, top + tl.log(total))


def tree_attention_ancestors_triton(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, query_start_loc: torch.Tensor,
    block_ancestors: torch.Tensor, scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(output [T, H, D] in query's dtype, lse [H, T] fp32)`, as `tree_attention_ancestors_torch`.

    `query [T, H, D]`, `key`/`value [T, H_kv, D]` with unit stride in the last axis (any token and head strides);
    `query_start_loc [R + 1]` int32 (R >= 1), `block_ancestors [1 + N, A]` int32 with unit stride in its last axis."""
    num_tokens, num_heads, head_size = query.shape
    output = torch.empty_like(query)
    lse = torch.empty(num_heads, num_tokens, dtype=torch.float32, device=query.device)
    if num_tokens == 0:
        return output, lse
    if query.stride(2) != 1 or key.stride(2) != 1 or value.stride(2) != 1 or block_ancestors.stride(1) != 1:
        raise ValueError("tree_attention_ancestors_triton: query, key, value and block_ancestors need unit stride "
                         "in their last axis")
    num_requests = query_start_loc.shape[0] - 1
    if num_requests < 1 or num_requests >= 2**SEARCH_STEPS:
        raise ValueError(f"tree_attention_ancestors_triton: {num_requests} requests (1 to {2**SEARCH_STEPS - 1})")
    block_len, width = block_ancestors.shape
    _tree_attention_ancestors_kernel[(num_tokens, num_heads)](
        query, key, value, query_start_loc, block_ancestors, output, lse, scale, num_requests,
        query.stride(0), query.stride(1), key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        output.stride(0), output.stride(1), block_ancestors.stride(0), lse.stride(0),
        GROUP=num_heads // key.shape[1], HEAD_SIZE=head_size, BLOCK_LEN=block_len, A=width,
        BLOCK_A=max(2, triton.next_power_of_2(width)), BLOCK_D=triton.next_power_of_2(head_size), STEPS=SEARCH_STEPS,
    )
    return output, lse
