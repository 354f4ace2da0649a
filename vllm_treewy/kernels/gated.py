"""Torch twin of `vllm_treewy.kernels.triton.gated`: the GDN decode step after the conv (gates, q/k L2 norm,
closed-form verify, gated RMSNorm with the output gate) and its commit, from the inputs vLLM's compiled
`fused_gdn_decode_post_conv_mtp` takes. Built on `closed_form`'s packed verify and commit; fp32 (fp64 for fp64
inputs). Ground truth: `reference.reference_gated_tree`.
"""

from __future__ import annotations

import torch

from .closed_form import commit_packed, compute_dtype, verify_packed

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


def gdn_step_packed(mixed_qkv, a, b, A_log, dt_bias, output_gate, norm_weight, state, state_indices, parents,
                    cu_nodes, *, num_key_heads, scale=None, norm_eps=1e-6, activation="silu", max_depth=None):
    """``(out [N, HV, V] in mixed_qkv's dtype, (k, k_scale, u, g))``; the factors as `GatedFactors` holds them.
    The state pool is only read."""
    _, num_value_heads, value_dim, key_dim = state.shape
    dtype = compute_dtype(mixed_qkv, state)
    q, k, v = split_qkv(mixed_qkv, num_key_heads, key_dim, value_dim)
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    k_scale = inverse_norm(k)
    scale = key_dim**-0.5 if scale is None else scale
    g, beta = gates(a, b, A_log, dt_bias, dtype)
    o, u = verify_packed(q * (inverse_norm(q) * scale)[..., None], k * k_scale[..., None], v, g, beta, state,
                         state_indices, parents, cu_nodes, max_depth=max_depth)
    out = gated_rms_norm(o, output_gate.to(dtype), norm_weight, norm_eps, activation)
    live = (state_indices.long() >= 0).repeat_interleave(cu_nodes.long().diff())
    out = torch.where(live[:, None, None], out, 0.0)
    return out.to(mixed_qkv.dtype), (k, k_scale, u, g)


def gdn_commit_packed(state, state_indices, k, k_scale, u, g, parents, cu_nodes, accepted, *, max_depth=None):
    """Commit from `gdn_step_packed`'s factors (raw keys and their inverse norms), in place."""
    commit_packed(state, state_indices, k.to(u.dtype) * k_scale.to(u.dtype)[..., None], u, g, parents, cu_nodes,
                  accepted, max_depth=max_depth)
