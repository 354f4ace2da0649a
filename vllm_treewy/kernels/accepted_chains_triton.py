"""The MTP drafter's first-pass inputs with accepted paths laid out as chains in one Triton launch:
`accepted_chains_torch` is its twin and states the layout.

One program per step token: it finds the tree row whose verified block holds it (a binary search over the blocks' first
rows: the blocks are runs of consecutive token rows in ascending order, as `trees.step.find_tree_step` lays them out),
then writes the token's id, position and hidden row (`row_copy_triton`) from its source row: its path token's for
block rows 1 .. accepted, itself for every other token. Every output element is written by exactly one program, and
no program reads an output. Static grid from the host's token count; no host sync: capturable.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .row_copy_triton import copy_row, row_block



# One compiled variant per dtype signature: strides, counts and the buffers' alignment (views of the runners'
# buffers) never compile a new one in the middle of serving.
@triton.jit(do_not_specialize=["stride_path", "path_depth", "stride_in", "stride_out", "hidden_size", "num_requests",
                               "block_len", "search_steps"],
            do_not_specialize_on_alignment=["block_rows", "accepted_nodes", "root_positions", "token_ids", "positions",
                                            "hidden_states", "out_ids", "out_positions", "out_hidden"])
def _accepted_chains_kernel(
    block_rows, accepted_nodes, stride_path, path_depth, root_positions, token_ids, positions, hidden_states,
    stride_in, out_ids, out_positions, out_hidden, stride_out, hidden_size, num_requests, block_len, search_steps,
    BLOCK: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    # `found` = the number of blocks whose first row is <= token, in [low, high]; each step halves the interval, and
    # search_steps = bit length of the block count empties it
    low = token * 0
    high = low + num_requests
    for _ in range(search_steps):
        middle = (low + high) // 2
        open_interval = middle < high
        start = tl.load(block_rows + middle * block_len, mask=open_interval, other=0)
        low = tl.where(open_interval & (start <= token), middle + 1, low)
        high = tl.where(open_interval & (start > token), middle, high)
    request = low - 1
    in_tree = request >= 0
    offset = token - tl.load(block_rows + request * block_len, mask=in_tree, other=0)
    in_block = in_tree & (offset < block_len)
    on_path = in_block & (offset >= 1) & (offset <= path_depth)
    node = tl.load(accepted_nodes + request * stride_path + offset - 1, mask=on_path, other=-1).to(tl.int64)
    source_offset = tl.where(node >= 0, node + 1, offset)
    source = tl.where(in_block, tl.load(block_rows + request * block_len + source_offset, mask=in_block, other=0),
                      token)
    tl.store(out_ids + token, tl.load(token_ids + source))
    root = tl.load(root_positions + request, mask=in_block, other=0).to(tl.int64)
    position = tl.where(in_block, root + offset, tl.load(positions + token).to(tl.int64))
    tl.store(out_positions + token, position.to(out_positions.dtype.element_ty))
    origin = hidden_states + source * stride_in
    destination = out_hidden + token * stride_out
    copy_row(origin, destination, hidden_size, BLOCK)


def accepted_chains_triton(block_rows: torch.Tensor, accepted_nodes: torch.Tensor, root_positions: torch.Tensor,
                           token_ids: torch.Tensor, positions: torch.Tensor, hidden_states: torch.Tensor,
                           out_ids: torch.Tensor, out_positions: torch.Tensor, out_hidden: torch.Tensor) -> None:
    """`accepted_chains_torch` in one launch, the same arguments; each tree row's ``block_rows`` consecutive token rows,
    the rows ascending from tree row to tree row (`find_tree_step`'s layout); ``block_rows`` contiguous, the hidden
    rows and ``accepted_nodes``'s rows with unit stride in their last axis, the other vectors contiguous."""
    num_tokens = token_ids.shape[0]
    if num_tokens == 0:
        return
    num_requests, block_len = block_rows.shape
    if not block_rows.is_contiguous() or accepted_nodes.stride(-1) != 1 or hidden_states.stride(-1) != 1 \
            or out_hidden.stride(-1) != 1:
        raise ValueError("accepted_chains_triton: block_rows contiguous; path, hidden rows with unit last stride")
    _accepted_chains_kernel[(num_tokens,)](
        block_rows, accepted_nodes, accepted_nodes.stride(0), accepted_nodes.shape[1], root_positions, token_ids,
        positions, hidden_states, hidden_states.stride(0), out_ids, out_positions, out_hidden, out_hidden.stride(0),
        hidden_states.shape[-1], num_requests, block_len, num_requests.bit_length(),
        BLOCK=row_block(hidden_states.shape[-1]),
    )
