"""Causal depthwise conv1d over packed draft trees, in torch (the CPU path and the Triton twin).

A node's input sequence is its request's committed conv history followed by its root-to-node path; its window
is the last w entries of that sequence (the node itself last). Commit keeps the last L entries for the accepted
node, so the next step continues from the accepted path.

x ``[N, D]``; ``conv_state`` a pool ``[S, D, L]`` (any strided view), history oldest first with ``L >= w - 1``
(vLLM keeps ``w - 1 + num_spec`` columns); weight ``[D, w]`` with ``weight[:, -1]`` on the current input;
``state_indices``, ``parents``, ``cu_nodes`` as in ``closed_form``.
"""

from __future__ import annotations

import torch

from ..tree import chain_parents, global_parents, node_requests

ACTIVATIONS = (None, "silu")


def _sequence_rows(
    nodes: torch.Tensor, requests: torch.Tensor, parent_of: torch.Tensor, history_len: int, steps: int
) -> torch.Tensor:
    """``[M, steps]`` rows of the last ``steps`` entries of history + path for each node, oldest first.

    Rows index ``_sequence_source``: packed nodes first (N of them), then each request's L history entries.
    """
    num_nodes = parent_of.numel()
    rows = torch.empty((nodes.numel(), steps), dtype=torch.long, device=nodes.device)
    steps_past_root = torch.zeros_like(nodes)
    for back in range(steps):
        on_path = nodes >= 0
        history_row = num_nodes + requests * history_len + (history_len - 1) - steps_past_root
        rows[:, steps - 1 - back] = torch.where(on_path, nodes, history_row)
        steps_past_root += ~on_path
        nodes = torch.where(on_path, parent_of[nodes.clamp(min=0)], nodes)
    return rows


