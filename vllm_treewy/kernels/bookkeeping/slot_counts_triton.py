"""Runner bookkeeping on CUDA: the per-step updates of the GDN slots' verified-node counts, each in one Triton launch
(the semantics, the count state's layout and the race-freedom argument: their torch twins in `slot_counts_torch`).

- `commit_nodes_and_counts_triton`: each speculative row's commit node from its slot's count (or the runner's accepted
  count where the slot's is pending), then the step's counts;
- `record_accepted_counts_triton` (vLLM's V1 runner) and `record_sampled_counts_triton` (Model Runner V2): after
  sampling, each speculative row's count into its slot for every KV-cache group of GDN layers at once, the groups as
  a `count_table` of addresses.

No host sync; shapes depend only on the host's row counts; one compiled variant per dtype signature.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

BLOCK_ROWS = 128  # rows per program: a decode batch of up to 128 requests is one program


# One compiled variant per dtype signature: neither row counts, strides, the commit source nor the buffers' alignment
# (which a scalar gather never uses) may compile a new one in the middle of serving.
@triton.jit(do_not_specialize=["counts_stride", "batch_slots_stride", "num_spec_rows", "non_spec_stride",
                               "num_non_spec_rows", "has_accepted"],
            do_not_specialize_on_alignment=["counts", "batch_slots", "spec_query_start_loc", "slots", "commit_nodes",
                                            "non_spec_slots", "accepted"])
def _commit_nodes_kernel(
    counts, counts_stride, batch_slots, batch_slots_stride, spec_query_start_loc, slots, commit_nodes, num_spec_rows,
    non_spec_slots, non_spec_stride, num_non_spec_rows, accepted, has_accepted, NULL_BLOCK: tl.constexpr,
    BLOCK: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    spec = rows < num_spec_rows
    slot = tl.load(batch_slots + rows * batch_slots_stride, mask=spec, other=NULL_BLOCK)
    tl.store(slots + rows, slot, mask=spec)
    null = slot == NULL_BLOCK
    # int64: the stride is a KV-cache page (megabytes), so slot * stride passes 2**31
    count = counts + slot.to(tl.int64) * counts_stride
    pending = tl.load(count, mask=spec & ~null, other=0)  # the null block's rows: 0 - 1 = -1
    if has_accepted != 0:  # the runner's accepted counts, bounded by the slot's pending nodes
        pending = tl.minimum(pending, tl.load(accepted + rows, mask=spec, other=0).to(tl.int32))
    tl.store(commit_nodes + rows, pending - 1, mask=spec)
    nodes = tl.load(spec_query_start_loc + rows + 1, mask=spec) - tl.load(spec_query_start_loc + rows, mask=spec)
    tl.store(count, tl.where(null, 0, nodes), mask=spec)
    non_spec = rows < num_non_spec_rows
    slot = tl.load(non_spec_slots + rows * non_spec_stride, mask=non_spec)
    tl.store(counts + slot.to(tl.int64) * counts_stride, tl.zeros([BLOCK], tl.int32), mask=non_spec)


def commit_nodes_and_counts_triton(counts, batch_slots, spec_query_start_loc, slots, commit_nodes, non_spec_slots,
                                   null_block: int, accepted=None, *, block_rows: int = BLOCK_ROWS) -> None:
    """`slot_counts_torch.commit_nodes_and_counts_torch` in one launch (none without rows)."""
    num_spec_rows = 0 if batch_slots is None else batch_slots.shape[0]
    num_non_spec_rows = 0 if non_spec_slots is None else non_spec_slots.shape[0]
    num_rows = max(num_spec_rows, num_non_spec_rows)
    if num_rows == 0:
        return
    assert counts.dtype == torch.int32
    assert batch_slots is None or slots.is_contiguous() and commit_nodes.is_contiguous()
    assert accepted is None or batch_slots is not None and accepted.is_contiguous()
    # Absent tensors: any valid pointer, never dereferenced (their row count is 0, or `has_accepted` 0).
    if batch_slots is None:
        batch_slots = spec_query_start_loc = slots = commit_nodes = counts
    if non_spec_slots is None:
        non_spec_slots = counts
    has_accepted = int(accepted is not None)
    _commit_nodes_kernel[(triton.cdiv(num_rows, block_rows),)](
        counts, counts.stride(0), batch_slots, batch_slots.stride(0), spec_query_start_loc, slots, commit_nodes,
        num_spec_rows, non_spec_slots, non_spec_slots.stride(0), num_non_spec_rows,
        counts if accepted is None else accepted, has_accepted, NULL_BLOCK=null_block, BLOCK=block_rows,
    )


def count_table(groups: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """`[G, 4]` int64 (counts address, counts stride, block table address, block table row stride) of each group's
    `(counts [S] int32, block_table [max_rows, max_blocks] int32)`, for `record_accepted_counts_triton`. Build it
    once: both live as long as the KV cache."""
    assert all(counts.dtype == block_table.dtype == torch.int32 for counts, block_table in groups)
    return torch.tensor([[counts.data_ptr(), counts.stride(0), block_table.data_ptr(), block_table.stride(0)]
                         for counts, block_table in groups], dtype=torch.int64, device=groups[0][0].device)


@triton.jit(do_not_specialize=["num_groups", "num_rows"],
            do_not_specialize_on_alignment=["table", "draft_tokens", "accepted"])
def _record_accepted_counts_kernel(table, num_groups, draft_tokens, accepted, num_rows, BLOCK: tl.constexpr):
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = rows < num_rows
    speculative = live & (tl.load(draft_tokens + rows, mask=live, other=-1) >= 0)
    count = tl.load(accepted + rows, mask=speculative).to(tl.int32)
    for group in range(num_groups):
        counts = tl.load(table + 4 * group).to(tl.pointer_type(tl.int32))
        block_table = tl.load(table + 4 * group + 2).to(tl.pointer_type(tl.int32))
        slot = tl.load(block_table + rows * tl.load(table + 4 * group + 3), mask=speculative)
        tl.store(counts + slot.to(tl.int64) * tl.load(table + 4 * group + 1), count, mask=speculative)


def record_accepted_counts_triton(table: torch.Tensor, draft_tokens: torch.Tensor, accepted: torch.Tensor,
                                  num_rows: int, *, block_rows: int = BLOCK_ROWS) -> None:
    """`slot_counts_torch.record_accepted_counts_torch` for the groups of a `count_table`, all in one launch (none
    without rows)."""
    if num_rows == 0:
        return
    _record_accepted_counts_kernel[(triton.cdiv(num_rows, block_rows),)](
        table, table.shape[0], draft_tokens, accepted, num_rows, BLOCK=block_rows)


@triton.jit(do_not_specialize=["num_groups", "num_rows"],
            do_not_specialize_on_alignment=["table", "idx_mapping", "num_sampled"])
def _record_sampled_counts_kernel(table, num_groups, idx_mapping, num_sampled, num_rows, BLOCK: tl.constexpr):
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = rows < num_rows
    request = tl.load(idx_mapping + rows, mask=live, other=-1).to(tl.int64)
    live = live & (request >= 0)
    count = tl.maximum(tl.load(num_sampled + rows, mask=live, other=1).to(tl.int32), 1)
    for group in range(num_groups):
        counts = tl.load(table + 4 * group).to(tl.pointer_type(tl.int32))
        block_table = tl.load(table + 4 * group + 2).to(tl.pointer_type(tl.int32))
        slot = tl.load(block_table + request * tl.load(table + 4 * group + 3), mask=live)
        slot_count = counts + slot.to(tl.int64) * tl.load(table + 4 * group + 1)
        pending = tl.load(slot_count, mask=live, other=0)
        tl.store(slot_count, count, mask=live & (pending > 0))


def record_sampled_counts_triton(table: torch.Tensor, idx_mapping: torch.Tensor, num_sampled: torch.Tensor,
                                 num_rows: int, *, block_rows: int = BLOCK_ROWS) -> None:
    """`slot_counts_torch.record_sampled_counts_torch` for the groups of a `count_table` (block tables per request
    state), in one launch (none without rows)."""
    if num_rows == 0:
        return
    _record_sampled_counts_kernel[(triton.cdiv(num_rows, block_rows),)](
        table, table.shape[0], idx_mapping, num_sampled, num_rows, BLOCK=block_rows)
