"""Reconstruct-on-commit for one GDN layer: verify a batch's draft chains from the committed state, commit later.

The same code serves both platforms; only the kernels differ (`TORCH_KERNELS`: the closed form, CPU;
`triton_kernels()`: the fused Triton kernels, CUDA). The verify pass reads the committed SSM state and conv
history and writes neither; it stores the per-node factors in the layer's pseudo-value buffer (part of vLLM's
KV cache, see `pseudo_value_buffer`). After rejection sampling, `commit_layer` reads them back and rebuilds each
request's state at its last accepted token, in place.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from vllm_treewy import kernels as torch_kernels
from vllm_treewy.vllm_plugin.pseudo_value_buffer import PseudoValueBuffer

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
    max_nodes: int,
    buffer: PseudoValueBuffer,
    node_slots: torch.Tensor,
    node_indices: torch.Tensor,
) -> torch.Tensor:
    """Core attention outputs `[N, HV, V]` of the packed draft chains `x` (pre-conv qkv, `[N, conv_dim]`).

    conv_history `[S, conv_dim, width-1]` and ssm_state `[S, HV, V, K]` (views into vLLM's caches) are read at
    `slots`, never written. `parents`, `cu_nodes`: the packed chains. The factors for the commit go to `buffer`
    at each node's slot and local index (`node_slots`, `node_indices`), with the pre-conv inputs `x`.
    """
    assert parents.shape[0] == x.shape[0], "the chains' parents must cover every speculative token"
    activation = "silu" if layer.activation == "silu" else None
    conv_out = kernels.conv(x, conv_history, slots, conv_weight, layer.conv1d.bias, parents, cu_nodes, activation)
    query, key, value = (t.squeeze(0) for t in layer.rearrange_mixed_qkv(conv_out))
    query = _l2_normalised(query) * query.shape[-1] ** -0.5
    key = _l2_normalised(key)
    g, beta = gating(layer, a, b)
    out, pseudo_values = kernels.verify(query, key, value, g, beta, ssm_state, slots, parents, cu_nodes, max_nodes)
    buffer.write(node_slots, node_indices, key, pseudo_values, g, x)
    return out


def accepted_nodes(num_accepted_tokens: torch.Tensor, batch_rows: torch.Tensor) -> torch.Tensor:
    """`[B]` local index of each speculative request's last accepted token (node `num_accepted - 1`)."""
    return num_accepted_tokens[batch_rows].to(torch.int32) - 1


def commit_layer(
    kernels: ChainKernels,
    accepted: torch.Tensor,
    *,
    buffer: PseudoValueBuffer,
    conv_history: torch.Tensor,
    ssm_state: torch.Tensor,
    slots: torch.Tensor,
    parents: torch.Tensor,
    cu_nodes: torch.Tensor,
    node_slots: torch.Tensor,
    node_indices: torch.Tensor,
    max_nodes: int,
) -> None:
    """Rebuilds each speculative request's state at its accepted node (`accepted_nodes`), in place, from the
    factors that `verify_chains` stored in `buffer`."""
    keys, pseudo_values, log_decays, conv_inputs = buffer.read(node_slots, node_indices)
    kernels.commit(ssm_state, slots, keys, pseudo_values, log_decays, parents, cu_nodes, accepted, max_nodes)
    kernels.conv_commit(conv_history, slots, conv_inputs, parents, cu_nodes, accepted)
