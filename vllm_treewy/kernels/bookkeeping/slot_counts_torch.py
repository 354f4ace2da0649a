"""Runner bookkeeping, in torch: the per-step updates of the GDN slots' verified-node counts. `counts [S]` int32, any
stride (the count state sits in each slot's KV-cache page): 0 when nothing is pending, else 1 + the node of the
slot's last verified block that its next step commits. Both updates run every engine step, where each eager torch
op would be a kernel launch that costs the host several microseconds: on CUDA each runs as one Triton launch
(`slot_counts_triton`); these torch twins (a few ops per row group and update) are the path on CPU and the kernels'
specification (`dispatch` picks the path).

- `commit_nodes_and_counts`, at the start of the forward (the GDN group's first layer; captured in FULL CUDA graphs)
  or, for a batch without speculative rows, in the metadata builder: each speculative row's commit node from its
  slot's count (or, where the runner keeps each request's accepted count itself, from that count where the slot's
  says a verify is pending), then the step's counts: the speculative rows' node counts, 0 in the null block and in
  every non-speculative row's slot.
- `record_accepted_counts_torch`, after sampling (vLLM's V1 runner): each speculative row's accepted count into its
  slot, for every KV-cache group of GDN layers at once (each group has its own counts and block table).
- `record_sampled_counts_torch`, after sampling (vLLM's Model Runner V2: a tree config's chain steps; V2's chains
  commit from V2's own accepted counts): the same for V2's batch, whose rows reach their request's block-table row
  through `idx_mapping` and whose speculative rows are the slots that hold a count (the step's count update gave
  every speculative row its node count, >= 1, and every other row 0).

A batch's rows hold distinct slots apart from the null block (CUDA-graph capture and padding rows), as vLLM's
requests do: rows never race on a slot other than the null block, where every row writes the same 0. No host sync;
shapes depend only on the host's row counts.
"""


from __future__ import annotations

from collections.abc import Sequence

import torch


def commit_nodes_and_counts_torch(counts, batch_slots, spec_query_start_loc, slots, commit_nodes, non_spec_slots,
                                  null_block: int, accepted=None) -> None:
    """The speculative rows (`batch_slots [R]`, any stride, `spec_query_start_loc [R + 1]`; all four None without
    any): their slots into `slots [R]` (contiguous), `commit_nodes [R] = counts[slot] - 1` (-1 in the null block),
    then `counts[slot]` = the row's node count (0 in the null block). Then `counts[non_spec_slots] = 0`.

    With `accepted [R]` (contiguous; the runner's own count per row of the tokens its last step accepted, >= 1:
    Model Runner V2's `num_accepted_tokens`), a slot's count only says whether a verify is pending (> 0: its node
    count) and the row commits `min(counts[slot], accepted[row]) - 1` (-1 where nothing is pending)."""
    if batch_slots is not None:
        slots.copy_(batch_slots)
        null_rows = slots == null_block
        pending = counts[slots]
        if accepted is not None:
            pending = torch.minimum(pending, accepted.to(pending.dtype))
        torch.sub(pending, 1, out=commit_nodes).masked_fill_(null_rows, -1)
        counts[slots] = spec_query_start_loc.diff().masked_fill_(null_rows, 0)
    if non_spec_slots is not None:
        # index_fill_, not `counts[rows] = 0`: on CUDA that copies the 0 from the host and waits for the device.
        counts.index_fill_(0, non_spec_slots.long(), 0)


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
