"""Tree acceptance on a runner's logits layout in one Triton launch: `tree_acceptance_torch` is its twin and states the
layout and the outputs.

One program per batch row. The program finds whether its row is a tree row by binary search over the ascending
`request_indices` (SEARCH_STEPS halvings), then either walks its tree (the draws of its verified block, its drafts
and the tree's parents as vectors of BLOCK >= 1 + N lanes; the walk takes the tree's depth D levels, unrolled: at
each, the draw at the current node, the first child of the current node that carries it, or, synthetic, whose
uniform is below its rate) and writes its output row, counts, acceptance and chain rows; or, any other row, its last
draw and identity chain rows. Every output element is written by exactly one program: no atomics, no ordering
between programs. Static grid from the host's row count; topology and rates as tensors; no host sync: capturable.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..spec_decode.acceptance import TreeAcceptance, UniformWalkTables
from .tree_acceptance_torch import PLACEHOLDER_TOKEN, SyntheticDraw, TreeRows

SEARCH_STEPS = 24  # binary-search halvings over the tree rows: batches of up to 2^24 - 1 requests


# One compiled variant per tree shape and dtype signature: neither row counts, strides nor the inputs' alignment (views
# into the runner's buffers) compile a new one in the middle of serving.
@triton.jit(do_not_specialize=["num_tree_rows", "token_stride", "sampled_stride", "rates_stride"],
            do_not_specialize_on_alignment=["draws", "cu_num_logits", "request_indices", "token_indices", "input_ids",
                                            "uniforms", "rates", "slots"])
def _tree_acceptance_kernel(
    draws, cu_num_logits, request_indices, num_tree_rows, token_indices, token_stride, input_ids, parent_blocks,
    uniforms, rates, rates_stride, slots, rate_index,
    sampled, sampled_stride, num_sampled, leaf_counts, chain_rows,
    accepted_nodes, last_accepted_node, num_accepted, bonus_tokens,
    N: tl.constexpr, DEPTH: tl.constexpr, COLUMNS: tl.constexpr, BLOCK: tl.constexpr, BLOCK_COLUMNS: tl.constexpr,
    SYNTHETIC: tl.constexpr, STEPS: tl.constexpr, PLACEHOLDER: tl.constexpr,
):
    row = tl.program_id(0)
    # the tree row of batch row `row`: the first index whose request_indices entry is >= row
    low = row * 0
    high = row * 0 + num_tree_rows
    for _ in tl.static_range(STEPS):
        searching = low < high
        middle = (low + high) // 2
        value = tl.load(request_indices + middle, mask=searching, other=0)
        low = tl.where(searching & (value < row), middle + 1, low)
        high = tl.where(searching & (value >= row), middle, high)
    tree_row = tl.minimum(low, num_tree_rows - 1)
    is_tree = (low < num_tree_rows) & (tl.load(request_indices + tree_row) == row)
    start = tl.load(cu_num_logits + row).to(tl.int64)
    end = tl.load(cu_num_logits + row + 1).to(tl.int64)
    lanes = tl.arange(0, BLOCK)
    columns = tl.arange(0, BLOCK_COLUMNS)
    out_row = sampled + row.to(tl.int64) * sampled_stride
    if is_tree:
        in_tree = lanes < N
        parent = tl.load(parent_blocks + lanes, mask=in_tree, other=-1).to(tl.int64)  # block index, root 0
        token_row = tl.load(token_indices + tree_row.to(tl.int64) * token_stride + 1 + lanes, mask=in_tree, other=0)
        drafts = tl.load(input_ids + token_row, mask=in_tree, other=0).to(tl.int64)
        block_draws = tl.load(draws + start + lanes, mask=lanes < N + 1, other=0).to(tl.int64)
        if SYNTHETIC:
            slot = tl.load(slots + row).to(tl.int64)
            rate = tl.load(rates + slot * rates_stride + tl.load(rate_index + lanes, mask=in_tree, other=0),
                           mask=in_tree, other=0.0)
            uniform = tl.load(uniforms + tree_row.to(tl.int64) * N + lanes, mask=in_tree, other=1.0)
            carries = uniform < rate.to(tl.float64)
        current = tl.full([], -1, tl.int64)  # local node, -1 = the root
        walking = tl.full([], 1, tl.int32)
        accepted = tl.full([], 0, tl.int32)
        sources = lanes.to(tl.int64)  # block index each chain row takes
        for level in tl.static_range(DEPTH):
            wanted = tl.sum(tl.where(lanes == current + 1, block_draws, 0), axis=0)
            if SYNTHETIC:
                match = in_tree & (parent == current + 1) & carries
            else:
                match = in_tree & (parent == current + 1) & (drafts == wanted)
            first = tl.min(tl.where(match, lanes, BLOCK), axis=0).to(tl.int64)
            found = (first < BLOCK) & (walking != 0)
            token = tl.sum(tl.where(lanes == first, drafts, 0), axis=0)
            tl.store(accepted_nodes + tree_row.to(tl.int64) * DEPTH + level, tl.where(found, first, -1))
            # the path's token, else the bonus where the walk stops here (the draw at the current node), else -1
            tl.store(out_row + level, tl.where(found, token, tl.where(walking != 0, wanted, PLACEHOLDER)))
            sources = tl.where((lanes == level + 1) & found, first + 1, sources)
            current = tl.where(found, first, current)
            accepted += found.to(tl.int32)
            walking = walking * found.to(tl.int32)
        bonus = tl.sum(tl.where(lanes == current + 1, block_draws, 0), axis=0)
        tl.store(out_row + DEPTH, tl.where(walking != 0, bonus, PLACEHOLDER))
        tl.store(out_row + columns, tl.full([BLOCK_COLUMNS], PLACEHOLDER, tl.int64),
                 mask=(columns > DEPTH) & (columns < COLUMNS))
        tl.store(num_sampled + row, accepted + 1)
        tl.store(leaf_counts + row, (current + 2).to(tl.int32))
        tl.store(chain_rows + start + lanes, start + sources, mask=lanes < N + 1)
        tl.store(last_accepted_node + tree_row, current)
        tl.store(num_accepted + tree_row, accepted.to(tl.int64))
        tl.store(bonus_tokens + tree_row, bonus)
    else:
        last = tl.load(draws + end - 1).to(tl.int64)
        tl.store(out_row + columns, tl.where(columns == 0, last, PLACEHOLDER), mask=columns < COLUMNS)
        tl.store(num_sampled + row, 1)
        tl.store(leaf_counts + row, 0)
        for first_row in range(start, end, BLOCK):
            rows = first_row + lanes
            tl.store(chain_rows + rows, rows, mask=rows < end)


def tree_acceptance_triton(draws: torch.Tensor, cu_num_logits: torch.Tensor, request_indices: torch.Tensor,
                           token_indices: torch.Tensor, input_ids: torch.Tensor, tables: UniformWalkTables,
                           num_speculative_steps: int, synthetic: SyntheticDraw | None = None) -> TreeRows:
    """`tree_acceptance_torch`'s outputs in one launch, from the same arguments (of ``tables`` the kernel reads the
    parents' block indices and the depth). ``token_indices [R, 1 + N]`` with unit stride in its last axis; ``draws``,
    ``cu_num_logits``, ``input_ids``, ``request_indices`` and the synthetic rates contiguous."""
    device = draws.device
    parent_blocks = tables.parent_blocks
    num_nodes, depth = parent_blocks.numel(), tables.node_at_depth.shape[1]
    num_reqs, num_logits = cu_num_logits.numel() - 1, draws.numel()
    num_tree_rows = request_indices.numel()
    if num_tree_rows < 1 or num_tree_rows >= 2**SEARCH_STEPS or token_indices.stride(1) != 1 or (
            synthetic is not None and not synthetic.rates.is_contiguous()):
        raise ValueError(f"tree_acceptance_triton: {num_tree_rows} tree rows (1 to {2**SEARCH_STEPS - 1}) with "
                         "unit-stride token rows and contiguous rates")

    def empty(*shape, dtype=torch.long):
        return torch.empty(*shape, dtype=dtype, device=device)

    columns = 1 + num_speculative_steps
    sampled, chain_rows = empty(num_reqs, columns), empty(num_logits)
    num_sampled, leaf_counts = empty(num_reqs, dtype=torch.int32), empty(num_reqs, dtype=torch.int32)
    acceptance = TreeAcceptance(empty(num_tree_rows), empty(num_tree_rows, depth), empty(num_tree_rows),
                                empty(num_tree_rows))
    if synthetic is None:  # absent tensors: any valid pointer, never read
        uniforms, rates, rates_stride, slots, rate_index = draws, draws, 0, draws, draws
    else:
        uniforms, rates, slots, rate_index = synthetic
        rates_stride = rates.stride(0)
    _tree_acceptance_kernel[(num_reqs,)](
        draws, cu_num_logits, request_indices, num_tree_rows, token_indices, token_indices.stride(0), input_ids,
        parent_blocks, uniforms, rates, rates_stride, slots, rate_index,
        sampled, sampled.stride(0), num_sampled, leaf_counts, chain_rows,
        acceptance.accepted_nodes, acceptance.last_accepted_node, acceptance.num_accepted, acceptance.bonus_tokens,
        N=num_nodes, DEPTH=depth, COLUMNS=columns, BLOCK=triton.next_power_of_2(num_nodes + 1),
        BLOCK_COLUMNS=triton.next_power_of_2(columns), SYNTHETIC=synthetic is not None, STEPS=SEARCH_STEPS,
        PLACEHOLDER=PLACEHOLDER_TOKEN,
    )
    return TreeRows(sampled, num_sampled, leaf_counts, chain_rows, acceptance)
