"""Runner bookkeeping, in torch: after sampling, with prefix caching of GDN states (vLLM's
`mamba_cache_mode="align"`), each speculative row's accepted count into its state slot, and, where the row's accepted
tokens reach a block boundary, the GDN state and conv window after the boundary's node into the boundary's block.
The CPU path and the specification of its twin, `vllm_treewy.kernels.bookkeeping.boundary_states_triton`.

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

Draft trees (and the chain steps of a tree config, `draft_tree_max_batch_size`) pass a commit table
``commit_ancestors [T, P]`` (`step_metadata.commit_ancestor_table`: row a is commit node a's path in the slot's rows,
a first, root-most last, -1 beyond), and per row the COUNT the slot records (1 + the accepted commit node a, as the
tree sampler records it, or a chain's accepted + 1 + N) in place of ``accepted``. A tree row verified its root and N
nodes in node order, and vLLM counts all 1 + N as scheduled tokens: ``seq_len = running + N`` with ``draft_tokens =
N``, so ``running = seq_len - draft_tokens`` still ends with the root. Positions along the accepted path are depths,
not block indices: with ``depth(a)`` = the number of entries >= 0 in row a, minus 1,

    reached   = running + depth(a)                          (not running + a: node a's block index is no position)
    up        = depth(a) - (boundary - running)              (steps from the accepted node up to the boundary's)
    node      = commit_ancestors[a, up]                      (the accepted path's node AT the boundary's depth)
    state[dest] = the commit of `node` along its path, commit_ancestors[a, up:] (the path's factor rows, not 0..node)
    conv[dest]  = the last w-1 of (the slot's history, the conv inputs of that path's nodes, root to `node`)

The boundary node's path is the accepted node's row shifted by `up`, not the table's row `node`: a chain step's rows
of the table are indexed by count (offset by 1 + N) while their entries are block-local slot rows.

The running column ``(seq_len - 1) // block_size`` counts every verified node, so it can lie past the accepted path's
reach, as a chain's rejected drafts can: it is the block vLLM gave the step's running state (the slot), and
``boundary <= reached`` keeps the boundary column at or before it. A chain's table row a is ``a, a-1, .., 0``, so the
table form reduces to the chain's (depth(a) = a, node = boundary - running); without a table the chain's path is
implied.

The null block (a freed column) is never written. Rows hold distinct slots, and a row's boundary block is its own
(the block before its running one, or that one): no two rows write the same block. The commit sums its terms as
`gdn_commit_packed` does (`committed_states`); fp32.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from ..gdn_step_torch import commit_paths, committed_states


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
    """Per speculative row (`rows`, int64): its slot's block column, the boundary node (-1: none; a slot row), the
    boundary's block column (valid where node >= 0), the count its slot records, the accepted commit node a and the
    steps `up` from it to the boundary node along its path (`boundary_paths`)."""

    rows: torch.Tensor
    slot_columns: torch.Tensor
    nodes: torch.Tensor
    dest_columns: torch.Tensor
    accepted: torch.Tensor
    commits: torch.Tensor
    up: torch.Tensor


def boundary_paths(commits: torch.Tensor, up: torch.Tensor, rows_per_slot: int,
                   commit_ancestors: torch.Tensor | None = None) -> torch.Tensor:
    """``[L, P]`` int64 the path of the node `up[l]` steps above commit node `commits[l]` (the node first, root-most
    last, -1 beyond): the commit node's path (`commit_paths`) from entry `up` on."""
    path = commit_paths(commits, rows_per_slot, commit_ancestors)
    step = up.long()[:, None] + torch.arange(path.shape[1], device=path.device)
    return torch.where(step < path.shape[1], path.gather(1, step.clamp(max=path.shape[1] - 1)), -1)


