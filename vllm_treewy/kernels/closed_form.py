"""Closed form of the gated delta rule over packed draft trees, in torch: the CPU path, and the verify of the GDN
step's torch twin (`gdn_step_torch`).

Verify solves ``(I + G) U = R`` per request and value head and never writes a state; commit rebuilds only the
accepted node's state from h0 and the path's factors ``(k, u, g)``, in place. With ``c_i`` the sum of g over node i's
root-to-node path (i included), unrolling the recurrence (package docstring) from h0 gives, per value head::

    R_i  = beta_i (v_i - exp(c_i) h0 k_i)
    G_ij = beta_i exp(c_i - c_j) (k_i . k_j)       for j a strict ancestor of i, else 0
    o_i  = exp(c_i) h0 q_i + sum_{j on path(i)} exp(c_i - c_j) (q_i . k_j) u_j
    h_a  = exp(c_a) h0 + sum_{j on path(a)} exp(c_a - c_j) u_j k_j^T

Ancestors precede their nodes, so ``I + G`` is unit lower triangular (forward substitution), and ``G`` is nilpotent
of the tree's depth (the Neumann series ends).

Conventions (shared with the Triton step): q, k ``[N, H, K]``; v ``[N, HV, V]``; g (log decay, <= 0) and
beta ``[N, HV]``; ``state`` a pool ``[S, HV, V, K]`` (any strided view, e.g. the CPU cache's ``[S, HV, K, V]``
transposed); ``state_indices`` ``[B]`` slot of each request's committed state, negative = padding request;
``parents`` ``[N]`` local indices, ``cu_nodes`` ``[B+1]`` (see ``vllm_treewy.tree``).

Precision: products and sums run in fp32 (fp64 when any input is fp64). Path log decays are summed in fp64,
because ``c_i - c_j`` of two long fp32 cumulative sums loses the small decays that matter most.
Every exponent is a difference ``c_i - c_j <= 0`` along a path; no decay is ever divided by.
"""

from __future__ import annotations

import torch

from ..tree import global_parents, packed_depths

SOLVES = ("substitution", "neumann")


def compute_dtype(*tensors: torch.Tensor) -> torch.dtype:
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def _max_depth(parents: torch.Tensor, cu_nodes: torch.Tensor, max_depth: int | None) -> int:
    if max_depth is not None:
        return max_depth
    return int(packed_depths(parents, cu_nodes).max()) if parents.numel() else 0


def _check_shapes(q, k, v, g, beta, state) -> None:
    if q.dim() != 3 or q.shape != k.shape:
        raise ValueError(f"q and k must both be [N, H, K], got {tuple(q.shape)} and {tuple(k.shape)}")
    num_nodes, num_key_heads, key_dim = k.shape
    if v.dim() != 3 or v.shape[0] != num_nodes:
        raise ValueError(f"v must be [N={num_nodes}, HV, V], got {tuple(v.shape)}")
    _, num_value_heads, value_dim = v.shape
    if num_value_heads % num_key_heads:
        raise ValueError(f"value heads HV={num_value_heads} must be a multiple of key heads H={num_key_heads}")
    for name, gate in (("g", g), ("beta", beta)):
        if gate.shape != (num_nodes, num_value_heads):
            raise ValueError(f"{name} must be [N={num_nodes}, HV={num_value_heads}], got {tuple(gate.shape)}")
    if state.dim() != 4 or state.shape[1:] != (num_value_heads, value_dim, key_dim):
        raise ValueError(
            f"state must be a pool [S, HV={num_value_heads}, V={value_dim}, K={key_dim}], got {tuple(state.shape)}"
        )


