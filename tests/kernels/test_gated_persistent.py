"""`persistent_programs`: the fused GDN step with a grid of at most N programs, each looping over items (value heads
of one request) and loading its next item's first state chunks before the current item's epilogue, equals the
one-item-per-program launch of the same options: a chain step, then a step of chains or a small tree that commits
the first step's accepted nodes, with padding requests (-1 slots) among the items and program counts that do not
divide them. Bit for bit in the interpreter: each item runs the same operations on the same values, only the
order of the items and of the next item's loads differs (Triton interpreter on CPU)."""

import pytest
import torch

from vllm_treewy.kernels.triton import gated as gated_module
from vllm_treewy.kernels.triton import gdn_step_triton
from vllm_treewy.kernels.triton.gated import (FP32_STATE_EPILOGUE_LAUNCH, FP32_STATE_LAUNCH,
                                              FP32_STATE_SOLVE_BY_DOTS_LAUNCH, HALF_STATE_BF16_LAUNCH,
                                              HALF_STATE_FEW_NODES_LAUNCH, NARROW_HEAD_LAUNCH)
from vllm_treewy.tree import DraftTree

from .test_triton_gated import gated_inputs, run_step, slot_factor_page
from .triton_cases import DEVICE

# 4 requests, the second and the last padding: with two value heads of one key head, 8 items, so 3 programs take
# items (0, 3, 6), (1, 4, 7), (2, 5): a padding item first in a program, between live ones and last, live items
# followed by a padding one and by another slot's
FIRST = [DraftTree.from_widths([1] * n).parents for n in (3, 2, 4, 1)]
PADDING = (1, 3)
ACCEPTED = [1, 0, 3, 0]
SECOND_CHAINS = [DraftTree.from_widths([1] * n).parents for n in (4, 1, 2, 3)]
SECOND_TREE = [DraftTree.from_widths([2, 1]).parents, (-1,), (-1, 0, 0, 1), (-1, 0)]
# K = 32 in chunks of 16 (two a head, so a chunk is in flight while one is worked on), V = 16; the launch options of
# the named defaults otherwise (register caps and warps do not reach the interpreter)
KEY_DIM, VALUE_DIM, BLOCK_K = 32, 16, 16
LAUNCHES = {
    "fp32": (torch.float32, dict(FP32_STATE_LAUNCH, block_k=BLOCK_K)),
    "fp32 epilogue": (torch.float32, dict(FP32_STATE_EPILOGUE_LAUNCH, block_k=BLOCK_K)),
    "fp32 epilogue two heads": (torch.float32, dict(FP32_STATE_EPILOGUE_LAUNCH, block_k=BLOCK_K,
                                                    heads_per_program=2)),
    "bf16": (torch.bfloat16, dict(HALF_STATE_BF16_LAUNCH, block_k=BLOCK_K)),
    "bf16 two heads": (torch.bfloat16, dict(HALF_STATE_BF16_LAUNCH, block_k=BLOCK_K, heads_per_program=2)),
    "bf16 few nodes": (torch.bfloat16, dict(HALF_STATE_FEW_NODES_LAUNCH, block_k=BLOCK_K)),
}


def two_steps(second, state_dtype, launch, programs):
    """A chain step from fresh slots, then `second` committing ACCEPTED: (outputs of both, the committed state, the
    factor rows), padding requests' outputs left NaN."""
    packed1, inputs1, pool, slots = gated_inputs(FIRST, 1, 2, KEY_DIM, VALUE_DIM, 3, padding=PADDING,
                                                 dtype=torch.bfloat16)
    packed2, inputs2, _, _ = gated_inputs(second, 1, 2, KEY_DIM, VALUE_DIM, 4, dtype=torch.bfloat16)
    state = pool.to(state_dtype).to(DEVICE)
    factors = slot_factor_page(state.shape[0], max(packed1.max_nodes, packed2.max_nodes), 2, KEY_DIM, VALUE_DIM, 3)
    outs = []
    for packed, inputs, chain, pending in ((packed1, inputs1, True, None),
                                           (packed2, inputs2, second is SECOND_CHAINS,
                                            torch.tensor(ACCEPTED, dtype=torch.int32))):
        out = torch.full((packed.num_nodes, 2, VALUE_DIM), float("nan"), dtype=torch.bfloat16, device=DEVICE)
        outs.append(run_step(packed, inputs, state, slots, 1, factors, chain=chain, pending=pending, out=out,
                             **dict(launch, persistent_programs=programs)))
    return (*outs, state, factors)


def assert_equal(persistent, one_item):
    for actual, expected in zip(persistent, one_item):
        assert torch.equal(actual.isnan(), expected.isnan())
        assert torch.equal(actual.nan_to_num(0.0), expected.nan_to_num(0.0))


@pytest.mark.parametrize("name", list(LAUNCHES))
def test_persistent_equals_one_item_per_program(name):
    state_dtype, launch = LAUNCHES[name]
    second = SECOND_TREE if name == "fp32 epilogue" else SECOND_CHAINS
    one_item = two_steps(second, state_dtype, launch, 0)
    assert one_item[0][3:5].isnan().all()  # the padding request's rows: the check below sees NaN where expected
    assert_equal(two_steps(second, state_dtype, launch, 3), one_item)


@pytest.mark.parametrize("programs", [1, 5, 64])
def test_program_counts(programs):
    """One program for every item, a count that leaves some with one item fewer, and more than the items (the grid
    takes the items' count)."""
    state_dtype, launch = LAUNCHES["fp32 epilogue"]
    assert_equal(two_steps(SECOND_CHAINS, state_dtype, launch, programs),
                 two_steps(SECOND_CHAINS, state_dtype, launch, 0))


@pytest.mark.parametrize("launch", [dict(FP32_STATE_SOLVE_BY_DOTS_LAUNCH, block_k=BLOCK_K),
                                    dict(FP32_STATE_LAUNCH, block_k=BLOCK_K, lagged_products=True),
                                    dict(NARROW_HEAD_LAUNCH, block_k=8)])
def test_other_layouts(launch):
    """The solve by tensor-core products on a tree, the lagged products and the one-row-per-thread layout (its
    chunks of 8 columns: four a head, two ahead)."""
    assert_equal(two_steps(SECOND_TREE, torch.float32, launch, 3), two_steps(SECOND_TREE, torch.float32, launch, 0))


def test_grid_and_tma():
    """The grid is at most the programs asked for, a function of the batch alone; TMA state chunks are refused."""
    packed, inputs, pool, slots = gated_inputs(FIRST, 1, 2, KEY_DIM, VALUE_DIM, 3, padding=PADDING)
    state = pool.float()
    factors = slot_factor_page(state.shape[0], packed.max_nodes, 2, KEY_DIM, VALUE_DIM, 3).cpu()
    args = (*inputs, state, slots, packed.parents, packed.cu_nodes, factors, None, None)
    kw = dict(num_key_heads=1, max_nodes=packed.max_nodes, max_depth=None, chain=True, scale=None, norm_eps=1e-6,
              activation="silu", ancestors=None, out=None, do_verify=True, block_k=BLOCK_K)
    for programs, grid in ((0, (2, 4)), (3, (3,)), (264, (8,))):
        assert gated_module._launch_arguments(*args, persistent_programs=programs, **kw)[0] == grid
    with pytest.raises(ValueError, match="tma_state"):
        gdn_step_triton(*inputs, state, slots, packed.parents, packed.cu_nodes, factors=factors, num_key_heads=1,
                        max_nodes=packed.max_nodes, chain=True, persistent_programs=3, tma_state=True)
