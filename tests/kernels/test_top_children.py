"""A drafting level's top children (`kernels.top_children_*`): the Triton kernel (interpreted on CPU) returns exactly
the token ids its torch twin returns, and the twin what a per-token reference says (Python's sort over (NaN first,
larger value first, lower token id first)), on random row counts, vocab sizes (below one chunk, a chunk's edges, past
it with the last chunk partial, and with the chunk made small so that a row spans many), widths 1 .. 4, fp32, bf16 and
fp16 logits with forced ties (few distinct values), NaN, infinities and signed zeros, and row-strided views. Where
the logits are distinct and finite the order is `torch.topk`'s, the one the drafting levels had before."""

from __future__ import annotations

import math
from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_treewy.kernels import top_children_triton as triton_module
from vllm_treewy.kernels.top_children_torch import top_children_torch
from vllm_treewy.kernels.top_children_triton import CHUNK, top_children_triton
from vllm_treewy.vllm_plugin.trees.drafting import top_children

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
SPECIALS = [math.nan, math.inf, -math.inf, 0.0, -0.0]


def logits_case(num_rows, vocab, dtype, distinct, specials, strided, seed):
    """`[num_rows, vocab]` logits: `distinct` values a row (forced ties) or, for None, normal draws; `specials` of
    SPECIALS planted at random tokens; for `strided`, rows of a wider tensor (row stride past the vocab)."""
    generator = torch.Generator().manual_seed(seed)
    width = vocab + 3 if strided else vocab
    if distinct is None:
        values = torch.randn(num_rows, width, generator=generator)
    else:
        values = torch.randint(0, distinct, (num_rows, width), generator=generator) * 0.75 - 1.5
    for _ in range(specials):
        row = int(torch.randint(0, num_rows, (), generator=generator))
        token = int(torch.randint(0, vocab, (), generator=generator))
        values[row, token] = SPECIALS[int(torch.randint(0, len(SPECIALS), (), generator=generator))]
    return values.to(dtype)[:, :vocab]


def reference(logits: torch.Tensor, width: int) -> list[int]:
    """Row by row, the first `width` tokens sorted by (NaN first, larger value first, lower token id first)."""
    ids = []
    for row in logits.float().tolist():
        order = sorted(range(len(row)), key=lambda i: (0, 0.0, i) if math.isnan(row[i]) else (1, -row[i], i))
        ids.extend(order[:width])
    return ids


case_arguments = dict(
    num_rows=st.integers(1, 4), width=st.integers(1, 4), dtype=st.sampled_from(DTYPES),
    distinct=st.sampled_from([None, 1, 2, 3, 5]), specials=st.sampled_from([0, 0, 1, 4, 12]),
    strided=st.booleans(), seed=st.integers(0, 2**16))


@settings(max_examples=60, deadline=None)
@given(vocab=st.sampled_from([1, 2, 3, 7, 64, 333, CHUNK - 1, CHUNK, CHUNK + 1, 2 * CHUNK + 17]), **case_arguments)
def test_the_twin_ranks_as_the_reference(num_rows, vocab, width, dtype, distinct, specials, strided, seed):
    width = min(width, vocab)
    logits = logits_case(num_rows, vocab, dtype, distinct, specials, strided, seed)
    got = top_children_torch(logits, width)
    assert got.dtype == torch.int64 and got.shape == (num_rows * width,)
    assert got.tolist() == reference(logits, width)


@settings(max_examples=60, deadline=None)
@given(shape=st.sampled_from([(1, None), (3, None), (17, None), (200, None), (CHUNK - 1, None), (CHUNK, None),
                               (CHUNK + 1, None), (2 * CHUNK + 17, None), (9, 8), (70, 8), (200, 32)]),
       **case_arguments)
def test_the_kernel_returns_what_the_twin_returns(num_rows, shape, width, dtype, distinct, specials, strided, seed):
    """`shape`: the vocab and the chunk (None: the module's CHUNK). A small chunk has a row span many stage-1 programs
    and stage 2 merge a candidate count short of its power-of-two block; its vocabs stay small, as the interpreter
    runs every program in Python."""
    vocab, chunk = shape
    width = min(width, vocab)
    logits = logits_case(num_rows, vocab, dtype, distinct, specials, strided, seed)
    with mock.patch.object(triton_module, "CHUNK", chunk or CHUNK):
        got = top_children_triton(logits, width)
    assert got.dtype == torch.int64 and got.shape == (num_rows * width,)
    assert torch.equal(got, top_children_torch(logits, width))


@settings(max_examples=20, deadline=None)
@given(num_rows=st.integers(1, 5), vocab=st.integers(4, 256), width=st.integers(1, 4),
       dtype=st.sampled_from(DTYPES), seed=st.integers(0, 2**16))
def test_distinct_finite_logits_rank_as_torch_topk(num_rows, vocab, width, dtype, seed):
    """A permutation of distinct integers (exact in every dtype up to 256): no tie, no NaN, where every order
    agrees."""
    generator = torch.Generator().manual_seed(seed)
    values = torch.stack([torch.randperm(vocab, generator=generator) for _ in range(num_rows)]) - vocab // 2
    logits = values.to(dtype)
    want = logits.topk(width, dim=-1).indices.reshape(-1)
    assert torch.equal(top_children_torch(logits, width), want)
    assert torch.equal(top_children(logits, width), want)  # the drafters' call on CPU: the twin


def test_ties_go_to_the_lowest_token_id_and_nan_ranks_first():
    logits = torch.tensor([[1.0, 3.0, 3.0, -0.0, 0.0, 3.0],
                           [math.nan, math.inf, 2.0, math.nan, 2.0, -math.inf],
                           [-math.inf, -math.inf, -math.inf, -math.inf, -math.inf, -math.inf]])
    want = [1, 2, 5, 0, 0, 3, 1, 2, 0, 1, 2, 3]
    assert top_children_torch(logits, 4).tolist() == want
    assert top_children_triton(logits, 4).tolist() == want


def test_no_rows_no_ids():
    for function in (top_children_torch, top_children_triton):
        got = function(torch.zeros(0, 10, dtype=torch.bfloat16), 3)
        assert got.dtype == torch.int64 and got.shape == (0,)


def test_the_contract_is_refused_outside_it():
    with pytest.raises(ValueError, match="width 5 outside"):
        top_children_torch(torch.zeros(2, 4), 5)
    with pytest.raises(ValueError, match="fp32, bf16 or fp16"):
        top_children_triton(torch.zeros(2, 4, dtype=torch.float64), 2)
    with pytest.raises(ValueError, match="unit stride"):
        top_children_triton(torch.zeros(4, 2).t(), 2)