def _value_heads(x: torch.Tensor, num_value_heads: int) -> torch.Tensor:
    """Key-head tensor ``[..., H, K]`` -> ``[..., HV, K]``: value head hv reads key head hv // (HV // H)."""
    return x.repeat_interleave(num_value_heads // x.shape[-2], dim=-2)


def path_log_decay(
    g: torch.Tensor, parents: torch.Tensor, cu_nodes: torch.Tensor, max_depth: int | None = None
) -> torch.Tensor:
    """``c [N, HV]`` fp64: sum of g over each node's root-to-node path (node included), by parent pointers.

    ``max_depth`` is an upper bound on the tree depth (computed when None).
    """
    parent_of = global_parents(parents, cu_nodes)
    g = g.double()
    c = g.clone()
    ancestor = parent_of
    for _ in range(_max_depth(parents, cu_nodes, max_depth) - 1):
        on_path = ancestor >= 0
        c += torch.where(on_path[:, None], g[ancestor.clamp(min=0)], 0.0)
        ancestor = torch.where(on_path, parent_of[ancestor.clamp(min=0)], ancestor)
    return c


class _PaddedBatch:
    """Requests laid out as ``[B, T]`` rows (T = most nodes in a request) so each tree's matrices are dense."""

    def __init__(self, parents: torch.Tensor, cu_nodes: torch.Tensor, max_depth: int):
        cu_nodes = cu_nodes.long()
        self.num_nodes = parents.numel()
        lengths = cu_nodes.diff()
        self.width = int(lengths.max()) if lengths.numel() else 0
        local = torch.arange(self.width, device=parents.device)
        self.valid = local[None, :] < lengths[:, None]  # [B, T]
        # Invalid rows point at row N, a zero row appended by `rows`.
        self.node = torch.where(self.valid, cu_nodes[:-1, None] + local[None, :], self.num_nodes)
        local_parents = torch.where(self.valid, self.rows(parents.long(), fill=-1), -1)
        self.strict_ancestor = self._strict_ancestors(local_parents, max_depth)

    def rows(self, x: torch.Tensor, fill: float = 0) -> torch.Tensor:
        """Packed ``[N, ...]`` -> padded ``[B, T, ...]``, padding rows filled with ``fill``."""
        pad = torch.full((1, *x.shape[1:]), fill, dtype=x.dtype, device=x.device)
        return torch.cat([x, pad])[self.node]

    def packed(self, x: torch.Tensor) -> torch.Tensor:
        """Padded ``[B, T, ...]`` -> packed ``[N, ...]``."""
        return x[self.valid]

    def _strict_ancestors(self, local_parents: torch.Tensor, max_depth: int) -> torch.Tensor:
        num_requests, width = local_parents.shape
        # Column `width` absorbs the walks that already left the tree.
        mask = torch.zeros(num_requests, width, width + 1, dtype=torch.bool, device=local_parents.device)
        ancestor = local_parents
        for _ in range(max_depth - 1):
            mask.scatter_(2, torch.where(ancestor >= 0, ancestor, width).unsqueeze(-1), True)
            ancestor = torch.where(ancestor >= 0, local_parents.gather(1, ancestor.clamp(min=0)), ancestor)
        return mask[..., :width]


def _committed_states(state, state_indices, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """h0 ``[B, HV, V, K]`` in ``dtype`` (zeros for padding requests, whose slots are not read) and the request mask."""
    slots = state_indices.long()
    live = slots >= 0
    if bool(live.all()):
        return state[slots].to(dtype), live
    h0 = torch.zeros((slots.numel(), *state.shape[1:]), dtype=dtype, device=state.device)
    h0[live] = state[slots[live]].to(dtype)
    return h0, live


def verify_packed(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    state_indices: torch.Tensor,
    parents: torch.Tensor,
    cu_nodes: torch.Tensor,
    *,
    solve: str = "substitution",
    max_depth: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Outputs ``o [N, HV, V]`` (dtype of v) and pseudo-values ``u [N, HV, V]`` (fp32, fp64 for fp64 inputs).

    ``solve``: "substitution" (triangular solve over T rows) or "neumann" (``sum_{m < max_depth} (-G)^m R``).
    ``max_depth`` bounds the tree depth (computed from ``parents`` when None). Padding requests get zeros.
    The state pool is only read.
    """
    if solve not in SOLVES:
        raise ValueError(f"solve must be one of {SOLVES}, got {solve!r}")
    _check_shapes(q, k, v, g, beta, state)
    dtype = compute_dtype(q, k, v, g, beta, state)
    num_value_heads = v.shape[1]
    if v.shape[0] == 0:
        return torch.zeros_like(v), torch.zeros(v.shape, dtype=dtype, device=v.device)
    max_depth = _max_depth(parents, cu_nodes, max_depth)
    batch = _PaddedBatch(parents, cu_nodes, max_depth)

    c = batch.rows(path_log_decay(g, parents, cu_nodes, max_depth)).transpose(1, 2)  # [B, HV, T] fp64
    own_or_ancestor = batch.strict_ancestor | torch.eye(batch.width, dtype=torch.bool, device=c.device)
    decay = torch.exp(
        torch.where(own_or_ancestor[:, None], c[..., :, None] - c[..., None, :], -torch.inf)
    )  # [B, HV, T, T]: exp(c_i - c_j) for j on the path of i, else 0
    strict_decay = (decay * batch.strict_ancestor[:, None]).to(dtype)
    decay, root_decay = decay.to(dtype), torch.exp(c).to(dtype)

    q_rows = batch.rows(_value_heads(q.to(dtype), num_value_heads))  # [B, T, HV, K]
    k_rows = batch.rows(_value_heads(k.to(dtype), num_value_heads))
    v_rows = batch.rows(v.to(dtype)).transpose(1, 2)  # [B, HV, T, V]
    beta_rows = batch.rows(beta.to(dtype)).transpose(1, 2)  # [B, HV, T]
    h0, live = _committed_states(state, state_indices, dtype)

    h0_k = torch.einsum("bhvk,bthk->bhtv", h0, k_rows)
    r = beta_rows[..., None] * (v_rows - root_decay[..., None] * h0_k)
    gram = beta_rows[..., None] * strict_decay * torch.einsum("bihk,bjhk->bhij", k_rows, k_rows)
    if solve == "substitution":
        eye = torch.eye(batch.width, dtype=dtype, device=gram.device)
        u = torch.linalg.solve_triangular(eye + gram, r, upper=False, unitriangular=True)
    else:
        u, term = r, r
        for _ in range(max_depth - 1):
            term = -(gram @ term)
            u = u + term
    h0_q = torch.einsum("bhvk,bthk->bhtv", h0, q_rows)
    o = root_decay[..., None] * h0_q + (decay * torch.einsum("bihk,bjhk->bhij", q_rows, k_rows)) @ u

    node_live = live[:, None, None, None]  # padding requests: zeros, not beta * v
    o = batch.packed((o * node_live).transpose(1, 2)).to(v.dtype)
    u = batch.packed((u * node_live).transpose(1, 2))
    return o, u


def commit_packed(
    state: torch.Tensor,
    state_indices: torch.Tensor,
    k: torch.Tensor,
    u: torch.Tensor,
    g: torch.Tensor,
    parents: torch.Tensor,
    cu_nodes: torch.Tensor,
    commit_nodes: torch.Tensor,
    *,
    max_depth: int | None = None,
) -> None:
    """Write the state after each request's commit node, ``h_a = exp(c_a) h0 + sum_j exp(c_a - c_j) u_j k_j^T``, into
    its slot.

    ``commit_nodes [B]``: local index of the node to commit, -1 = keep h0 (nothing accepted). Padding requests
    (negative slot) are skipped. Writes go through ``state`` in place, so strided views of a pool work.
    """
    slots = state_indices.long()
    active = ((commit_nodes.long() >= 0) & (slots >= 0)).nonzero().squeeze(1)
    if active.numel() == 0:
        return
    dtype = compute_dtype(k, u, g, state)
    num_value_heads = u.shape[1]
    parent_of = global_parents(parents, cu_nodes)
    path = [cu_nodes.long()[active] + commit_nodes.long()[active]]  # the commit node first, then its ancestors
    for _ in range(_max_depth(parents, cu_nodes, max_depth) - 1):
        path.append(torch.where(path[-1] >= 0, parent_of[path[-1].clamp(min=0)], path[-1]))
    path = torch.stack(path, dim=1)  # [M, P], -1 past the root
    on_path = path >= 0
    j = path.clamp(min=0)

    # c_a - c_j is the sum of g over the path strictly below j: an exclusive prefix sum, never a difference.
    g_path = torch.where(on_path[..., None], g[j].double(), 0.0)  # [M, P, HV]
    prefix = torch.cumsum(g_path, dim=1)
    log_weight = torch.cat([torch.zeros_like(prefix[:, :1]), prefix[:, :-1]], dim=1)
    weighted_u = (torch.exp(log_weight) * on_path[..., None]).to(dtype)[..., None] * u[j].to(dtype)
    h = torch.einsum("mphv,mphk->mhvk", weighted_u, _value_heads(k[j].to(dtype), num_value_heads))
    h += torch.exp(prefix[:, -1]).to(dtype)[..., None, None] * state[slots[active]].to(dtype)
    state[slots[active]] = h.to(state.dtype)
