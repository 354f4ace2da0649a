"""Torch twin of `vllm_treewy.kernels.gdn_step_triton.step`: the GDN decode step after the conv (gates, q/k L2 norm,
closed-form verify, the core output rounded to the model dtype as vLLM rounds it, gated RMSNorm with the output
gate), its factors in the slots' rows (`factor_rows`), and the commit of the previous step's node from those rows
(its path in a chain or a static tree). Built on `closed_form`'s packed verify; fp32 (fp64 for fp64 inputs).
Ground truth: `reference.reference_gated_tree`.
"""

from __future__ import annotations

import torch

from ..tree import chain_parents, node_requests
from .closed_form import compute_dtype, verify_packed
from .factor_rows import split_slot_factors

L2NORM_EPS = 1e-6


def split_qkv(mixed_qkv: torch.Tensor, num_key_heads: int, key_dim: int, value_dim: int):
    """Post-conv ``[N, 2*H*K + HV*V]`` -> raw q, k ``[N, H, K]`` and v ``[N, HV, V]`` (views)."""
    n, hk = mixed_qkv.shape[0], num_key_heads * key_dim
    q = mixed_qkv[:, :hk].unflatten(1, (num_key_heads, key_dim))
    k = mixed_qkv[:, hk: 2 * hk].unflatten(1, (num_key_heads, key_dim))
    v = mixed_qkv[:, 2 * hk:].unflatten(1, (-1, value_dim))
    return q, k, v


def gates(a, b, A_log, dt_bias, dtype=torch.float32):
    """g = -exp(A_log) softplus(a + dt_bias) (vLLM's threshold 20), beta = sigmoid(b)."""
    x = a.to(dtype) + dt_bias.to(dtype)
    softplus = torch.where(x <= 20.0, torch.log1p(torch.exp(x)), x)
    return -torch.exp(A_log.to(dtype)) * softplus, torch.sigmoid(b.to(dtype))


def inverse_norm(x: torch.Tensor) -> torch.Tensor:
    """1 / sqrt(|x|^2 + 1e-6) over the last dim (vLLM's in-kernel L2 norm)."""
    return torch.rsqrt(x.pow(2).sum(-1) + L2NORM_EPS)


def gated_rms_norm(o, z, weight, eps, activation="silu"):
    gate = z * torch.sigmoid(z) if activation == "silu" else torch.sigmoid(z)
    return o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + eps) * weight.to(o.dtype) * gate


def commit_paths(commit_nodes: torch.Tensor, rows_per_slot: int,
                  commit_ancestors: torch.Tensor | None = None) -> torch.Tensor:
    """``[B, P]`` int64 local rows of each commit node's path, the node first and root-most last, -1 past the root
    (and for commit_nodes -1): a chain's ``a, a-1, .., 0`` (P = rows_per_slot), a tree's ``commit_ancestors[a]``
    (P = its D)."""
    node = commit_nodes.long()
    if commit_ancestors is None:
        path = node[:, None] - torch.arange(rows_per_slot, device=node.device)
    else:
        path = commit_ancestors.long()[node.clamp(min=0)]
    return torch.where((node[:, None] >= 0) & (path >= 0), path, -1)


def committed_states(state, slots, factors, commit_nodes, commit_ancestors=None) -> torch.Tensor:
    """``[L, HV, V, K]`` (fp32, fp64 for fp64 inputs) the state after node ``commit_nodes[l] >= 0`` of each slot
    ``slots[l] >= 0``'s previous step, from the slot's state and factor rows (paths as `gdn_commit_packed`);
    nothing written. Every decay is a running sum of g from the node up to the child of j, never a difference."""
    _, num_value_heads, value_dim, key_dim = state.shape
    dtype = compute_dtype(state, factors)
    slots = slots.long()
    path = commit_paths(commit_nodes, factors.shape[1], commit_ancestors)  # [L, P]
    on = path >= 0
    path_rows = factors[slots[:, None], path.clamp(min=0)].to(dtype)  # [L, P, F]: rows off the path hold anything
    k, k_scale, u, g = split_slot_factors(path_rows, num_value_heads, key_dim, value_dim)
    g = torch.where(on[..., None], g, 0.0)
    up_to_j = g.cumsum(1)  # [L, P, HV]: g_a + ... + g_j along the path
    below_j = torch.cat([torch.zeros_like(up_to_j[:, :1]), up_to_j[:, :-1]], 1)  # c_a - c_j
    weight = torch.where(on[..., None], torch.exp(below_j) * k_scale, 0.0)
    u = torch.where(on[..., None, None], u, 0.0) * weight[..., None]  # NaN-safe: off-path rows are masked out
    k = torch.where(on[..., None, None], k, 0.0)
    return torch.exp(up_to_j[:, -1])[..., None, None] * state[slots].to(dtype) + torch.einsum("lphv,lphk->lhvk", u, k)


