"""The fused GDN step's state pass on its own: per request and value head, the previous step's pending commit applied
to the state in place and the committed state's products with this step's raw keys and queries, one program per
BV value rows of a head. With no per-node work left in it (gates, norms, the solve and the gated RMSNorm run after
it, `row_epilogue`), a program holds a few registers and a state tile: many programs per SM keep the state stream
in flight, where the one-kernel step waits on its epilogue (kernels.md: latency-bound at ~2x the two-state HBM
bound).

    h_a       = exp(c_a) h0 + sum_{j on path(a)} exp(c_a - c_j) (u_j / |k_j|) k_raw_j^T    (as `gdn_commit_triton`)
    products  = [h_a k_raw_t, h_a q_raw_t]_t  ->  products[b, hv, :2 BT, v] fp32, fp32-accurate (`_state_products`)

The products' columns are interleaved as the one-kernel step's accumulator columns (k_t at 2t, q_t at 2t + 1) and
stored node-major. Without the products (`DO_PRODUCTS` off) it is the commit alone. LAUNCH_DEPENDENTS: the row
epilogue is this launch's programmatic dependent (Hopper), allowed to start once every program here has."""

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents

from .state_ops import (_committed_chunk, _factor_columns, _node_kq_columns, _pending_path, _pending_values,
                        _request_indices, _state_products)


# integer arrays read as scalars or gathers, not specialised on alignment (as `_gated_step_kernel`)
@triton.jit(do_not_specialize=["state_indices", "cu_nodes", "pending_nodes", "pending_ancestors"])
def _state_pass_kernel(
    qkv, state, state_indices, cu_nodes, factors, pending_nodes, pending_ancestors, products,
    stride_qkv, stride_slot, stride_head, stride_v, stride_fslot, stride_frow,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr, BK: tl.constexpr,
    BT: tl.constexpr, DO_PRODUCTS: tl.constexpr, HAS_PENDING: tl.constexpr, PENDING_ROWS: tl.constexpr,
    PENDING_IS_CHAIN: tl.constexpr, STATE_PRODUCTS: tl.constexpr, LAUNCH_DEPENDENTS: tl.constexpr,
):
    if LAUNCH_DEPENDENTS:
        gdc_launch_dependents()
    i_v, i_hv, i_b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    # the factor rows, the state and the q/k columns then wait on one level of loads (ncu, 2026-12-02e: the accepted
    # node waited on the slot's check)
    slot, accepted, bos, n = _request_indices(state_indices, pending_nodes, cu_nodes, i_b, HAS_PENDING, DO_PRODUCTS)
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
        store_commit = (o_v[:, None] * 0 + accepted) >= 0  # as a tile: a scalar mask does not broadcast everywhere
    if DO_PRODUCTS:
        # the fused step's interleaved accumulator columns: k_t at 2t, q_t at 2t + 1, zeros up to 16
        NQ: tl.constexpr = max(16, 2 * BT)
        o_q = tl.arange(0, NQ)
        kq_row, kq_ok = _node_kq_columns(qkv, bos, n, stride_qkv, i_hv // (HV // H), H, K, BT, True)
        acc = tl.zeros([BV, NQ], dtype=tl.float32)
    for i_k in tl.static_range(K // BK):
        cols = i_k * BK + o_kc
        h = tl.load(p_state + cols[None, :]).to(tl.float32)
        if DO_PRODUCTS:  # before the commit's store: a load after a store is issued after it (ncu, 2026-12-02e)
            kq = tl.load(kq_row[None, :] + cols[:, None], mask=kq_ok[None, :], other=0.0)
        if HAS_PENDING:
            keys = ()
            for d in tl.static_range(PENDING_ROWS):
                keys = keys + (tl.load(f_k + p_rows[d] + cols, mask=p_on[d], other=0.0),)
            h = _committed_chunk(h, p_root[0], p_wu, keys, 0, 1, PENDING_ROWS).to(state.dtype.element_ty)
            tl.store(p_state + cols[None, :], h, mask=store_commit)
            h = h.to(tl.float32)
        if DO_PRODUCTS:
            acc = _state_products(h, kq.to(tl.float32), acc, STATE_PRODUCTS)
    if DO_PRODUCTS:  # node-major: each column's V values side by side, for the row epilogue's vector loads
        p_out = products + ((i_b * HV + i_hv) * (2 * BT) + o_q[None, :]).to(tl.int64) * V + o_v[:, None]
        tl.store(p_out, acc, mask=(o_q < 2 * BT)[None, :])
