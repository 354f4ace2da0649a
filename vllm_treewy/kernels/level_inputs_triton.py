"""The inputs of one MTP drafting level in one Triton launch: `level_inputs_torch` is its twin and states the layout.

One program per (request, block token): it writes the token's id, position and hidden row (the root's hidden state,
or the head's output at the token's parent; `row_copy_triton`); the request's first program also writes its
query start and sequence length (the last request's the final query start). Every output element is written by
exactly one program. Static grid from the host's request count and the level's block length; no host sync:
capturable.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .row_copy_triton import copy_row, row_block



# One compiled variant per level and dtype signature: strides and the buffers' alignment (views of the runner's
# persistent buffers) never compile a new one in the middle of serving.
@triton.jit(do_not_specialize=["max_position", "stride_root", "stride_tokens", "stride_out_r", "stride_out_b",
                               "stride_hidden", "hidden_size", "num_requests"],
            do_not_specialize_on_alignment=["root_tokens", "root_hidden", "node_tokens", "outputs", "parent_blocks",
                                            "depths", "root_positions", "input_ids", "hidden_states", "positions",
                                            "query_start_loc", "seq_lens"])
def _level_inputs_kernel(
    root_tokens, root_hidden, stride_root, node_tokens, stride_tokens, outputs, stride_out_r, stride_out_b,
    parent_blocks, depths, root_positions, max_position, input_ids, hidden_states, stride_hidden, positions,
    query_start_loc, seq_lens, hidden_size, num_requests,
    BLOCK_LEN: tl.constexpr, BLOCK: tl.constexpr,
):
    request = tl.program_id(0).to(tl.int64)
    token = tl.program_id(1)
    row = request * BLOCK_LEN + token
    root = tl.load(root_positions + request).to(tl.int64)
    node = tl.maximum(token - 1, 0)
    is_root = token == 0
    token_id = tl.where(is_root, tl.load(root_tokens + request),
                        tl.load(node_tokens + request * stride_tokens + node, mask=~is_root, other=0))
    tl.store(input_ids + row, token_id.to(input_ids.dtype.element_ty))
    position = tl.minimum(root + tl.load(depths + token).to(tl.int64), max_position)
    tl.store(positions + row, position.to(positions.dtype.element_ty))
    parent = tl.load(parent_blocks + node).to(tl.int64)
    source = tl.where(is_root, root_hidden + request * stride_root,
                      outputs + request * stride_out_r + parent * stride_out_b)
    destination = hidden_states + row * stride_hidden
    copy_row(source, destination, hidden_size, BLOCK)
    if token == 0:
        tl.store(query_start_loc + request, (request * BLOCK_LEN).to(query_start_loc.dtype.element_ty))
        tl.store(seq_lens + request, (root + BLOCK_LEN).to(seq_lens.dtype.element_ty))
        if request == num_requests - 1:
            tl.store(query_start_loc + num_requests, (num_requests * BLOCK_LEN).to(query_start_loc.dtype.element_ty))


def level_inputs_triton(root_tokens: torch.Tensor, root_hidden: torch.Tensor, node_tokens: torch.Tensor,
                        outputs: torch.Tensor, parent_blocks: torch.Tensor, depths: torch.Tensor,
                        root_positions: torch.Tensor, max_position: int, input_ids: torch.Tensor,
                        hidden_states: torch.Tensor, positions: torch.Tensor, query_start_loc: torch.Tensor,
                        seq_lens: torch.Tensor) -> None:
    """`level_inputs_torch` in one launch, the same arguments; every hidden row (``root_hidden``, ``outputs``'s
    last axis, ``hidden_states``) and ``node_tokens``'s rows with unit stride in their last axis, the other vectors
    contiguous."""
    num_requests, block_len = root_positions.shape[0], depths.shape[0]
    if num_requests == 0:
        return
    hidden_size = hidden_states.shape[-1]
    if (root_hidden.stride(-1) != 1 or outputs.stride(-1) != 1 or hidden_states.stride(-1) != 1
            or node_tokens.stride(-1) != 1):
        raise ValueError("level_inputs_triton: hidden rows and token rows need unit stride in their last axis")
    _level_inputs_kernel[(num_requests, block_len)](
        root_tokens, root_hidden, root_hidden.stride(0), node_tokens, node_tokens.stride(0), outputs,
        outputs.stride(0), outputs.stride(1), parent_blocks, depths, root_positions, max_position, input_ids,
        hidden_states, hidden_states.stride(0), positions, query_start_loc, seq_lens, hidden_size, num_requests,
        BLOCK_LEN=block_len, BLOCK=row_block(hidden_size),
    )
