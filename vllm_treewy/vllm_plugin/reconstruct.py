"""Reconstruct-on-commit for one GDN layer: verify a batch's draft chains from the committed state, commit later.

The same code serves both platforms; only the kernels differ (`TORCH_KERNELS`: the closed form, CPU;
`triton_kernels()`: the fused Triton kernels, CUDA). The verify pass reads the committed SSM state and conv
history and writes neither; it leaves the per-node factors on the layer (`PendingCommit`). After rejection
sampling, `commit_layer` rebuilds each request's state at its last accepted token, in place.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from vllm_treewy import kernels as torch_kernels

L2NORM_EPS = 1e-6  # as vLLM's fused GDN kernels (use_qk_l2norm_in_kernel)


@dataclass(frozen=True)
class ChainKernels:
    """verify(q, k, v, g, beta, state, slots, parents, cu_nodes, max_nodes) -> (o, u); commit(state, slots, k, u,
    g, parents, cu_nodes, accepted, max_nodes); conv(x, history, slots, weight, bias, parents, cu_nodes,
    activation); conv_commit(history, slots, x, parents, cu_nodes, accepted)."""

    verify: Callable
    commit: Callable
    conv: Callable
    conv_commit: Callable


TORCH_KERNELS = ChainKernels(
    verify=lambda q, k, v, g, beta, state, slots, parents, cu, max_nodes: torch_kernels.verify_packed(
        q, k, v, g, beta, state, slots, parents, cu, max_depth=max_nodes),
    commit=lambda state, slots, k, u, g, parents, cu, accepted, max_nodes: torch_kernels.commit_packed(
        state, slots, k, u, g, parents, cu, accepted, max_depth=max_nodes),
    conv=lambda x, history, slots, weight, bias, parents, cu, activation: torch_kernels.conv_verify_packed(
        x, history, slots, weight, bias, parents, cu, activation=activation),
    conv_commit=torch_kernels.conv_commit_packed,
)


def triton_kernels() -> ChainKernels:
    from vllm_treewy.kernels import triton as tk

    return ChainKernels(
        verify=lambda q, k, v, g, beta, state, slots, parents, cu, max_nodes: tk.verify_packed_triton(
            q, k, v, g, beta, state, slots, parents, cu, max_nodes=max_nodes, chain=True),
        commit=lambda state, slots, k, u, g, parents, cu, accepted, max_nodes: tk.commit_packed_triton(
            state, slots, k, u, g, parents, cu, accepted, max_nodes=max_nodes, chain=True),
        conv=lambda x, history, slots, weight, bias, parents, cu, activation: tk.tree_conv_triton(
            x, history, slots, weight, bias, parents, cu, activation=activation),
        conv_commit=tk.conv_commit_triton,
    )


@dataclass
class PendingCommit:
    """What a layer's verify pass leaves for the commit: per draft node its factors, per request its slot.

    Requests are the batch's speculative decodes, in the order of `batch_rows` (their rows in the runner's
    input batch, where the number of accepted tokens is read after rejection sampling).
    """

    batch_rows: torch.Tensor  # [B] int64
    slots: torch.Tensor  # [B] state slot of each request
    parents: torch.Tensor  # [N] local parent index, -1 = child of the committed state
    cu_nodes: torch.Tensor  # [B + 1]
    max_nodes: int  # bound on nodes per request (1 + num_speculative_tokens)
    conv_inputs: torch.Tensor  # [N, conv_dim] pre-conv inputs: the conv history continues with them
    keys: torch.Tensor  # [N, H, K] as the recurrence consumed them
    pseudo_values: torch.Tensor  # [N, HV, V] u = beta * (v - alpha * h_parent k)
    log_decays: torch.Tensor  # [N, HV] g


def gating(layer, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Log decay g = -exp(A_log) * softplus(a + dt_bias) and write gate beta = sigmoid(b), fp32 `[N, HV]`."""
    g = -layer.A_log.float().exp() * F.softplus(a.float() + layer.dt_bias.float())
    return g, torch.sigmoid(b.float())


def _l2_normalised(x: torch.Tensor) -> torch.Tensor:
    x = x.float()
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + L2NORM_EPS)


def verify_chains(
    layer,
    kernels: ChainKernels,
    x: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    *,
    conv_weight: torch.Tensor,
    conv_history: torch.Tensor,
    ssm_state: torch.Tensor,
    slots: torch.Tensor,
    parents: torch.Tensor,
    cu_nodes: torch.Tensor,
    batch_rows: torch.Tensor,
    max_nodes: int,
) -> torch.Tensor:
    """Core attention outputs `[N, HV, V]` of the packed draft chains `x` (pre-conv qkv, `[N, conv_dim]`).

    conv_history `[S, conv_dim, width-1]` and ssm_state `[S, HV, V, K]` (views into vLLM's caches) are read at
    `slots`, never written. `parents`, `cu_nodes`: the packed chains. The factors for the commit are left in
    `layer.pending_commit`.
    """
    assert parents.shape[0] == x.shape[0], "the chains' parents must cover every speculative token"
    activation = "silu" if layer.activation == "silu" else None
    conv_out = kernels.conv(x, conv_history, slots, conv_weight, layer.conv1d.bias, parents, cu_nodes, activation)
    query, key, value = (t.squeeze(0) for t in layer.rearrange_mixed_qkv(conv_out))
    query = _l2_normalised(query) * query.shape[-1] ** -0.5
    key = _l2_normalised(key)
    g, beta = gating(layer, a, b)
    out, pseudo_values = kernels.verify(query, key, value, g, beta, ssm_state, slots, parents, cu_nodes, max_nodes)
    layer.pending_commit = PendingCommit(
        batch_rows=batch_rows, slots=slots, parents=parents, cu_nodes=cu_nodes, max_nodes=max_nodes,
        conv_inputs=x, keys=key, pseudo_values=pseudo_values, log_decays=g,
    )
    return out


def accepted_nodes(num_accepted_tokens: torch.Tensor, pending: PendingCommit) -> torch.Tensor:
    """`[B]` local index of each speculative request's last accepted token (node `num_accepted - 1`)."""
    return num_accepted_tokens[pending.batch_rows].to(pending.slots.dtype) - 1


def commit_layer(
    layer, kernels: ChainKernels, accepted: torch.Tensor, *, conv_history: torch.Tensor, ssm_state: torch.Tensor,
) -> None:
    """Rebuilds each speculative request's state at its accepted node (`accepted_nodes`), in place."""
    pending = layer.pending_commit
    if pending is None:
        return
    layer.pending_commit = None
    kernels.commit(ssm_state, pending.slots, pending.keys, pending.pseudo_values, pending.log_decays,
                   pending.parents, pending.cu_nodes, accepted, pending.max_nodes)
    kernels.conv_commit(conv_history, pending.slots, pending.conv_inputs, pending.parents, pending.cu_nodes, accepted)
