"""The `width` most likely tokens of each logits row in two Triton launches: `top_children_torch` is its twin and
states the order (larger logits first, the lowest token id first among equal ones, NaN above every number).

A split-vocab reduction, so that a few rows still spread over the GPU:

- stage 1, one program per (row, chunk of CHUNK token ids): the chunk's top-`width` order keys
  (`top_children_torch.order_keys`: one int64 per token, the value's order above the token id, distinct within a
  row) into a workspace row of num_chunks x width candidates;
- stage 2, one program per row: the top-`width` of its candidates, their token ids into the output.

Exact: the row's top-`width` under a total order lie among its chunks' top-`width`. A top-`width` is `width` rounds
of a max over the keys, the winner masked out after each (one winner a round: the keys are distinct). Static grids
from the host's row count and vocab; no host sync: capturable.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .top_children_torch import check_logits

# Token ids a stage-1 program reduces. A 248k vocab (Qwen3.5) is then ~61 programs a row, so a batch of a few rows
# still spreads over the GPU's SMs, while a program's keys stay in registers (32 a thread at 4 warps) for its
# `width` rounds, and stage 2 merges at most 61 x width candidates in one block.
CHUNK = 4096
_FLOOR: tl.constexpr = tl.constexpr(-(2**63))  # below every key: a masked-out or past-the-vocab token


def chunk_size(vocab: int) -> int:
    """The token ids a stage-1 program takes for rows of `vocab`: CHUNK, or the vocab's power of two below it."""
    return min(CHUNK, triton.next_power_of_2(vocab))


@triton.jit
def _order_keys(values, token_ids):
    """`top_children_torch.order_keys` of loaded logits at their token ids (int64 keys)."""
    values = values.to(tl.float32)
    bits = values.to(tl.int32, bitcast=True)
    order = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
    order = tl.where(values == 0, 0, order)
    order = tl.where(values != values, 0x7FFFFFFF, order)
    return order.to(tl.int64) * 4294967296 + (0x7FFFFFFF - token_ids).to(tl.int64)


# One compiled variant per logits dtype and width: the row stride and the logits' alignment (row slices of a larger
# tensor) never compile a new one in the middle of serving.
@triton.jit(do_not_specialize=["stride_row"], do_not_specialize_on_alignment=["logits"])
def _chunk_top_kernel(logits, stride_row, vocab, candidates, WIDTH: tl.constexpr, CHUNK_SIZE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    token_ids = chunk * CHUNK_SIZE + tl.arange(0, CHUNK_SIZE)
    live = token_ids < vocab
    values = tl.load(logits + row * stride_row + token_ids, mask=live, other=0.0)
    keys = tl.where(live, _order_keys(values, token_ids), _FLOOR)
    out = candidates + (row * tl.num_programs(1) + chunk) * WIDTH
    for rank in tl.static_range(WIDTH):
        best = tl.max(keys, axis=0)
        tl.store(out + rank, best)
        keys = tl.where(keys == best, _FLOOR, keys)


@triton.jit
def _merge_kernel(candidates, num_candidates, out, WIDTH: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    slots = tl.arange(0, BLOCK)
    keys = tl.load(candidates + row * num_candidates + slots, mask=slots < num_candidates, other=_FLOOR)
    for rank in tl.static_range(WIDTH):
        best = tl.max(keys, axis=0)
        tl.store(out + row * WIDTH + rank, 0x7FFFFFFF - (best & 0x7FFFFFFF))  # the key's low part -> token id
        keys = tl.where(keys == best, _FLOOR, keys)


def top_children_triton(logits: torch.Tensor, width: int) -> torch.Tensor:
    """`top_children_torch` in two launches, the same contract: ``logits [M, vocab]`` (fp32, bf16 or fp16; unit stride
    in the vocab axis, any row stride), 1 <= width <= vocab (a tree's branching: `width` unrolled rounds); returns
    `[M * width]` int64 token ids, row by row, in the twin's order. Allocates per call, from the caching allocator
    (inside a CUDA graph: its pool), the output and a workspace of M x ceil(vocab / CHUNK) x width int64 keys."""
    check_logits(logits, width)
    if logits.stride(-1) != 1:
        raise ValueError("top_children_triton: logits need unit stride in the vocab axis")
    num_rows, vocab = logits.shape
    out = torch.empty(num_rows * width, dtype=torch.int64, device=logits.device)
    if num_rows == 0:
        return out
    chunk = chunk_size(vocab)
    num_candidates = triton.cdiv(vocab, chunk) * width
    candidates = torch.empty(num_rows, num_candidates, dtype=torch.int64, device=logits.device)
    _chunk_top_kernel[(num_rows, triton.cdiv(vocab, chunk))](logits, logits.stride(0), vocab, candidates,
                                                             WIDTH=width, CHUNK_SIZE=chunk)
    _merge_kernel[(num_rows,)](candidates, num_candidates, out, WIDTH=width,
                               BLOCK=triton.next_power_of_2(num_candidates))
    return out
