"""The `width` most likely tokens of each logits row, in plain torch: the twin of `top_children_triton` (the CPU path
and the specification).

A drafting level's children are the top-`width` token ids of each node's logits (`spec_decode.tree_drafting`). The
order is total and deterministic, unlike `torch.topk`'s, which leaves the order of equal values unspecified:

- larger logits first;
- among equal logits, the lowest token id first (+0.0 and -0.0 are equal);
- NaN ranks above every number, +inf included, as in `torch.topk` (among NaNs, the lowest token id first).

Both sides rank by one int64 key per token (`order_keys`), distinct within a row since it holds the token id, so
that a top-`width` has one answer: the value's order as an int32 (the float32 bit pattern made monotone, zeros
folded, NaN on top) in the high 32 bits, 2^31 - 1 - token id in the low 32. fp32, bf16 and fp16 logits (their
float32 values are exact, so the order is the dtype's own).
"""

from __future__ import annotations

import torch

LOGIT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
LOW_BITS = 2**32  # the token id's part of a key sits below this
TOP_ID = 2**31 - 1  # low part = TOP_ID - token id: in [0, 2^31), larger for a lower id
NAN_ORDER = 2**31 - 1  # a NaN's value order, above +inf's bit pattern 0x7F800000


def check_logits(logits: torch.Tensor, width: int) -> None:
    """The contract both sides share: `[M, vocab]` logits of a dtype in LOGIT_DTYPES, 1 <= width <= vocab."""
    if logits.dim() != 2 or logits.dtype not in LOGIT_DTYPES:
        raise ValueError(f"top_children: logits [M, vocab] of fp32, bf16 or fp16, got {tuple(logits.shape)} "
                         f"{logits.dtype}")
    if not 1 <= width <= logits.shape[1]:
        raise ValueError(f"top_children: width {width} outside 1 .. vocab {logits.shape[1]}")


def order_keys(logits: torch.Tensor) -> torch.Tensor:
    """`[M, vocab]` int64: each token's key, larger = ranked first (the module's order), distinct within a row."""
    values = logits.float()
    bits = values.view(torch.int32)
    order = torch.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)  # negative floats: larger magnitude, smaller order
    order = torch.where(values == 0, 0, order)
    order = torch.where(values.isnan(), NAN_ORDER, order)
    token_ids = torch.arange(logits.shape[1], device=logits.device)
    return order.long() * LOW_BITS + (TOP_ID - token_ids)


def top_children_torch(logits: torch.Tensor, width: int) -> torch.Tensor:
    """`[M * width]` int64: the `width` top token ids of each row of ``logits [M, vocab]`` in the module's order, row
    by row (row m's at m * width ..). Device ops of static shapes (capturable); allocates M x vocab temporaries."""
    check_logits(logits, width)
    return order_keys(logits).topk(width, dim=-1).indices.reshape(-1)
