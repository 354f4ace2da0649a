"""Reconstruct-on-commit for vLLM's CPU GDN path (torch closed form).

vLLM's CPU GDN op looks its speculative half up as the module global `_spec_forward` at call time; under
reconstruct we answer it with `reconstruct_spec_forward`, which verifies every draft from the committed state
(column 0 of `spec_state_indices`, the only block) and writes no state. The commit (`commit_layer`) runs after
rejection sampling and rebuilds the accepted node's SSM state and conv history in place.

Layouts: vLLM's CPU kernels keep the SSM state as `[HV, K, V]` (fp32) and the conv state as `(dim, width-1+k)`;
the closed form works on `[HV, V, K]`, so it gets a transposed view and writes through it. The conv history
lives in the first `width-1` columns, where vLLM's own prefill and decode paths read and write it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import vllm.model_executor.layers.mamba.ops.cpu.gdn_attention as cpu_gdn

from vllm_treewy.kernels import commit_packed, conv_commit_packed, conv_verify_packed, verify_packed
from vllm_treewy.tree import node_requests
from vllm_treewy.vllm_plugin.gdn_layer import PendingCommit, ReconstructGatedDeltaNetAttention

L2NORM_EPS = 1e-6  # as vLLM's fused GDN kernels (use_qk_l2norm_in_kernel)


def chain_parents(cu_nodes: torch.Tensor) -> torch.Tensor:
    """Local parents of packed chains: -1, 0, 1, ... within every request."""
    nodes = torch.arange(int(cu_nodes[-1]), device=cu_nodes.device)
    return (nodes - cu_nodes.long()[node_requests(cu_nodes)] - 1).to(torch.int32)


def gating(layer, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Log decay g = -exp(A_log) * softplus(a + dt_bias) and write gate beta = sigmoid(b), fp32 `[N, HV]`."""
    g = -layer.A_log.float().exp() * F.softplus(a.float() + layer.dt_bias.float())
    return g, torch.sigmoid(b.float())


def _l2_normalised(x: torch.Tensor) -> torch.Tensor:
    x = x.float()
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + L2NORM_EPS)


def _ssm_state(layer) -> torch.Tensor:
    """The SSM state pool as `[S, HV, V, K]` (a view of vLLM's CPU `[S, HV, K, V]`)."""
    return cpu_gdn._ssm_state_view(layer).transpose(-1, -2)


def _conv_history(conv_buf: torch.Tensor, width: int) -> torch.Tensor:
    return conv_buf[:, :, : width - 1]


def reconstruct_spec_forward(
    layer, metadata, mixed_qkv_spec, b_spec, a_spec, conv_buf, ssm_state, width, state_len
) -> torch.Tensor:
    """Outputs `[N, HV, V]` of the batch's draft chains; keeps their factors on the layer for the commit."""
    num_spec = metadata.num_spec_decodes
    cu_nodes = metadata.spec_query_start_loc[: num_spec + 1]
    slots = metadata.spec_state_indices_tensor[:num_spec, 0]
    parents = chain_parents(cu_nodes)
    conv_weight = cpu_gdn._unpacked_conv_weight(layer)  # (dim, width); AMX packs layer.conv1d.weight in place

    conv_out = conv_verify_packed(
        mixed_qkv_spec, _conv_history(conv_buf, width), slots, conv_weight, layer.conv1d.bias,
        parents, cu_nodes, activation="silu" if layer.activation == "silu" else None,
    )
    query, key, value = (t.squeeze(0) for t in layer.rearrange_mixed_qkv(conv_out))
    query = _l2_normalised(query) * query.shape[-1] ** -0.5
    key = _l2_normalised(key)
    g, beta = gating(layer, a_spec, b_spec)
    out, pseudo_values = verify_packed(query, key, value, g, beta, _ssm_state(layer), slots, parents, cu_nodes)

    masks = metadata.spec_sequence_masks
    batch_rows = masks.nonzero().squeeze(1)[:num_spec] if masks is not None else torch.arange(num_spec)
    layer.pending_commit = PendingCommit(
        batch_rows=batch_rows, slots=slots, parents=parents, cu_nodes=cu_nodes, conv_inputs=mixed_qkv_spec,
        keys=key, pseudo_values=pseudo_values, log_decays=g,
    )
    return out


def commit_layer(layer, num_accepted_tokens: torch.Tensor) -> None:
    """Rebuilds each speculative request's state at its last accepted token (node num_accepted - 1)."""
    pending = layer.pending_commit
    if pending is None:
        return
    layer.pending_commit = None
    accepted = num_accepted_tokens[pending.batch_rows].long() - 1
    commit_packed(
        _ssm_state(layer), pending.slots, pending.keys, pending.pseudo_values, pending.log_decays,
        pending.parents, pending.cu_nodes, accepted,
    )
    width = layer.conv1d.weight.shape[-1]
    conv_commit_packed(
        _conv_history(cpu_gdn._conv_buffer_view(layer), width), pending.slots, pending.conv_inputs,
        pending.parents, pending.cu_nodes, accepted,
    )


def _dispatching(original_spec_aware, original_spec_forward):
    def spec_aware(layer, metadata, *args, **kwargs):
        if getattr(layer, "reconstructs_state", False):
            layer.pending_commit = None  # factors of an earlier pass that was never sampled (warm-up runs)
        return original_spec_aware(layer, metadata, *args, **kwargs)

    def spec_forward(layer, *args, **kwargs):
        if getattr(layer, "reconstructs_state", False):
            return reconstruct_spec_forward(layer, *args, **kwargs)
        return original_spec_forward(layer, *args, **kwargs)

    return spec_aware, spec_forward


def install() -> None:
    if getattr(cpu_gdn._spec_forward, "__module__", None) == __name__:
        return
    cpu_gdn._cpu_gdn_attention_spec_aware, cpu_gdn._spec_forward = _dispatching(
        cpu_gdn._cpu_gdn_attention_spec_aware, cpu_gdn._spec_forward
    )


__all__ = ["ReconstructGatedDeltaNetAttention", "commit_layer", "install", "reconstruct_spec_forward"]
