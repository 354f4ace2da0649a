"""PROTOTYPE: the state pass with its state chunks brought by TMA through Triton's pipeliner."""

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents

from .state_ops import _committed_chunk, _factor_columns, _node_kq_columns, _pending_path, _pending_values, _state_products


@triton.jit(do_not_specialize=["state_indices", "cu_nodes", "pending_nodes", "pending_ancestors"])
def _state_pass_tma_kernel(
    qkv, state, state_desc, state_indices, cu_nodes, factors, pending_nodes, pending_ancestors, products,
    stride_qkv, stride_slot, stride_head, stride_v, stride_fslot, stride_frow,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr, BK: tl.constexpr,
    BT: tl.constexpr, PENDING_ROWS: tl.constexpr, PENDING_IS_CHAIN: tl.constexpr, STATE_PRODUCTS: tl.constexpr,
    LAUNCH_DEPENDENTS: tl.constexpr, STAGES: tl.constexpr, HAS_PENDING: tl.constexpr,
):
    if LAUNCH_DEPENDENTS:
        gdc_launch_dependents()
    i_v, i_hv, i_b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    slot = tl.load(state_indices + i_b).to(tl.int64)
    if HAS_PENDING:
        accepted = tl.load(pending_nodes + i_b, volatile=True)
    bos = tl.load(cu_nodes + i_b, volatile=True)
    n = tl.load(cu_nodes + i_b + 1, volatile=True) - bos
    if slot < 0:
        return
    o_v = i_v * BV + tl.arange(0, BV)
    o_kc = tl.arange(0, BK)
    p_state = state + slot * stride_slot + i_hv * stride_head + o_v[:, None] * stride_v
    if HAS_PENDING:
        f_k, f_kscale, f_u, f_g = _factor_columns(factors, slot, stride_fslot, i_hv, HV, K, V)
        p_rows, p_on, p_weight, p_root = _pending_path(
            accepted, pending_ancestors, f_kscale, f_g, stride_frow, 1, PENDING_ROWS, PENDING_IS_CHAIN)
        p_wu = _pending_values(f_u, p_rows, p_on, p_weight, o_v, V, 1, PENDING_ROWS)
        store_commit = (o_v[:, None] * 0 + accepted) >= 0
    NQ: tl.constexpr = max(16, 2 * BT)
    o_q = tl.arange(0, NQ)
    kq_row, kq_ok = _node_kq_columns(qkv, bos, n, stride_qkv, i_hv // (HV // H), H, K, BT, True)
    acc = tl.zeros([BV, NQ], dtype=tl.float32)
    for i_k in tl.range(0, K // BK, num_stages=STAGES):
        cols = i_k * BK + o_kc
        h = state_desc.load([slot.to(tl.int32), i_hv, i_v * BV, i_k * BK]).reshape([BV, BK]).to(tl.float32)
        kq = tl.load(kq_row[None, :] + cols[:, None], mask=kq_ok[None, :], other=0.0)
        if HAS_PENDING:
            keys = ()
            for d in tl.static_range(PENDING_ROWS):
                keys = keys + (tl.load(f_k + p_rows[d] + cols, mask=p_on[d], other=0.0),)
            h = _committed_chunk(h, p_root[0], p_wu, keys, 0, 1, PENDING_ROWS).to(state.dtype.element_ty)
            tl.store(p_state + cols[None, :], h, mask=store_commit)
        acc = _state_products(h.to(tl.float32), kq.to(tl.float32), acc, STATE_PRODUCTS)
    p_out = products + ((i_b * HV + i_hv) * (2 * BT) + o_q[None, :]).to(tl.int64) * V + o_v[:, None]
    tl.store(p_out, acc, mask=(o_q < 2 * BT)[None, :])
