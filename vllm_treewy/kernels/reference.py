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
