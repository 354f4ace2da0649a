"""The accepted path's K/V compaction in one layer's paged KV cache in one Triton launch: `paged_kv_compaction_torch`
is its twin and states the layout.

One program per request: it performs the request's moves (`spec_decode.acceptance.accepted_kv_moves`: the path's
m-th node from root + 1 + node to root + m, none where the node is already in place) one by one in path order, each a
``[num_kv_heads, C]`` tile loaded and stored. In order is right: a move's source may be a LATER move's destination,
never an earlier one's, and each lane handles the same (head, column) element in every move, so a lane reads a
position before it overwrites it. Requests own disjoint blocks, so programs never touch one another's positions (a
caller that pads a batch gives its padding rows a block table of vLLM's null block, which holds no request's K/V).
Static grid from the host's request count; no host sync: capturable.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


# One compiled variant per cache shape and dtype: neither strides nor the alignment of the (sliced) tables compile a
# new one in the middle of serving.
@triton.jit(do_not_specialize=["table_stride", "stride_block", "stride_head", "stride_offset", "stride_column"],
            do_not_specialize_on_alignment=["block_table", "accepted_nodes", "root_positions"])
def _compact_paged_kv_kernel(
    kv_cache, block_table, table_stride, accepted_nodes, root_positions,
    stride_block, stride_head, stride_offset, stride_column,
    BLOCK_SIZE: tl.constexpr, DEPTH: tl.constexpr, HEADS: tl.constexpr, COLUMNS: tl.constexpr,
    BLOCK_HEADS: tl.constexpr, BLOCK_COLUMNS: tl.constexpr,
):
    request = tl.program_id(0).to(tl.int64)
    root = tl.load(root_positions + request).to(tl.int64)
    heads = tl.arange(0, BLOCK_HEADS)[:, None]
    columns = tl.arange(0, BLOCK_COLUMNS)[None, :]
    in_row = (heads < HEADS) & (columns < COLUMNS)
    row_offsets = heads.to(tl.int64) * stride_head + columns.to(tl.int64) * stride_column
    table = block_table + request * table_stride
    for m in tl.static_range(DEPTH):
        node = tl.load(accepted_nodes + request * DEPTH + m).to(tl.int64)
        source = root + 1 + node
        destination = root + 1 + m
        move = (node >= 0) & (source != destination)
        source_block = tl.load(table + source // BLOCK_SIZE, mask=move, other=0).to(tl.int64)
        destination_block = tl.load(table + destination // BLOCK_SIZE, mask=move, other=0).to(tl.int64)
        source_row = kv_cache + source_block * stride_block + (source % BLOCK_SIZE) * stride_offset
        destination_row = kv_cache + destination_block * stride_block + (destination % BLOCK_SIZE) * stride_offset
        values = tl.load(source_row + row_offsets, mask=in_row & move)
        tl.store(destination_row + row_offsets, values, mask=in_row & move)


def compact_paged_kv_triton(kv_cache: torch.Tensor, block_table: torch.Tensor, accepted_nodes: torch.Tensor,
                            root_positions: torch.Tensor) -> None:
    """`compact_paged_kv_torch` for one layer's cache (``[num_blocks, num_kv_heads, block_size, C]``, any strides) in
    one launch; ``block_table [B, max_blocks]`` with unit stride in its last axis, ``accepted_nodes [B, D]`` and
    ``root_positions [B]`` contiguous."""
    num_requests, depth = accepted_nodes.shape
    if num_requests == 0 or depth == 0:
        return
    if block_table.stride(1) != 1 or not accepted_nodes.is_contiguous():
        raise ValueError("compact_paged_kv_triton: unit-stride block table rows and contiguous accepted nodes")
    _, heads, block_size, columns = kv_cache.shape
    _compact_paged_kv_kernel[(num_requests,)](
        kv_cache, block_table, block_table.stride(0), accepted_nodes, root_positions,
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        BLOCK_SIZE=block_size, DEPTH=depth, HEADS=heads, COLUMNS=columns,
        BLOCK_HEADS=triton.next_power_of_2(heads), BLOCK_COLUMNS=triton.next_power_of_2(columns),
    )
