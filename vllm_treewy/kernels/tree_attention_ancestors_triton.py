"""The ancestor pass of two-pass tree attention, with the merge folded in, in one Triton launch: every token attends
to its ancestors and itself among the step's new tokens, starting from the prefix pass's output and log-sum-exp, and
the merged attention lands in the caller's output rows (`tree_attention_ancestors_torch` is its twin and states the
contract and layout).

One program per (token, KV head), for the GQA group's GROUP = H / H_kv query heads of that KV head at once, as one
`[GROUP_PAD, BLOCK_D]` tile (GROUP_PAD: GROUP rounded up to a power of two, the padding rows masked). The program:

1. finds the token's request in `query_start_loc` by binary search (SEARCH_STEPS halvings, enough for any batch
   vLLM schedules; once the interval is empty a halving's load is masked off, so the search costs about log2(R)
   dependent loads whatever the bound, and one compiled variant serves every batch);
2. starts each query head's online softmax (running max, sum and `[GROUP, D]` accumulator, fp32) from the prefix
   pass as its first "key": max = the prefix's log-sum-exp, sum = 1, accumulator = the prefix's output, which is
   exactly the softmax state after the prefix's keys (e^{lse - max} = 1 and the normalised output). A prefix with no
   keys has a non-finite log-sum-exp (FlashAttention 3 writes +inf, a merge -inf); it starts from the empty state
   (sum 0) and its output row is never loaded, so garbage or NaN there cannot reach the result;
3. when the token's request is a verified block (BLOCK_LEN = 1 + N tokens), takes its ancestors' key rows from the
   tree's `block_ancestors` row; any other token (a one-token decode, the padding past the batch) attends to itself
   alone: `tree_token_ancestors`' rule, computed in the program so that the pass needs no index ops before it;
4. walks the at most A = max_depth + 1 key rows (unrolled; their loads depend on the table alone), reading each
   row's k and v once for the whole group, scoring `[GROUP]` by a product summed over D, and updating the online
   softmax. A row is loaded as a `[GROUP_PAD, BLOCK_D]` tile of one address per column, in the tile's own layout:
   each warp reads it for its own heads (L1 hits after the first), so no row crosses warps through shared memory and
   no barrier orders the rows' loads (a `[D]` vector broadcast over the group costs a shared-memory layout
   conversion and two barriers per k and per v, serialising the rows);
5. writes acc / sum, in the output's dtype, into the caller's output row, unless the token is at or past
   `query_start_loc[-1]` (a CUDA graph's padding rows keep what they held).

Why this shape: the work is tiny (a handful of rows per token) and the launch is latency-bound, so what counts is the
number of launches, the chain of dependent loads per program and the number of programs. Folding the merge in saves
a launch per attention layer (vLLM's `merge_attn_states`), the suffix output and log-sum-exp round trip through
memory, and the masked copy of the merged rows into the output (an arange, a compare, a where and a copy); the
prefix's row and log-sum-exp are two more loads at the start, independent of the search. Per (token, KV head) the
group's query heads share the search, the table row and every K/V row (loaded once instead of GROUP times), and the
grid shrinks by GROUP. The per-row loop keeps the live tiles at `[GROUP_PAD, D]` (q and the accumulator): a
`[GROUP, A, D]` broadcast would hold A times that in registers at D = 256, and `tl.dot` would pad both GROUP and A
to 16 for a product of a few rows. NUM_WARPS = 4: at GROUP_PAD x D = 8 x 256 that is 16 fp32 elements a thread per
tile (no spills, every reduction over D inside a warp); fewer warps lengthen each program (the small batches'
latency), more replicate the scalar search and table work per warp (the large batches' instruction count).

Compiled variants: one per head layout, tree and dtype signature (`num_requests` is not specialised, and the search's
bound is fixed), so no batch compiles a new one in the middle of serving. Static grid from the token and KV head
counts; topology as tensors; no allocation, no host sync: capturable.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

NUM_WARPS = 4  # module docstring
SEARCH_STEPS = 24  # binary-search halvings over the requests: batches of up to 2^24 - 1 requests


@triton.jit(do_not_specialize=["num_requests"])
def _tree_attention_ancestors_kernel(
    query, key, value, query_start_loc, block_ancestors, prefix_output, prefix_lse, output, scale, num_requests,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_pt, stride_ph, stride_lh, stride_lt,
    stride_ot, stride_oh, stride_b,
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
    in_batch = token < tl.load(query_start_loc + num_requests)
    in_block = ((tl.load(query_start_loc + request + 1) - start) == BLOCK_LEN) & in_batch
    index = tl.minimum(tl.maximum(token - start, 0), BLOCK_LEN - 1)

    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, BLOCK_D)
    g_in = g < GROUP
    d_in = d < HEAD_SIZE
    heads = kv_head * GROUP + g
    tile_in = g_in[:, None] & d_in[None, :]
    q = tl.load(query + token * stride_qt + heads[:, None] * stride_qh + d[None, :], mask=tile_in, other=0.0)
    q = q.to(tl.float32) * scale
    # The online softmax per query head starts as the prefix pass left it: max = its log-sum-exp, sum = 1,
    # accumulator = its (normalised) output. A prefix without keys (log-sum-exp +inf, -inf or NaN) starts empty: a
    # finite max that keeps the first rescale exp(-huge) = 0, never NaN; sum 0; its output row not loaded.
    lse = tl.load(prefix_lse + heads * stride_lh + token * stride_lt, mask=g_in & in_batch, other=float("-inf"))
    has_prefix = (lse > float("-inf")) & (lse < float("inf"))
    top = tl.where(has_prefix, lse, -1e30)
    total = tl.where(has_prefix, 1.0, 0.0)
    acc = tl.load(prefix_output + token * stride_pt + heads[:, None] * stride_ph + d[None, :],
                  mask=tile_in & has_prefix[:, None], other=0.0).to(tl.float32)
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
             mask=tile_in & in_batch)


def tree_attention_ancestors_triton(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, query_start_loc: torch.Tensor,
    block_ancestors: torch.Tensor, prefix_output: torch.Tensor, prefix_lse: torch.Tensor, output: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Writes each token's attention over its request's prefix and its ancestors-and-self into `output` and returns
    `output`, as `tree_attention_ancestors_torch` (the contract: rows at or past `query_start_loc[-1]` untouched).

    `query [T, H, D]`, `key`/`value [T, H_kv, D]`, `prefix_output [T, H, D]` with unit stride in the last axis (any
    token and head strides: views of a fused QKV output, FlashAttention's output); `prefix_lse [H, T]` fp32 (any
    strides: FlashAttention's varlen `softmax_lse`); `output [T, H, D]` or `[T, H * D]` with unit stride in the last
    axis, any dtype Triton stores (the forward's output buffer); `query_start_loc [R + 1]` int32 (R >= 1),
    `block_ancestors [1 + N, A]` int32 with unit stride in its last axis. Allocates nothing."""
    num_tokens, num_heads, head_size = query.shape
    num_kv_heads = key.shape[1]
    if num_tokens == 0:
        return output
    rows = output.view(num_tokens, num_heads, head_size)
    if (query.stride(2) != 1 or key.stride(2) != 1 or value.stride(2) != 1 or prefix_output.stride(2) != 1
            or rows.stride(2) != 1 or block_ancestors.stride(1) != 1):
        raise ValueError("tree_attention_ancestors_triton: query, key, value, prefix_output, output and "
                         "block_ancestors need unit stride in their last axis")
    if prefix_output.shape != query.shape or prefix_lse.shape != (num_heads, num_tokens):
        raise ValueError(f"tree_attention_ancestors_triton: prefix_output {tuple(prefix_output.shape)} and "
                         f"prefix_lse {tuple(prefix_lse.shape)} for query {tuple(query.shape)} (want [T, H, D] and "
                         "[H, T])")
    if num_heads % num_kv_heads:
        raise ValueError(f"tree_attention_ancestors_triton: {num_heads} query heads over {num_kv_heads} KV heads")
    num_requests = query_start_loc.shape[0] - 1
    if num_requests < 1 or num_requests >= 2**SEARCH_STEPS:
        raise ValueError(f"tree_attention_ancestors_triton: {num_requests} requests (1 to {2**SEARCH_STEPS - 1})")
    block_len, width = block_ancestors.shape
    group = num_heads // num_kv_heads
    _tree_attention_ancestors_kernel[(num_tokens, num_kv_heads)](
        query, key, value, query_start_loc, block_ancestors, prefix_output, prefix_lse, rows, scale, num_requests,
        query.stride(0), query.stride(1), key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        prefix_output.stride(0), prefix_output.stride(1), prefix_lse.stride(0), prefix_lse.stride(1),
        rows.stride(0), rows.stride(1), block_ancestors.stride(0),
        GROUP=group, GROUP_PAD=triton.next_power_of_2(group), HEAD_SIZE=head_size, BLOCK_LEN=block_len, A=width,
        BLOCK_D=triton.next_power_of_2(head_size), STEPS=SEARCH_STEPS, num_warps=NUM_WARPS,
    )
    return output