def boundary_rows(seq_lens: torch.Tensor, draft_tokens: torch.Tensor, accepted: torch.Tensor, num_rows: int,
                  block_size: int, commit_ancestors: torch.Tensor | None = None) -> BoundaryRows:
    """The per-row quantities of the module docstring for the first `num_rows` rows (int32 inputs `[>= num_rows]`:
    vLLM's seq_lens, num_decode_draft_tokens (-1: not speculative) and accepted counts, or with `commit_ancestors`
    the counts the slots record); no host sync. `nodes` are slot-row indices (the path's node at the boundary's
    depth); `accepted` is what the slot's count records."""
    seq_len, draft, accept = (x[:num_rows].long() for x in (seq_lens, draft_tokens, accepted))
    rows = torch.arange(num_rows, device=seq_lens.device)[draft >= 0]
    seq_len, draft, accept = seq_len[rows], draft[rows], accept[rows]
    running = seq_len - draft
    if commit_ancestors is None:
        depth = accept - 1
    else:
        path = commit_ancestors.long()[(accept - 1).clamp(min=0)]  # [rows, P]: the accepted node first
        depth = (path >= 0).sum(1) - 1
    boundary = (running + depth) // block_size * block_size
    reached = boundary >= running
    up = (depth - (boundary - running)).clamp(min=0)
    if commit_ancestors is None:
        node = accept - 1 - up
    else:
        node = path.gather(1, up.clamp(max=path.shape[1] - 1)[:, None])[:, 0]
    return BoundaryRows(rows, (seq_len - 1) // block_size, torch.where(reached, node, -1),
                        torch.where(reached, boundary // block_size - 1, 0), accept, accept - 1, up)


def conv_windows(conv_history: torch.Tensor, conv_inputs: torch.Tensor, slots: torch.Tensor,
                 paths: torch.Tensor) -> torch.Tensor:
    """``[L, D, w-1]`` the conv history after the node whose path is ``paths[l]`` (the node first, root-most last,
    -1 beyond; `boundary_paths`) in slot ``slots[l]``: the last w-1 of (history, conv inputs of the path's nodes,
    root first), oldest first, in the history's dtype."""
    history_len = conv_history.shape[2]
    slots = slots.long()
    path = paths.long()
    depth = (path >= 0).sum(1)[:, None] - 1
    position = depth + 1 + torch.arange(history_len, device=slots.device)  # in history ++ the path's inputs
    # the input at position p is the path's node at depth p - (w-1): entry depth - (p - (w-1)) of the path
    steps_up = (depth - (position - history_len)).clamp(0, path.shape[1] - 1)
    input_rows = path.gather(1, steps_up).clamp(min=0)
    from_history = conv_history[slots[:, None], :, position.clamp(max=history_len - 1)]  # [L, w-1, D]
    from_inputs = conv_inputs[slots[:, None], input_rows].to(conv_history.dtype)
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
                                         idx_mapping: torch.Tensor | None = None,
                                         commit_ancestors: torch.Tensor | None = None) -> None:
    """The module docstring's writes, for every layer. `idx_mapping [>= num_rows]` (V2): each batch row's
    block-table row, -1 to skip the row; None: the batch row itself (V1). `commit_ancestors [T, P]` (int32, draft
    trees): the commit table, `accepted` then being the counts the slots record; None: chains."""
    if num_rows == 0:
        return
    rows = boundary_rows(seq_lens, draft_tokens, accepted, num_rows, block_size, commit_ancestors)
    if idx_mapping is not None:
        requests = idx_mapping[:num_rows].long()[rows.rows]
        rows = BoundaryRows(*(x[requests >= 0] for x in (requests, *rows[1:])))
    for layer in layers:
        slots = layer.block_table[rows.rows, rows.slot_columns].long()
        dests = layer.block_table[rows.rows, rows.dest_columns].long()
        real = slots != null_block
        write = real & (rows.nodes >= 0) & (dests != null_block)
        in_place = write & (dests == slots)
        src, dst = slots[write], dests[write]
        paths = boundary_paths(rows.commits[write], rows.up[write], layer.factors.shape[1], commit_ancestors)
        # each row's own path as a one-row table: the commit of node l of `paths`
        rows_of_paths = torch.arange(paths.shape[0], device=paths.device)
        states = committed_states(layer.state, src, layer.factors, rows_of_paths, paths).to(layer.state.dtype)
        windows = conv_windows(layer.conv_history, layer.conv_inputs, src, paths)
        layer.state[dst] = states
        layer.conv_history[dst] = windows
        layer.counts[slots[real]] = torch.where(in_place, 0, rows.accepted).to(layer.counts.dtype)[real]
        layer.counts[dst] = 0
