"""The ancestor pass of two-pass tree attention in one Triton launch: every token attends to its ancestors and itself
among the step's new tokens (`tree_attention_ancestors_torch` is its twin and states the layout), returning its output
and log-sum-exp for the merge with the prefix pass.

One program per (token, query head): the token's at most A = max_depth + 1 key rows are gathered by index (a verified
block has 1 + N <= a few dozen tokens and A is the tree's depth + 1), scores, a softmax over them and the weighted sum
of the values, in fp32. Static grid from the token count and the head count; topology as the `ancestors` tensor; no
host sync: capturable.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _tree_attention_ancestors_kernel(
    query, key, value, ancestors, output, lse, scale,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh, stride_at, stride_lh,
    GROUP: tl.constexpr, HEAD_SIZE: tl.constexpr, A: tl.constexpr, BLOCK_A: tl.constexpr, BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0)
    head = tl.program_id(1)
    kv_head = head // GROUP
    a = tl.arange(0, BLOCK_A)
    d = tl.arange(0, BLOCK_D)
    d_in = d < HEAD_SIZE
    rows = tl.load(ancestors + token * stride_at + a, mask=a < A, other=-1).to(tl.int64)
    live = rows >= 0
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
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, ancestors: torch.Tensor, scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(output [T, H, D] in query's dtype, lse [H, T] fp32)`, as `tree_attention_ancestors_torch`.

    `query [T, H, D]`, `key`/`value [T, H_kv, D]` with unit stride in the last axis (any token and head strides);
    `ancestors [T, A]` int (`tree_token_ancestors`; column 0 of every row a valid row)."""
    num_tokens, num_heads, head_size = query.shape
    output = torch.empty_like(query)
    lse = torch.empty(num_heads, num_tokens, dtype=torch.float32, device=query.device)
    if num_tokens == 0:
        return output, lse
    if query.stride(2) != 1 or key.stride(2) != 1 or value.stride(2) != 1:
        raise ValueError("tree_attention_ancestors_triton: query, key and value need unit stride in the head axis")
    ancestors = ancestors.contiguous()
    width = ancestors.shape[1]
    _tree_attention_ancestors_kernel[(num_tokens, num_heads)](
        query, key, value, ancestors, output, lse, scale,
        query.stride(0), query.stride(1), key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        output.stride(0), output.stride(1), ancestors.stride(0), lse.stride(0),
        GROUP=num_heads // key.shape[1], HEAD_SIZE=head_size, A=width,
        BLOCK_A=max(2, triton.next_power_of_2(width)), BLOCK_D=triton.next_power_of_2(head_size),
    )
    return output, lse
