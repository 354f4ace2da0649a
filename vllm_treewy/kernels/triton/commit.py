"""Commit: rebuild each request's accepted-node state in place in its slot, from h0 and the accepted path's
factors (k, u, g), for one GDN layer or for all layers in one launch:

    h_a = exp(c_a) h0 + sum_{j on path(a)} exp(c_a - c_j) u_j k_j^T

Torch twin: `vllm_treewy.kernels.closed_form.commit_packed` (same packed API).
"""

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from ._tree import path_factors, rebuild_chunk
from .verify import (
    block_nodes,
    default_precision,
    launch_config,
    max_ancestors,
    measured_config,
    tree_ancestors,
)

# (block_v, block_k, num_warps, max_registers) measured fastest on the H200 (see VERIFY_CONFIGS), keyed by fp32 state
COMMIT_CONFIGS = {False: (128, 64, 4, 128), True: (64, 64, 4, None)}
# narrow tiles measured faster at B=8, slower at B=16: up to their geometric midpoint (see SMALL_BATCH_VERIFY_CONFIGS)
SMALL_BATCH_COMMIT_CONFIGS = {False: (11, (16, 128, 4, None))}
_TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


@triton.jit
def _commit_kernel(
    state, state_indices, k, u, g, ancestors, cu_nodes, accepted,
    stride_slot, stride_head, stride_v, stride_layer_k, stride_layer_u, stride_layer_g,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BP: tl.constexpr, BV: tl.constexpr, BK: tl.constexpr, MAX_ANC: tl.constexpr, IS_CHAIN: tl.constexpr,
    PRECISION: tl.constexpr, STATE_TABLE_DTYPE: tl.constexpr,
):
    i_v, i_bh, i_layer = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_b, i_hv = i_bh // HV, i_bh % HV
    i_h = i_hv // (HV // H)
    node = tl.load(accepted + i_b)
    slot = tl.load(state_indices + i_b).to(tl.int64)
    if (node < 0) | (slot < 0):
        return
    if STATE_TABLE_DTYPE is not None:
        # `state` is a table of per-layer pool addresses (pools share shape, strides and dtype)
        state = tl.load(state + i_layer).to(tl.pointer_type(STATE_TABLE_DTYPE))
    bos = tl.load(cu_nodes + i_b)
    o_v = i_v * BV + tl.arange(0, BV)
    k = k + i_layer * stride_layer_k
    k_rows, on_path, weighted_u, root_weight = path_factors(
        k, u + i_layer * stride_layer_u, g + i_layer * stride_layer_g, ancestors, bos, node, i_h, i_hv, o_v,
        H, HV, K, V, BP, MAX_ANC, IS_CHAIN)
    p_state = state + slot * stride_slot + i_hv * stride_head + o_v[:, None] * stride_v
    for i_k in tl.static_range(K // BK):
        o_k = i_k * BK + tl.arange(0, BK)
        h0 = tl.load(p_state + o_k[None, :]).to(tl.float32)
        h = rebuild_chunk(h0, k, k_rows, on_path, weighted_u, root_weight, o_k, PRECISION)
        tl.store(p_state + o_k[None, :], h.to(state.dtype.element_ty))


def state_pool_table(pools: Sequence[torch.Tensor]) -> torch.Tensor:
    """Addresses of per-layer state pools for `commit_layers_triton`; build it once (pools are long-lived)."""
    first = pools[0]
    assert all(p.shape == first.shape and p.stride() == first.stride() and p.dtype == first.dtype for p in pools)
    return torch.tensor([p.data_ptr() for p in pools], dtype=torch.int64, device=first.device)


def _launch(state, table_dtype, state_indices, k, u, g, parents, cu_nodes, accepted, n_layers, pool,
            max_nodes, max_depth, chain, ancestors, precision, block_v, block_k, num_warps, max_registers):
    H, K = k.shape[-2], k.shape[-1]
    HV, V = u.shape[-2], u.shape[-1]
    measured = measured_config(COMMIT_CONFIGS, SMALL_BATCH_COMMIT_CONFIGS, pool.dtype == torch.float32,
                               state_indices.shape[0])
    block_v, block_k, options = launch_config(measured, V, K, block_v, block_k, num_warps, max_registers)
    assert HV % H == 0 and V % block_v == 0 and K % block_k == 0 and pool.stride(-1) == 1
    max_anc = max_ancestors(max_nodes, max_depth, chain)
    ancestors = tree_ancestors(parents, cu_nodes, max_anc, chain, ancestors)
    layer_strides = (k.stride(0), u.stride(0), g.stride(0)) if k.dim() == 4 else (0, 0, 0)
    _commit_kernel[(V // block_v, state_indices.shape[0] * HV, n_layers)](
        state, state_indices, k, u, g, ancestors, cu_nodes, accepted,
        pool.stride(0), pool.stride(1), pool.stride(2), *layer_strides,
        H=H, HV=HV, K=K, V=V, BP=block_nodes(max_anc + 1), BV=block_v, BK=block_k,
        MAX_ANC=max_anc, IS_CHAIN=chain, PRECISION=precision or default_precision(pool.dtype),
        STATE_TABLE_DTYPE=table_dtype, **options,
    )


def commit_packed_triton(
    state: torch.Tensor,
    state_indices: torch.Tensor,
    k: torch.Tensor,
    u: torch.Tensor,
    g: torch.Tensor,
    parents: torch.Tensor,
    cu_nodes: torch.Tensor,
    accepted: torch.Tensor,
    *,
    max_nodes: int,
    max_depth: int | None = None,
    chain: bool = False,
    ancestors: torch.Tensor | None = None,
    precision: str | None = None,
    block_v: int | None = None,
    block_k: int | None = None,
    num_warps: int | None = None,
    max_registers: int | None = None,
) -> None:
    """Write each request's accepted-node state into its slot of `state` [S, HV, V, K], in place.
    k [N, H, K]; u [N, HV, V] fp32 from `verify_packed_triton`; g [N, HV]; accepted [B] local node index (-1, or a
    negative slot: leave the slot unchanged); bounds and `ancestors` as in `verify_packed_triton`. Capturable in a
    CUDA graph."""
    _launch(state, None, state_indices, k, u, g, parents, cu_nodes, accepted, 1, state,
            max_nodes, max_depth, chain, ancestors, precision, block_v, block_k, num_warps, max_registers)


def commit_layers_triton(
    states: Sequence[torch.Tensor] | torch.Tensor,
    state_indices: torch.Tensor,
    k: torch.Tensor,
    u: torch.Tensor,
    g: torch.Tensor,
    parents: torch.Tensor,
    cu_nodes: torch.Tensor,
    accepted: torch.Tensor,
    *,
    max_nodes: int,
    max_depth: int | None = None,
    chain: bool = False,
    ancestors: torch.Tensor | None = None,
    precision: str | None = None,
    block_v: int | None = None,
    block_k: int | None = None,
    num_warps: int | None = None,
    max_registers: int | None = None,
    pool_like: torch.Tensor | None = None,
) -> None:
    """Commit all L GDN layers in one launch. `states`: the L per-layer pools [S, HV, V, K] (same shape, strides,
    dtype), or their `state_pool_table` plus `pool_like` (any one pool), which keeps the call capturable;
    k [L, N, H, K], u [L, N, HV, V], g [L, N, HV]. Tree, slots and accepted nodes are shared by the layers."""
    if isinstance(states, torch.Tensor):
        assert pool_like is not None, "a pool table needs pool_like for dtype and strides"
        table = states
    else:
        assert pool_like is None, "pool_like goes with a pool table; a list of pools brings its own"
        pool_like = states[0]
        table = state_pool_table(states)
    _launch(table, _TL_DTYPES[pool_like.dtype], state_indices, k, u, g, parents, cu_nodes, accepted, k.shape[0],
            pool_like, max_nodes, max_depth, chain, ancestors, precision, block_v, block_k, num_warps, max_registers)
