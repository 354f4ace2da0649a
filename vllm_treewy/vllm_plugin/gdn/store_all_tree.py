"""The store_all draft tree on vLLM's CPU backend: the baseline reconstruct is compared with.

vLLM's store_all keeps a GDN state and conv window per verified position, in 1 + N blocks per request, and starts
each step from the block of the last accepted position. For a tree the position alone does not say which branch:
each slot's count state (`gdn.step_metadata`, written by the tree sampler) names the accepted node's block. Every
verified node's window and state follow from its parent's (`kernels.serial_tree`) and go to the node's own block.
"""

from __future__ import annotations

import torch

from vllm_treewy.kernels.serial_tree import serial_tree_conv, serial_tree_states
from vllm_treewy.vllm_plugin.gdn.reconstruct import recurrence_inputs


def step_torch(layer, metadata, x, a, b, *, conv_weight, conv_history, ssm_state) -> torch.Tensor:
    """Core attention outputs `[N, HV, V]` (before the gated RMSNorm) of the packed trees `x` (pre-conv qkv `[N,
    conv_dim]`); every node's conv window and SSM state written to its block."""
    blocks, cu_nodes = metadata.spec_state_indices_tensor, metadata.spec_query_start_loc
    # commit_nodes: the previous step's accepted node's block index, -1 for a slot without one (after a prefill,
    # which left the state in block 0)
    start = blocks.long().gather(1, metadata.commit_nodes.long().clamp(min=0)[:, None]).squeeze(1)
    max_nodes = blocks.shape[1]
    activation = "silu" if layer.activation == "silu" else None
    conv_out, windows = serial_tree_conv(x, conv_history[start], conv_weight, layer.conv1d.bias, metadata.parents,
                                         cu_nodes, max_nodes, activation)
    query, k, key_scales, v, g, beta = recurrence_inputs(layer, conv_out, a, b, layer.buffer_layout())
    out, states = serial_tree_states(query, k * key_scales[..., None], v, g, beta, ssm_state[start],
                                     metadata.parents, cu_nodes, max_nodes)
    own = metadata.node_blocks
    conv_history[own] = windows.to(conv_history.dtype)
    ssm_state[own] = states.to(ssm_state.dtype)
    return out.to(x.dtype)