def gdn_commit_packed(state, state_indices, factors, commit_nodes, commit_ancestors=None):
    """In place, for each request b with slot s = state_indices[b] >= 0 and a = commit_nodes[b] >= 0: the state
    after node a, whose path's factors are in rows factors[s, j] (`commit_paths`: 0..a for a chain, else the
    previous step's tree as an ancestor table ``commit_ancestors [T, D]`` shared by every slot),

        h_a = exp(c_a) h0 + sum_{j on the path} exp(c_a - c_j) (u_j k_scale_j) k_j^T,   c_j = sum of g root..j
    (`committed_states`)."""
    live = (state_indices >= 0) & (commit_nodes >= 0)
    slots = state_indices[live].long()
    state[slots] = committed_states(state, slots, factors, commit_nodes[live], commit_ancestors).to(state.dtype)


def gdn_step_packed(mixed_qkv, a, b, A_log, dt_bias, output_gate, norm_weight, state, state_indices, parents,
                    cu_nodes, *, num_key_heads, factors, commit_nodes=None, commit_ancestors=None, scale=None,
                    norm_eps=1e-6, activation="silu", max_depth=None):
    """``out [N, HV, V]`` in mixed_qkv's dtype (zero for padding requests). With `commit_nodes`, first commits
    each slot's previous step (`gdn_commit_packed`, its chain or the tree `commit_ancestors`, reading its rows
    before anything is written); then verifies
    from the (committed) state and writes each live node's factors to rows factors[slot, local index]. ``parents``
    None: every request a chain."""
    if parents is None:
        parents = chain_parents(cu_nodes, mixed_qkv.shape[0])
    _, num_value_heads, value_dim, key_dim = state.shape
    if commit_nodes is not None:
        gdn_commit_packed(state, state_indices, factors, commit_nodes, commit_ancestors)
    dtype = compute_dtype(mixed_qkv, state)
    q, k, v = split_qkv(mixed_qkv, num_key_heads, key_dim, value_dim)
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    k_scale = inverse_norm(k)
    scale = key_dim**-0.5 if scale is None else scale
    g, beta = gates(a, b, A_log, dt_bias, dtype)
    o, u = verify_packed(q * (inverse_norm(q) * scale)[..., None], k * k_scale[..., None], v, g, beta, state,
                         state_indices, parents, cu_nodes, max_depth=max_depth)
    # the core output rounded to the model dtype before the norm, as in vLLM's non-speculative decode
    o = o.to(mixed_qkv.dtype).to(dtype)
    out = gated_rms_norm(o, output_gate.to(dtype), norm_weight, norm_eps, activation)
    request = node_requests(cu_nodes, mixed_qkv.shape[0])
    slot = state_indices.long()[request]
    live = slot >= 0
    out = torch.where(live[:, None, None], out, 0.0)
    key_head = torch.arange(num_value_heads, device=k.device) // (num_value_heads // num_key_heads)
    rows = torch.cat([k[:, key_head].flatten(1), k_scale[:, key_head], u.flatten(1), g], 1)
    local = torch.arange(mixed_qkv.shape[0], device=k.device) - cu_nodes.long()[request]
    factors[slot[live], local[live]] = rows[live].to(factors.dtype)
    return out.to(mixed_qkv.dtype)
