"""The per-step updates of the GDN slots' verified-node counts, one launch each on CUDA. `counts [S]` int32, any
stride (the count state sits in each slot's KV-cache page): 0 when nothing is pending, else 1 + the node of the
slot's last verified block that its next step commits. Both updates run every engine step, where each eager torch
op would be a kernel launch that costs the host several microseconds; the torch twins (a few ops per row group and
update) are the path on CPU.

- `commit_nodes_and_counts`, at the start of the forward (the GDN group's first layer; captured in FULL CUDA graphs)
  or, for a batch without speculative rows, in the metadata builder: each speculative row's commit node from its
  slot's count, then the step's counts: the speculative rows' node counts, 0 in the null block and in every
  non-speculative row's slot.
- `record_accepted_counts_*`, after sampling (vLLM's V1 runner): each speculative row's accepted count into its slot,
  for every KV-cache group of GDN layers at once (each group has its own counts and block table: `count_table`).
- `record_sampled_counts_*`, after sampling (vLLM's Model Runner V2): the same for V2's batch, whose rows reach their
  request's block-table row through `idx_mapping` and whose speculative rows are the slots that hold a count (the
  step's count update gave every speculative row its node count, >= 1, and every other row 0).

A batch's rows hold distinct slots apart from the null block (CUDA-graph capture and padding rows), as vLLM's
requests do: rows never race on a slot other than the null block, where every row writes the same 0. No host sync;
shapes depend only on the host's row counts.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

BLOCK_ROWS = 128  # rows per program: a decode batch of up to 128 requests is one program


def launches_triton(counts: torch.Tensor) -> bool:
    """The one-launch kernels on CUDA; the torch twins elsewhere (vLLM's CPU backend, where no GPU kernel runs)."""
    return counts.is_cuda


def commit_nodes_and_counts(
    counts: torch.Tensor,
    *,
    batch_slots: torch.Tensor | None = None,
    spec_query_start_loc: torch.Tensor | None = None,
    slots: torch.Tensor | None = None,
    commit_nodes: torch.Tensor | None = None,
    non_spec_slots: torch.Tensor | None = None,
    null_block: int,
) -> None:
    """The speculative rows (`batch_slots [R]`, any stride, `spec_query_start_loc [R + 1]`; all four None without
    any): their slots into `slots [R]` (contiguous), `commit_nodes [R] = counts[slot] - 1` (-1 in the null block),
    then `counts[slot]` = the row's node count (0 in the null block). Then `counts[non_spec_slots] = 0`."""
    update = commit_nodes_and_counts_triton if launches_triton(counts) else commit_nodes_and_counts_torch
    update(counts, batch_slots, spec_query_start_loc, slots, commit_nodes, non_spec_slots, null_block)


def commit_nodes_and_counts_torch(counts, batch_slots, spec_query_start_loc, slots, commit_nodes, non_spec_slots,
                                  null_block: int) -> None:
    if batch_slots is not None:
        slots.copy_(batch_slots)
        null_rows = slots == null_block
        torch.sub(counts[slots], 1, out=commit_nodes).masked_fill_(null_rows, -1)
        counts[slots] = spec_query_start_loc.diff().masked_fill_(null_rows, 0)
    if non_spec_slots is not None:
        # index_fill_, not `counts[rows] = 0`: on CUDA that copies the 0 from the host and waits for the device.
        counts.index_fill_(0, non_spec_slots.long(), 0)


# One compiled variant per dtype signature: neither row counts, strides nor the buffers' alignment (which a scalar
# gather never uses) may compile a new one in the middle of serving.
@triton.jit(do_not_specialize=["counts_stride", "batch_slots_stride", "num_spec_rows", "non_spec_stride",
                               "num_non_spec_rows"],
            do_not_specialize_on_alignment=["counts", "batch_slots", "spec_query_start_loc", "slots", "commit_nodes",
                                            "non_spec_slots"])
def _commit_nodes_kernel(
    counts, counts_stride, batch_slots, batch_slots_stride, spec_query_start_loc, slots, commit_nodes, num_spec_rows,
    non_spec_slots, non_spec_stride, num_non_spec_rows, NULL_BLOCK: tl.constexpr, BLOCK: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    spec = rows < num_spec_rows
    slot = tl.load(batch_slots + rows * batch_slots_stride, mask=spec, other=NULL_BLOCK)
    tl.store(slots + rows, slot, mask=spec)
    null = slot == NULL_BLOCK
    # int64: the stride is a KV-cache page (megabytes), so slot * stride passes 2**31
    count = counts + slot.to(tl.int64) * counts_stride
    pending = tl.load(count, mask=spec & ~null, other=0)  # the null block's rows: 0 - 1 = -1
    tl.store(commit_nodes + rows, pending - 1, mask=spec)
    nodes = tl.load(spec_query_start_loc + rows + 1, mask=spec) - tl.load(spec_query_start_loc + rows, mask=spec)
    tl.store(count, tl.where(null, 0, nodes), mask=spec)
    non_spec = rows < num_non_spec_rows
    slot = tl.load(non_spec_slots + rows * non_spec_stride, mask=non_spec)
    tl.store(counts + slot.to(tl.int64) * counts_stride, tl.zeros([BLOCK], tl.int32), mask=non_spec)


def commit_nodes_and_counts_triton(counts, batch_slots, spec_query_start_loc, slots, commit_nodes, non_spec_slots,
                                   null_block: int, *, block_rows: int = BLOCK_ROWS) -> None:
    """`commit_nodes_and_counts` in one launch (none without rows)."""
    num_spec_rows = 0 if batch_slots is None else batch_slots.shape[0]
    num_non_spec_rows = 0 if non_spec_slots is None else non_spec_slots.shape[0]
    num_rows = max(num_spec_rows, num_non_spec_rows)
    if num_rows == 0:
        return
    assert counts.dtype == torch.int32
    assert batch_slots is None or slots.is_contiguous() and commit_nodes.is_contiguous()
    # Absent tensors: any valid pointer, never dereferenced (their row count is 0).
    if batch_slots is None:
        batch_slots = spec_query_start_loc = slots = commit_nodes = counts
    if non_spec_slots is None:
        non_spec_slots = counts
    _commit_nodes_kernel[(triton.cdiv(num_rows, block_rows),)](
        counts, counts.stride(0), batch_slots, batch_slots.stride(0), spec_query_start_loc, slots, commit_nodes,
        num_spec_rows, non_spec_slots, non_spec_slots.stride(0), num_non_spec_rows, NULL_BLOCK=null_block,
        BLOCK=block_rows,
    )


def count_table(groups: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """`[G, 4]` int64 (counts address, counts stride, block table address, block table row stride) of each group's
    `(counts [S] int32, block_table [max_rows, max_blocks] int32)`, for `record_accepted_counts_triton`. Build it
    once: both live as long as the KV cache."""
    assert all(counts.dtype == block_table.dtype == torch.int32 for counts, block_table in groups)
    return torch.tensor([[counts.data_ptr(), counts.stride(0), block_table.data_ptr(), block_table.stride(0)]
                         for counts, block_table in groups], dtype=torch.int64, device=groups[0][0].device)


def record_accepted_counts_torch(groups: Sequence[tuple[torch.Tensor, torch.Tensor]], draft_tokens: torch.Tensor,
                                 accepted: torch.Tensor, num_rows: int) -> None:
    """For each group `(counts, block_table)`: `counts[block_table[row, 0]] = accepted[row]` for every row < num_rows
    that verified drafts (`draft_tokens[row] >= 0`, vLLM's `num_decode_draft_tokens`); the other rows' slots keep
    their counts."""
    speculative = draft_tokens[:num_rows] >= 0
    accepted = accepted[:num_rows]
    for counts, block_table in groups:
        slots = block_table[:num_rows, 0]
        counts[slots] = torch.where(speculative, accepted.to(counts.dtype), counts[slots])


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
    """`record_accepted_counts_torch` for the groups of a `count_table`, all in one launch (none without rows)."""
    if num_rows == 0:
        return
    _record_accepted_counts_kernel[(triton.cdiv(num_rows, block_rows),)](
        table, table.shape[0], draft_tokens, accepted, num_rows, BLOCK=block_rows)


def record_sampled_counts_torch(groups: Sequence[tuple[torch.Tensor, torch.Tensor]], idx_mapping: torch.Tensor,
                                num_sampled: torch.Tensor, num_rows: int) -> None:
    """For each group `(counts, block_table [max_reqs, max_blocks])`, block table rows per request state: for every
    batch row < num_rows with `idx_mapping[row] >= 0` (V2 marks rows to skip with -1) whose slot
    `block_table[idx_mapping[row], 0]` holds a count (> 0: the row verified this step), `counts[slot] =
    max(num_sampled[row], 1)`: 1 + the accepted drafts; a one-token prompt chunk that ran as a decode samples
    nothing but its token was verified (node 0), as vLLM's own `max(num_sampled, 1)` has it."""
    requests = idx_mapping[:num_rows].long()
    live = requests >= 0
    requests, sampled = requests[live], num_sampled[:num_rows][live].clamp(min=1)
    for counts, block_table in groups:
        slots = block_table[requests, 0].long()
        pending = counts[slots]
        counts[slots] = torch.where(pending > 0, sampled.to(counts.dtype), pending)


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
    """`record_sampled_counts_torch` for the groups of a `count_table` (block tables per request state), in one
    launch (none without rows)."""
    if num_rows == 0:
        return
    _record_sampled_counts_kernel[(triton.cdiv(num_rows, block_rows),)](
        table, table.shape[0], idx_mapping, num_sampled, num_rows, BLOCK=block_rows)