def _sequence_source(
    x: torch.Tensor, conv_state: torch.Tensor, state_indices: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """``cat([x, histories])`` as ``[N + B*L, D]`` in ``dtype`` (padding requests' slots are not read), and the live
    mask."""
    slots = state_indices.long()
    live = slots >= 0
    num_channels, history_len = conv_state.shape[1:]
    histories = torch.zeros((slots.numel(), history_len, num_channels), dtype=dtype, device=x.device)
    histories[live] = conv_state[slots[live]].transpose(1, 2).to(dtype)
    return torch.cat([x.to(dtype), histories.reshape(-1, num_channels)]), live


def conv_verify_packed(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    state_indices: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    parents: torch.Tensor,
    cu_nodes: torch.Tensor,
    *,
    activation: str | None = None,
) -> torch.Tensor:
    """Conv output ``[N, D]`` in x's dtype (fp32 accumulation, fp64 for fp64); padding requests get zeros.

    ``activation``: None or "silu". The conv state pool is only read.
    """
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    num_channels, width = weight.shape
    if x.dim() != 2 or x.shape[1] != num_channels:
        raise ValueError(f"x must be [N, D={num_channels}], got {tuple(x.shape)}")
    if conv_state.dim() != 3 or conv_state.shape[1] != num_channels or conv_state.shape[2] < width - 1:
        raise ValueError(f"conv_state must be [S, D={num_channels}, L>={width - 1}], got {tuple(conv_state.shape)}")
    dtype = torch.float64 if torch.float64 in (x.dtype, conv_state.dtype, weight.dtype) else torch.float32
    source, live = _sequence_source(x, conv_state, state_indices, dtype)
    requests = node_requests(cu_nodes)
    nodes = torch.arange(x.shape[0], device=x.device)
    rows = _sequence_rows(nodes, requests, global_parents(parents, cu_nodes), conv_state.shape[2], width)
    out = torch.einsum("nwd,dw->nd", source[rows], weight.to(dtype))
    if bias is not None:
        out = out + bias.to(dtype)
    if activation == "silu":
        out = torch.nn.functional.silu(out)
    return (out * live[requests, None]).to(x.dtype)


def conv_commit_packed(
    conv_state: torch.Tensor,
    state_indices: torch.Tensor,
    x: torch.Tensor,
    parents: torch.Tensor,
    cu_nodes: torch.Tensor,
    commit_nodes: torch.Tensor,
) -> None:
    """Write history + the commit node's path (last L entries) into each request's slot, in place.

    ``commit_nodes [B]``: local index of the node to commit, -1 = keep the history. Padding requests are skipped.
    """
    slots = state_indices.long()
    active = ((commit_nodes.long() >= 0) & (slots >= 0)).nonzero().squeeze(1)
    if active.numel() == 0:
        return
    history_len = conv_state.shape[2]
    source, _ = _sequence_source(x, conv_state, state_indices, conv_state.dtype)
    nodes = cu_nodes.long()[active] + commit_nodes.long()[active]
    rows = _sequence_rows(nodes, active, global_parents(parents, cu_nodes), history_len, history_len)
    conv_state[slots[active]] = source[rows].transpose(1, 2)


def commit_rows_and_parents(rows_per_slot: int, commit_nodes: torch.Tensor,
                            commit_ancestors: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(``[B]`` each slot's commit node as its row of the slot's previous rows, -1 kept; ``[B * rows_per_slot]``
    int32 local parents of those rows, slot after slot) for the commit at ``commit_nodes [B]``: along a chain (the
    node is its row), or along ``commit_ancestors [T, P]``, whose row a is commit node a's path in the slot's rows,
    node first, -1 past the root. T may exceed the rows (one table for several block shapes, e.g. a tree's and a
    chain's): each slot's rows get its path's parents, rows off the path hang below the root (never on the path).
    No host sync."""
    num_slots, device = commit_nodes.shape[0], commit_nodes.device
    if commit_ancestors is None:
        cu = torch.arange(num_slots + 1, device=device) * rows_per_slot
        return commit_nodes, chain_parents(cu, num_slots * rows_per_slot)
    nodes = commit_nodes.long()
    path = commit_ancestors.long()[nodes.clamp(min=0)]  # [B, P]
    rows = torch.where(nodes >= 0, path[:, 0], -1).to(commit_nodes.dtype)
    # column rows_per_slot takes the writes of entries past the root, then goes
    parents = torch.full((num_slots, rows_per_slot + 1), -1, dtype=torch.int32, device=device)
    children = torch.where(path[:, :-1] >= 0, path[:, :-1], rows_per_slot)
    parents.scatter_(1, children, path[:, 1:].to(torch.int32))
    return rows, parents[:, :rows_per_slot].reshape(-1)


def conv_step_packed(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    state_indices: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    parents: torch.Tensor | None,
    cu_nodes: torch.Tensor,
    inputs: torch.Tensor,
    commit_nodes: torch.Tensor | None,
    *,
    commit_ancestors: torch.Tensor | None = None,
    activation: str | None = None,
) -> torch.Tensor:
    """One speculative step: commit each slot's previous draft (a chain, or the tree ``commit_ancestors``) at
    ``commit_nodes [B]`` (-1: nothing to commit) from its per-slot input rows ``inputs [S, T, D]``, then the conv of
    this step's nodes, whose inputs replace the rows. ``parents`` None: every request a chain. Torch twin of
    `vllm_treewy.kernels.conv_step_triton.conv_step_triton`."""
    if parents is None:
        parents = chain_parents(cu_nodes, x.shape[0])
    slots = state_indices.long()
    live = slots >= 0
    if commit_nodes is not None:
        rows_per_slot = inputs.shape[1]
        previous_rows = inputs[slots.clamp(min=0)].reshape(-1, inputs.shape[2])  # a copy: step 3 overwrites them
        previous_cu = torch.arange(slots.numel() + 1, device=x.device) * rows_per_slot
        commit_rows, commit_parents = commit_rows_and_parents(rows_per_slot, commit_nodes, commit_ancestors)
        conv_commit_packed(conv_state, state_indices, previous_rows, commit_parents, previous_cu, commit_rows)
    out = conv_verify_packed(x, conv_state, state_indices, weight, bias, parents, cu_nodes, activation=activation)
    requests = node_requests(cu_nodes, x.shape[0])
    local = torch.arange(x.shape[0], device=x.device) - cu_nodes.long()[requests]
    keep = live[requests]
    inputs[slots[requests][keep], local[keep]] = x[keep].to(inputs.dtype)
    return out
