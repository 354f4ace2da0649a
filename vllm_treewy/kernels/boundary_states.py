"""After sampling, with prefix caching of GDN states (vLLM's `mamba_cache_mode="align"`): each speculative row's
accepted count into its state slot, and, where the row's accepted tokens reach a block boundary, the GDN state and
conv window after the boundary's node into the boundary's block. Torch (the CPU path and the twin of
`vllm_treewy.kernels.triton.boundary_states`).

In align mode a request's state blocks are indexed by position: block column c holds the state after
``(c + 1) * block_size`` tokens once the request has passed that boundary (what a prefix-cache hit restores), and
the running state lives in column ``(seq_len - 1) // block_size``. A speculative row verified its root (the last
sampled token) and ``draft_tokens`` drafts from the committed state in its slot and left their factors there
(`factor_rows`, the conv inputs); of the row's ``seq_len`` tokens, ``running = seq_len - draft_tokens`` end with the
root, and ``reached = running + accepted - 1`` with the accepted node. Per speculative row (``draft_tokens >= 0``):

    slot      = block_table[row, (seq_len - 1) // block_size]
    boundary  = reached // block_size * block_size        (the last boundary at or before `reached`)
    if boundary >= running:                                (the verified block reached it)
        node  = boundary - running                         (the accepted chain's node that ends there, 0 = the root)
        dest  = block_table[row, boundary // block_size - 1]
        state[dest]   = exp(c_node) h0 + sum_{j <= node} exp(c_node - c_j) (u_j key_scale_j) key_j^T
        conv[dest]    = the last w-1 of (the slot's conv history, the conv inputs of nodes 0..node)
        counts[dest]  = 0                                  (a restored block has nothing to commit)
    counts[slot] = accepted, or 0 where dest is the slot itself (then the row verified a whole block's last token
    and accepted it all: the commit happens here, in place, and the next step has nothing to commit)

Model Runner V2 keeps a block-table row per request state for the request's life and maps batch rows to them
(`idx_mapping [rows]`, -1: skip the row); given one, ``block_table[row]`` above reads ``block_table[idx_mapping[row]]``.
V2 has no per-row draft counts on the device: `sampled_rows` derives them from the slots' counts, which the step's
count update left at each speculative row's node count (1 + drafts) and at 0 in every other row's slot.

The null block (a freed column) is never written. Rows hold distinct slots, and a row's boundary block is its own
(the block before its running one, or that one): no two rows write the same block. Chains only (draft trees are
refused with prefix caching). The commit sums its terms as `gdn_commit_packed` does (`committed_states`); fp32.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from .gdn_step_torch import committed_states


class BoundaryLayer(NamedTuple):
    """One GDN layer's views, all indexed by state slot (any strides; the conv history's and the state's as vLLM's
    page lays them out): the state ``[S, HV, V, K]``, the factor rows ``[S, T, F]``, the conv history ``[S, D, w-1]``
    (oldest first), the conv inputs ``[S, T, D]``, the count state ``[S]`` (int32), and the block table of its
    KV-cache group ``[R, C]`` (int32, batch rows)."""

    state: torch.Tensor
    factors: torch.Tensor
    conv_history: torch.Tensor
    conv_inputs: torch.Tensor
    counts: torch.Tensor
    block_table: torch.Tensor


class BoundaryRows(NamedTuple):
    """Per speculative row (`rows`, int64): its slot's block column, the boundary node (-1: none) and the boundary's
    block column (valid where node >= 0)."""

    rows: torch.Tensor
    slot_columns: torch.Tensor
    nodes: torch.Tensor
    dest_columns: torch.Tensor
    accepted: torch.Tensor


def boundary_rows(seq_lens: torch.Tensor, draft_tokens: torch.Tensor, accepted: torch.Tensor, num_rows: int,
                  block_size: int) -> BoundaryRows:
    """The per-row quantities of the module docstring for the first `num_rows` rows (int32 inputs `[>= num_rows]`:
    vLLM's seq_lens, num_decode_draft_tokens (-1: not speculative) and accepted counts); no host sync."""
    seq_len, draft, accept = (x[:num_rows].long() for x in (seq_lens, draft_tokens, accepted))
    rows = torch.arange(num_rows, device=seq_lens.device)[draft >= 0]
    seq_len, draft, accept = seq_len[rows], draft[rows], accept[rows]
    running = seq_len - draft
    boundary = (running + accept - 1) // block_size * block_size
    reached = boundary >= running
    return BoundaryRows(rows, (seq_len - 1) // block_size, torch.where(reached, boundary - running, -1),
                        torch.where(reached, boundary // block_size - 1, 0), accept)


def conv_windows(conv_history: torch.Tensor, conv_inputs: torch.Tensor, slots: torch.Tensor,
                 nodes: torch.Tensor) -> torch.Tensor:
    """``[L, D, w-1]`` the conv history after chain node ``nodes[l] >= 0`` of slot ``slots[l]``: the last w-1 of
    (history, conv inputs of nodes 0..node), oldest first, in the history's dtype."""
    history_len = conv_history.shape[2]
    slots = slots.long()
    position = nodes.long()[:, None] + 1 + torch.arange(history_len, device=slots.device)  # in history ++ inputs
    from_history = conv_history[slots[:, None], :, position.clamp(max=history_len - 1)]  # [L, w-1, D]
    from_inputs = conv_inputs[slots[:, None], (position - history_len).clamp(min=0)].to(conv_history.dtype)
    return torch.where((position < history_len)[..., None], from_history, from_inputs).transpose(1, 2)


def sampled_rows(counts: torch.Tensor, block_table: torch.Tensor, idx_mapping: torch.Tensor, seq_lens: torch.Tensor,
                 num_sampled: torch.Tensor, num_rows: int, *, block_size: int,
                 null_block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """V2's rows as `record_accepted_and_boundaries_torch` takes them: (draft tokens, accepted) int32 `[num_rows]`.
    A row speculated iff its slot (`block_table[idx_mapping[row], (seq_len - 1) // block_size]`, in the group whose
    `counts [S]` the step's count update wrote) holds a count: drafts = count - 1, else -1 (also for skipped rows and
    the null block). Accepted = max(num_sampled, 1): a one-token prompt tail that ran as a decode samples nothing
    but verified its node 0, as vLLM's own `max(num_sampled, 1)` has it. Call it before any count is rewritten."""
    requests = idx_mapping[:num_rows].long()
    live = requests >= 0
    columns = torch.where(live, (seq_lens[:num_rows].long() - 1).clamp(min=0) // block_size, 0)
    slots = block_table[requests.clamp(min=0), columns].long()
    count = torch.where(live & (slots != null_block), counts[slots].long(), 0)
    accepted = num_sampled[:num_rows].clamp(min=1)
    return (count - 1).to(torch.int32), accepted.to(torch.int32)


def record_accepted_and_boundaries_torch(layers: Sequence[BoundaryLayer], seq_lens: torch.Tensor,
                                         draft_tokens: torch.Tensor, accepted: torch.Tensor, num_rows: int, *,
                                         block_size: int, null_block: int,
                                         idx_mapping: torch.Tensor | None = None) -> None:
    """The module docstring's writes, for every layer. `idx_mapping [>= num_rows]` (V2): each batch row's
    block-table row, -1 to skip the row; None: the batch row itself (V1)."""
    if num_rows == 0:
        return
    rows = boundary_rows(seq_lens, draft_tokens, accepted, num_rows, block_size)
    if idx_mapping is not None:
        requests = idx_mapping[:num_rows].long()[rows.rows]
        rows = BoundaryRows(*(x[requests >= 0] for x in (requests, *rows[1:])))
    for layer in layers:
        slots = layer.block_table[rows.rows, rows.slot_columns].long()
        dests = layer.block_table[rows.rows, rows.dest_columns].long()
        real = slots != null_block
        write = real & (rows.nodes >= 0) & (dests != null_block)
        in_place = write & (dests == slots)
        src, dst, node = slots[write], dests[write], rows.nodes[write]
        states = committed_states(layer.state, src, layer.factors, node).to(layer.state.dtype)
        windows = conv_windows(layer.conv_history, layer.conv_inputs, src, node)
        layer.state[dst] = states
        layer.conv_history[dst] = windows
        layer.counts[slots[real]] = torch.where(in_place, 0, rows.accepted).to(layer.counts.dtype)[real]
        layer.counts[dst] = 0
