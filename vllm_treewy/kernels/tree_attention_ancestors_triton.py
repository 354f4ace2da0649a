"""The ancestor pass of two-pass tree attention in one Triton launch: every token attends to its ancestors and itself
among the step's new tokens (`tree_attention_ancestors_torch` is its twin and states the layout), returning its output
and log-sum-exp for the merge with the prefix pass.

One program per (token, KV head), for the GQA group's GROUP = H / H_kv query heads of that KV head at once, as one
`[GROUP_PAD, BLOCK_D]` tile (GROUP_PAD: GROUP rounded up to a power of two, the padding rows masked). The program:

1. finds the token's request in `query_start_loc` by binary search (SEARCH_STEPS halvings, enough for any batch
   vLLM schedules; once the interval is empty a halving's load is masked off, so the search costs about log2(R)
   dependent loads whatever the bound, and one compiled variant serves every batch);
2. when that request's query is a verified block (BLOCK_LEN = 1 + N tokens), takes its ancestors' key rows from the
   tree's `block_ancestors` row; any other token (a one-token decode, the padding past the batch) attends to itself
   alone: `tree_token_ancestors`' rule, computed in the program so that the pass is one launch per attention layer
   with no index ops before it;
3. walks the at most A = max_depth + 1 key rows (unrolled; their loads depend on the table alone), reading each
   row's k and v once for the whole group, scoring `[GROUP]` by a product summed over D, and keeping an online
   softmax per query head (running max, sum and `[GROUP, D]` accumulator), all in fp32. A row is loaded as a
   `[GROUP_PAD, BLOCK_D]` tile of one address per column, in the tile's own layout: each warp reads it for its own
   heads (L1 hits after the first), so no row crosses warps through shared memory and no barrier orders the rows'
   loads (a `[D]` vector broadcast over the group costs a shared-memory layout conversion and two barriers per k and
   per v, serialising the rows).

Why this shape: the work is tiny (a handful of rows per token) and the launch is latency-bound, so what counts is the
chain of dependent loads per program and the number of programs. Per (token, KV head) the group's query heads share
the search, the table row and every K/V row (loaded once instead of GROUP times), and the grid shrinks by GROUP. The
per-row loop keeps the live tiles at `[GROUP_PAD, D]` (q and the accumulator): a `[GROUP, A, D]` broadcast would hold
A times that in registers at D = 256, and `tl.dot` would pad both GROUP and A to 16 for a product of a few rows.
NUM_WARPS = 4: at GROUP_PAD x D = 8 x 256 that is 16 fp32 elements a thread per tile (no spills, every reduction
over D inside a warp); fewer warps lengthen each program (the small batches' latency), more replicate the scalar
search and table work per warp (the large batches' instruction count).

Compiled variants: one per head layout, tree and dtype signature (`num_requests` is not specialised, and the search's
bound is fixed), so no batch compiles a new one in the middle of serving. Static grid from the token and KV head
counts; topology as tensors; no host sync: capturable.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

NUM_WARPS = 4  # module docstring
SEARCH_STEPS = 24  # binary-search halvings over the requests: batches of up to 2^24 - 1 requests


@triton.jit(do_not_specialize=["num_requests"])
def _tree_attention_ancestors_kernel(
    query, key, value, query_start_loc, block_ancestors, output, lse, scale, num_requests,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh, stride_b, stride_lh,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_SIZE: tl.constexpr, BLOCK_LEN: tl.constexpr, A: tl.constexpr,
    BLOCK_D: tl.constexpr, STEPS: tl.constexpr,
):
    token = tl.program_id(0)
    kv_head = tl.program_id(1)
    # the token's request: how many queries end at or before it (query_start_loc[1:] <= token), at most R - 1
    low = token * 0
    high = token * 0 + num_requests
    for _ in tl.static_range(STEPS):
        searching = low < high
        middle = (low + high) // 2
        end = tl.load(query_start_loc + 1 + middle, mask=searching, other=0)
        high = tl.where(searching & (end > token), middle, high)
        low = tl.where(searching & (end <= token), middle + 1, low)
    request = tl.minimum(low, num_requests - 1)
    start = tl.load(query_start_loc + request)
    in_block = ((tl.load(query_start_loc + request + 1) - start) == BLOCK_LEN) & (
        token < tl.load(query_start_loc + num_requests))
    index = tl.minimum(tl.maximum(token - start, 0), BLOCK_LEN - 1)

    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, BLOCK_D)
    g_in = g < GROUP
    d_in = d < HEAD_SIZE
    heads = kv_head * GROUP + g
    tile_in = g_in[:, None] & d_in[None, :]
    q = tl.load(query + token * stride_qt + heads[:, None] * stride_qh + d[None, :], mask=tile_in, other=0.0)
    q = q.to(tl.float32) * scale
    # online softmax per query head; a finite initial max keeps the first rescale exp(-huge) = 0, never NaN
    top = tl.full([GROUP_PAD], -1e30, tl.float32)
    total = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, BLOCK_D], tl.float32)
    rows_d = g[:, None] * 0 + d[None, :]  # a K/V row's columns, repeated for every head of the tile
    for j in tl.static_range(A):
        ancestor = tl.load(block_ancestors + index * stride_b + j)
        from_block = tl.where(ancestor >= 0, start + ancestor, -1)
        row = tl.where(in_block, from_block, tl.where(j == 0, token, -1))
        live = row >= 0
        row = tl.maximum(row, 0).to(tl.int64)
        k = tl.load(key + row * stride_kt + kv_head * stride_kh + rows_d, mask=live & d_in[None, :], other=0.0)
        v = tl.load(value + row * stride_vt + kv_head * stride_vh + rows_d, mask=live & d_in[None, :], other=0.0)
        scores = tl.where(live, tl.sum(q * k.to(tl.float32), axis=1), float("-inf"))
        new_top = tl.maximum(top, scores)
        rescale = tl.exp(top - new_top)
        weights = tl.exp(scores - new_top)
        total = total * rescale + weights
        acc = acc * rescale[:, None] + weights[:, None] * v.to(tl.float32)
        top = new_top
    out = acc / total[:, None]
    tl.store(output + token * stride_ot + heads[:, None] * stride_oh + d[None, :], out.to(output.dtype.element_ty),
             mask=tile_in)
    tl.store(lse + heads * stride_lh + token, top + tl.log(total), mask=g_in)


def tree_attention_ancestors_triton(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, query_start_loc: torch.Tensor,
    block_ancestors: torch.Tensor, scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(output [T, H, D] in query's dtype, lse [H, T] fp32)`, as `tree_attention_ancestors_torch`.

    `query [T, H, D]`, `key`/`value [T, H_kv, D]` with unit stride in the last axis (any token and head strides);
    `query_start_loc [R + 1]` int32 (R >= 1), `block_ancestors [1 + N, A]` int32 with unit stride in its last axis."""
    num_tokens, num_heads, head_size = query.shape
    num_kv_heads = key.shape[1]
    output = torch.empty_like(query)
    lse = torch.empty(num_heads, num_tokens, dtype=torch.float32, device=query.device)
    if num_tokens == 0:
        return output, lse
    if query.stride(2) != 1 or key.stride(2) != 1 or value.stride(2) != 1 or block_ancestors.stride(1) != 1:
        raise ValueError("tree_attention_ancestors_triton: query, key, value and block_ancestors need unit stride "
                         "in their last axis")
    if num_heads % num_kv_heads:
        raise ValueError(f"tree_attention_ancestors_triton: {num_heads} query heads over {num_kv_heads} KV heads")
    num_requests = query_start_loc.shape[0] - 1
    if num_requests < 1 or num_requests >= 2**SEARCH_STEPS:
        raise ValueError(f"tree_attention_ancestors_triton: {num_requests} requests (1 to {2**SEARCH_STEPS - 1})")
    block_len, width = block_ancestors.shape
    group = num_heads // num_kv_heads
    _tree_attention_ancestors_kernel[(num_tokens, num_kv_heads)](
        query, key, value, query_start_loc, block_ancestors, output, lse, scale, num_requests,
        query.stride(0), query.stride(1), key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        output.stride(0), output.stride(1), block_ancestors.stride(0), lse.stride(0),
        GROUP=group, GROUP_PAD=triton.next_power_of_2(group), HEAD_SIZE=head_size, BLOCK_LEN=block_len, A=width,
        BLOCK_D=triton.next_power_of_2(head_size), STEPS=SEARCH_STEPS, num_warps=NUM_WARPS,
    )
    return output, lse
