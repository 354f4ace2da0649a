"""Ground truth: the per-node sequential recurrences over one request's draft tree, in fp64.

Every node is computed from its parent's state (the committed state for parent -1), exactly as a serial
implementation would do it. Slow on purpose; the closed form and the kernels are tested against these.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch


class TreeRecurrence(NamedTuple):
    o: torch.Tensor  # [T, HV, V] outputs
    u: torch.Tensor  # [T, HV, V] pseudo-values beta * (v - alpha * h_parent k)
    state: torch.Tensor  # [T, HV, V, K] every node's state after its token


def reference_tree_recurrence(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    h0: torch.Tensor,
    parents: Sequence[int],
) -> TreeRecurrence:
    """Gated delta rule over a tree, node by node in fp64.

    q, k ``[T, H, K]``, v ``[T, HV, V]``, g (log decay) and beta ``[T, HV]``, h0 ``[HV, V, K]``; value head hv
    reads key head ``hv // (HV // H)``.
    """
    num_value_heads = v.shape[1]
    key_head = torch.arange(num_value_heads) // (num_value_heads // k.shape[1])
    q, k = q.double()[:, key_head], k.double()[:, key_head]
    v, g, beta, h0 = v.double(), g.double(), beta.double(), h0.double()
    num_nodes = len(parents)
    o = torch.empty_like(v)
    u = torch.empty_like(v)
    state = torch.empty((num_nodes, *h0.shape), dtype=torch.float64)
    for i, parent in enumerate(parents):
        h_parent = h0 if parent < 0 else state[parent]
        alpha = torch.exp(g[i])
        u[i] = beta[i, :, None] * (v[i] - alpha[:, None] * torch.einsum("hvk,hk->hv", h_parent, k[i]))
        state[i] = alpha[:, None, None] * h_parent + u[i][:, :, None] * k[i][:, None, :]
        o[i] = torch.einsum("hvk,hk->hv", state[i], q[i])
    return TreeRecurrence(o, u, state)


class TreeConv(NamedTuple):
    out: torch.Tensor  # [T, D] conv output of every node
    history: torch.Tensor  # [T, D, L] conv history after committing each node


def reference_tree_conv(
    x: torch.Tensor,
    history: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    parents: Sequence[int],
    activation: str | None = None,
) -> TreeConv:
    """Causal depthwise conv1d over a tree, node by node in fp64.

    x ``[T, D]``, history ``[D, L]`` (oldest first, L >= w-1), weight ``[D, w]``. A node's window is the last w
    inputs of history followed by its root-to-node path; committing a node keeps the last L of that sequence.
    """
    width = weight.shape[1]
    x, history, weight = x.double(), history.double(), weight.double()
    out = torch.empty_like(x)
    histories = torch.empty((len(parents), *history.shape), dtype=torch.float64)
    for i, parent in enumerate(parents):
        before = history if parent < 0 else histories[parent]
        sequence = torch.cat([before, x[i][:, None]], dim=1)
        out[i] = (sequence[:, -width:] * weight).sum(dim=1)
        if bias is not None:
            out[i] += bias.double()
        histories[i] = sequence[:, 1:]
    if activation == "silu":
        out = torch.nn.functional.silu(out)
    elif activation is not None:
        raise ValueError(f"activation must be None or 'silu', got {activation!r}")
    return TreeConv(out, histories)


class GatedTree(NamedTuple):
    out: torch.Tensor  # [T, HV, V] normed, gated core output
    recurrence: TreeRecurrence  # o, u, every node's state (from the normalised q, k and the gates)
    g: torch.Tensor  # [T, HV] log decays
    beta: torch.Tensor  # [T, HV] write gates


def reference_gates(a, b, A_log, dt_bias):
    """g = -exp(A_log) softplus(a + dt_bias) (threshold 20, as vLLM), beta = sigmoid(b), in fp64."""
    x = a.double() + dt_bias.double()
    softplus = torch.where(x <= 20.0, torch.log1p(torch.exp(x)), x)
    return -torch.exp(A_log.double()) * softplus, torch.sigmoid(b.double())


def reference_gated_norm(o, z, weight, eps, activation="silu"):
    """Gated RMSNorm over the last dim in fp64: o * rsqrt(mean(o^2) + eps) * weight * act(z)."""
    o, z = o.double(), z.double()
    gate = z * torch.sigmoid(z) if activation == "silu" else torch.sigmoid(z)
    return o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + eps) * weight.double() * gate


def reference_gated_tree(
    mixed_qkv: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    z: torch.Tensor,
    norm_weight: torch.Tensor,
    h0: torch.Tensor,
    parents: Sequence[int],
    num_key_heads: int,
    scale: float | None = None,
    eps: float = 1e-6,
    activation: str = "silu",
) -> GatedTree:
    """One request's GDN step after the conv, node by node in fp64, from what vLLM's fused MTP kernel takes:
    mixed_qkv ``[T, 2*H*K + HV*V]``, a, b ``[T, HV]``, A_log, dt_bias ``[HV]``, z ``[T, HV, V]``, norm_weight
    ``[V]``, h0 ``[HV, V, K]``. q, k get vLLM's in-kernel L2 norm (``x / sqrt(|x|^2 + 1e-6)``), q the scale."""
    num_nodes = mixed_qkv.shape[0]
    num_value_heads, value_dim, key_dim = h0.shape
    x = mixed_qkv.double()
    q = x[:, : num_key_heads * key_dim].reshape(num_nodes, num_key_heads, key_dim)
    k = x[:, num_key_heads * key_dim: 2 * num_key_heads * key_dim].reshape(num_nodes, num_key_heads, key_dim)
    v = x[:, 2 * num_key_heads * key_dim:].reshape(num_nodes, num_value_heads, value_dim)
    q = q / torch.sqrt(q.pow(2).sum(-1, keepdim=True) + 1e-6) * (key_dim**-0.5 if scale is None else scale)
    k = k / torch.sqrt(k.pow(2).sum(-1, keepdim=True) + 1e-6)
    g, beta = reference_gates(a, b, A_log, dt_bias)
    recurrence = reference_tree_recurrence(q, k, v, g, beta, h0, parents)
    out = reference_gated_norm(recurrence.o, z, norm_weight, eps, activation)
    return GatedTree(out, recurrence, g, beta)
