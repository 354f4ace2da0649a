"""TreeWY kernels: the gated delta rule and its causal conv over draft trees, verified in one solve, committed on
demand.

Public API, for one request (CPU tensors of any float dtype)::

    o, u = tree_verify(q, k, v, g, beta, h0, parents)
    h_node = tree_commit(h0, k, u, g, beta, parents, node)

- q, k ``[T, H, K]``: as the recurrence consumes them (L2-normalised; q scaled by K**-0.5).
- v ``[T, HV, V]``; value head hv reads key head ``hv // (HV // H)`` (GQA).
- g ``[T, HV]``: log decay (<= 0, alpha = exp(g)); beta ``[T, HV]``: write gate in (0, 1).
- h0 ``[HV, V, K]``: the committed state in vLLM's GPU layout (``h0[hv, v_idx, k_idx]``); never written.
- parents: length-T integer sequence, ``parents[i]`` < i, -1 for children of the committed state.
- o ``[T, HV, V]`` in v's dtype; u ``[T, HV, V]`` pseudo-values ``beta * (v - alpha * h_parent k)`` in fp32
  (fp64 for fp64 inputs); h_node ``[HV, V, K]`` in h0's dtype: the state after node ``node`` (-1 returns h0).

The recurrence per node, from its parent's state (h0 for parent -1)::

    u_i = beta_i * (v_i - alpha_i * h_parent k_i);  h_i = alpha_i * h_parent + u_i k_i^T;  o_i = h_i q_i

Batched versions over packed trees (``vllm_treewy.tree.pack_trees``: ``parents`` local per request,
``cu_nodes`` offsets) act on state pools with per-request slots; a negative slot marks a padding request:
``verify_packed``/``commit_packed`` (gated delta rule, ``closed_form``) and ``conv_verify_packed``/
``conv_commit_packed`` (causal depthwise conv1d, ``conv_step_torch``). The fp64 per-node ground truth is in
``reference``; its batched fp32 twin, which keeps every node's state and conv window (the store_all tree baseline),
in ``serial_tree``.

The whole decode step after the conv, from vLLM's raw inputs (mixed_qkv, a, b, A_log, dt_bias, output gate, norm
weight) to the normed, gated core output, with the previous step's commit fused in and the commit's factors in
the slots' rows (``factor_rows``): ``gdn_step_torch.gdn_step_packed`` / ``gdn_commit_packed`` (torch) and
``gdn_step_triton.gdn_step_triton`` / ``gdn_commit_triton`` (CUDA); fp64 truth ``reference.reference_gated_tree``.

Modules: a kernel with a Triton implementation is a pair, ``X_torch`` (the torch twin: the CPU path and the
specification; imports no Triton module) beside ``X_triton`` (CUDA; CPU through TRITON_INTERPRET=1; imported only
where used): ``gdn_step`` (its Triton side a package: ``step`` and the kernels of its launches), ``conv_step``,
``ancestor_table``, ``tree_attention_ancestors`` (two-pass tree attention's ancestor pass, the merge with the prefix
pass folded in), ``tree_acceptance`` (a tree step's walk and output rows on the runner's logits layout),
``paged_kv_compaction`` (the accepted path's K/V in a paged cache), ``level_inputs`` (an MTP drafting level's
inputs), ``accepted_chains`` (the MTP drafter's first-pass inputs with accepted paths laid out as chains; both copy
rows with ``row_copy_triton``), ``top_children`` (a drafting level's top-width token ids a logits row, split over the
vocab), and the runner's bookkeeping in ``bookkeeping`` (``slot_counts``, ``boundary_states``; its ``dispatch`` picks
the path). Torch only:
``closed_form``, ``reference``, ``serial_tree``. ``factor_rows`` owns the slots' factor-row layout for both sides.
Chains versus trees: every kernel takes a draft's topology as tensors, and an ancestor table argument that is None
(``ancestors``, ``commit_ancestors``) means chains.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .closed_form import commit_packed, path_log_decay, verify_packed
from .conv_step_torch import conv_commit_packed, conv_verify_packed
from .factor_rows import slot_factor_width, split_slot_factors
from .gdn_step_torch import gdn_commit_packed, gdn_step_packed
from ..tree import DraftTree

__all__ = [
    "commit_packed",
    "conv_commit_packed",
    "conv_verify_packed",
    "gdn_commit_packed",
    "gdn_step_packed",
    "path_log_decay",
    "slot_factor_width",
    "split_slot_factors",
    "tree_commit",
    "tree_verify",
    "verify_packed",
]


def _single_request(tree: DraftTree, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(state_indices, parents, cu_nodes) of a batch holding one request in slot 0."""
    return (
        torch.zeros(1, dtype=torch.int32, device=device),
        torch.tensor(tree.parents, dtype=torch.int32, device=device),
        torch.tensor([0, tree.num_nodes], dtype=torch.int32, device=device),
    )


def _tree_of(parents: Sequence[int], num_nodes: int) -> DraftTree:
    tree = DraftTree(tuple(parents))
    if tree.num_nodes != num_nodes:
        raise ValueError(f"parents has {tree.num_nodes} entries but the inputs have T={num_nodes} nodes")
    return tree


def tree_verify(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    h0: torch.Tensor,
    parents: Sequence[int],
    *,
    solve: str = "substitution",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Outputs and pseudo-values of every draft node, ``(o, u)``, each ``[T, HV, V]``; h0 is only read.

    ``solve``: "substitution" (forward substitution) or "neumann" (depth-bounded Neumann series); same result.
    """
    tree = _tree_of(parents, q.shape[0])
    if h0.dim() != 3:
        raise ValueError(f"h0 must be [HV, V, K], got {tuple(h0.shape)}")
    state_indices, parents_t, cu_nodes = _single_request(tree, q.device)
    return verify_packed(
        q, k, v, g, beta, h0.unsqueeze(0), state_indices, parents_t, cu_nodes, solve=solve, max_depth=tree.max_depth
    )


def tree_commit(
    h0: torch.Tensor,
    k: torch.Tensor,
    u: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    parents: Sequence[int],
    node: int,
) -> torch.Tensor:
    """State ``[HV, V, K]`` after draft node ``node`` (-1: h0 itself), rebuilt from h0 and the path's (k, u, g).

    ``beta`` is accepted for symmetry with ``tree_verify``; u already carries the write gate.
    """
    tree = _tree_of(parents, k.shape[0])
    if not -1 <= node < tree.num_nodes:
        raise ValueError(f"node = {node} is outside [-1, {tree.num_nodes})")
    if g.shape != u.shape[:2] or beta.shape != u.shape[:2]:
        raise ValueError(
            f"g and beta must be [T, HV] = {tuple(u.shape[:2])}, got {tuple(g.shape)}, {tuple(beta.shape)}")
    if h0.shape != (u.shape[1], u.shape[2], k.shape[2]):
        raise ValueError(f"h0 must be [HV, V, K] = {(u.shape[1], u.shape[2], k.shape[2])}, got {tuple(h0.shape)}")
    state_indices, parents_t, cu_nodes = _single_request(tree, h0.device)
    pool = h0.clone().unsqueeze(0)
    commit_packed(
        pool, state_indices, k, u, g, parents_t, cu_nodes,
        torch.tensor([node], device=h0.device), max_depth=tree.max_depth,
    )
    return pool[0]
