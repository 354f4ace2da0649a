"""One speculative step of a GDN layer under reconstruct-on-commit: commit the previous step's accepted node, then
verify this step's drafts from the committed state, leaving the factors of their commit in the pseudo-value buffer.

CUDA: `conv_step_triton`, then `gdn_step_triton` (gates, q/k L2 norm, verify, gated RMSNorm with the output gate:
the same inputs and output as vLLM's compiled `fused_gdn_decode_post_conv_mtp`; two launches, the state pass and
an epilogue). CPU: the same
steps in torch (`vllm_treewy.kernels`), un-normed output, as vLLM's CPU GDN op expects.

The drafts are chains or one static tree shape per speculating request (the verified block: root, then the draft nodes).
The step metadata carries `parents` `[N]` (local, packed; the CUDA path reads them for trees only: a chain's kernels
take each node's parent as the node before, so no parents are derived in a chain step) and `ancestors`: None for
chains, else the packed ancestor table `[N, D]` of this step's block
(`vllm_treewy.kernels.ancestor_table_triton.ancestor_table(parents, cu, D)`, D = the tree's depth counted in nodes),
and `commit_ancestors`, which every slot's commit follows, separately from this step's verify: None for chains; the
static tree's verified block `[1 + N, D]`; with `draft_tree_max_batch_size` the table of both shapes
(`gdn.step_metadata.commit_ancestor_table`), since a step may commit the shape the previous step verified while
verifying the other.
"""

from __future__ import annotations

import torch
import triton

from vllm_treewy import kernels as torch_kernels
from vllm_treewy.kernels.conv_step_torch import commit_rows_and_parents, conv_step_packed
from vllm_treewy.kernels.gdn_step_torch import gates, inverse_norm, split_qkv
from vllm_treewy.kernels.conv_step_triton import conv_step_triton
from vllm_treewy.kernels.gdn_step_triton import gdn_step_triton
from vllm_treewy.vllm_plugin.gdn.pseudo_value_buffer import PseudoValueBuffer


def commit_tree(metadata) -> torch.Tensor | None:
    """The table every slot's commit follows (`commit_ancestors`: row a the path of commit node a in the slot's
    rows), None for chains."""
    return metadata.commit_ancestors


def commit_torch(buffer: PseudoValueBuffer, ssm_state: torch.Tensor, state_indices: torch.Tensor,
                 commit_nodes: torch.Tensor, commit_ancestors: torch.Tensor | None = None) -> None:
    """Each slot's previous verify (`state_indices [R]`: each speculative row's state slot), committed at
    `commit_nodes` (-1: nothing) from its buffer rows, in place: along the chain, or along the paths of
    `commit_ancestors` `[T, D]` (`commit_tree`)."""
    keys, key_scales, pseudo_values, log_decays = buffer.slot_factors(state_indices)
    rows = buffer.layout.num_nodes
    cu = torch.arange(state_indices.shape[0] + 1, device=state_indices.device) * rows
    flat = (t.flatten(0, 1) for t in (keys * key_scales[..., None], pseudo_values, log_decays))
    commit_rows, parents = commit_rows_and_parents(rows, commit_nodes, commit_ancestors)
    torch_kernels.commit_packed(ssm_state, state_indices, *flat, parents, cu, commit_rows)


def recurrence_inputs(layer, conv_out, a, b, layout):
    """fp32 (query, raw keys, key inverse norms, values, log decays, write gates) of the conv outputs `[N, conv_dim]`:
    q normalised and scaled, keys to be scaled by their inverse norms, the gates from vLLM's raw a and b."""
    q, k, v = split_qkv(conv_out, layout.num_k_heads, layout.head_k_dim, layout.head_v_dim)
    q, k, v = q.float(), k.float(), v.float()
    g, beta = gates(a, b, layer.A_log, layer.dt_bias)
    query = q * (inverse_norm(q) * layout.head_k_dim**-0.5)[..., None]
    return query, k, inverse_norm(k), v, g, beta


def step_torch(layer, metadata, x, a, b, *, conv_weight, conv_history, ssm_state, buffer) -> torch.Tensor:
    """Core attention outputs `[N, HV, V]` (before the gated RMSNorm) of the packed draft chains or trees `x`
    (pre-conv qkv `[N, conv_dim]`), after committing each slot's previous step."""
    state_indices, cu_nodes = metadata.state_indices, metadata.spec_query_start_loc
    commit_ancestors = commit_tree(metadata)
    commit_torch(buffer, ssm_state, state_indices, metadata.commit_nodes, commit_ancestors)
    activation = "silu" if layer.activation == "silu" else None
    conv_out = conv_step_packed(x, conv_history, state_indices, conv_weight, layer.conv1d.bias, metadata.parents,
                                cu_nodes, buffer.conv_inputs, metadata.commit_nodes, commit_ancestors=commit_ancestors,
                                activation=activation)
    layout = buffer.layout
    query, k, key_scales, v, g, beta = recurrence_inputs(layer, conv_out, a, b, layout)
    out, pseudo_values = torch_kernels.verify_packed(query, k * key_scales[..., None], v, g, beta, ssm_state,
                                                     state_indices, metadata.parents, cu_nodes,
                                                     max_depth=layout.num_nodes)
    buffer.write_factors(metadata.node_slots, metadata.node_indices, k, key_scales, pseudo_values, g)
    return out.to(x.dtype)


def step_triton(layer, metadata, x, a, b, output_gate, out, *, conv_weight, conv_history, ssm_state, buffer) -> None:
    """Writes the normed, gated core outputs of the packed draft chains or trees `x` (pre-conv qkv) into `out`
    `[N, HV, V]`, after committing each slot's previous step. No host sync: capturable in a FULL CUDA graph."""
    state_indices, cu_nodes, commit_nodes = metadata.state_indices, metadata.spec_query_start_loc, metadata.commit_nodes
    layout, ancestors = buffer.layout, metadata.ancestors
    # a tree's parents for the conv's walk; chains none (each node's parent is the node before: nothing derived,
    # nothing captured)
    parents = None if ancestors is None else metadata.parents
    commit_ancestors = commit_tree(metadata)
    max_nodes = metadata.verify_block_len or layout.num_nodes  # a chain step of a tree config: its chain's length
    activation = "silu" if layer.activation == "silu" else None
    # a request's nodes in one block of rows (a chain of 3 drafts: 4, not the default 16, most of which would be
    # masked rows holding registers); larger trees loop over blocks of 16
    conv_out = conv_step_triton(x, conv_history, state_indices, conv_weight, layer.conv1d.bias, parents, cu_nodes,
                                buffer.conv_inputs, commit_nodes, commit_ancestors=commit_ancestors,
                                activation=activation, block_nodes=min(16, triton.next_power_of_2(max_nodes)))
    gdn_step_triton(conv_out, a, b, layer.A_log, layer.dt_bias, output_gate, layer.norm.weight, ssm_state,
                    state_indices, cu_nodes, num_key_heads=layout.num_k_heads, max_nodes=max_nodes,
                    ancestors=ancestors, scale=layout.head_k_dim**-0.5, norm_eps=layer.layer_norm_epsilon,
                    activation=layer.norm.activation, out=out, factors=buffer.factors, commit_nodes=commit_nodes,
                    commit_ancestors=commit_ancestors)
