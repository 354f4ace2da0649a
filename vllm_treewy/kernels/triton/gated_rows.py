"""The fused GDN step of `gated` with the state streamed in chunks of value ROWS instead of key columns (launch option
`state_row_chunk`): same inputs, outputs, factor rows and pending commit as `_gated_step_kernel`, one value head per
program.

Why rows. With key-column chunks every product h k_t, h q_t is complete only after the last chunk, so a program
loads its whole head and only then runs the epilogue (solve, output, norm, factor stores) with no load in flight: on
the H200 two CTAs per SM are all the overlap there is (fp32 T=4 at 2.1x the two-state HBM bound, 2026-12-01e). A
chunk of BV value rows holds whole rows of the state, and everything per row is row-local: the pending commit
(h_v <- exp(c_a) h_v + sum_j w_j u_j[v] k_j), the products with the K-long q/k rows ([BV, K] @ [K, 2T] on the
tensor cores, as tiles of BK columns), the solve (u = r T^T, T the per-head [BT, BT] inverse) and the core output.
So each chunk is finished while the next tiles (PREFETCH ahead, across chunk ends) are in flight, and the per-head
terms (gates, q/k norms, Gram matrices, the inverse) are computed once, while the first tiles arrive. A whole [K, 16]
q/k operand would cost every warp 64 registers (it needs all of K for its outputs): the tiles keep it at BK x 16.
Only the gated RMSNorm spans all V rows: the rounded core outputs of the chunks stay in registers ([V, BT] in all: a
few per thread) and are normed after the last chunk. vLLM's compiled MTP kernel streams its state in row chunks
too (32 rows through shared memory); this is the closed form's version of that order.

Torch twin and fp64 reference: those of `gated` (`vllm_treewy.kernels.gated.gdn_step_packed`,
`vllm_treewy.kernels.reference.reference_gated_tree`).
"""

import triton
import triton.language as tl

from .gated import (_factor_columns, _in_accumulator_layout, _node_columns, _node_terms, _output_gate,
                    _pending_path, _state_products)


# integer arrays unspecialised, strides specialised: as `_gated_step_kernel` (see there)
@triton.jit(do_not_specialize=["state_indices", "ancestors", "cu_nodes", "pending_nodes", "pending_ancestors"])
def _gated_rows_kernel(
    qkv, a, b, A_log, dt_bias, z, norm_weight, state, state_desc, state_indices, ancestors, cu_nodes, out, factors,
    pending_nodes, pending_ancestors,
    stride_qkv, stride_a, stride_b, stride_z, stride_zh, stride_out, stride_outh,
    stride_slot, stride_head, stride_v, stride_fslot, stride_frow,
    scale, eps,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BV: tl.constexpr,
    BK: tl.constexpr, PREFETCH: tl.constexpr,
    MAX_ANC: tl.constexpr, IS_CHAIN: tl.constexpr, ACT: tl.constexpr, HAS_PENDING: tl.constexpr,
    PENDING_ROWS: tl.constexpr, PENDING_IS_CHAIN: tl.constexpr, STATE_PRODUCTS: tl.constexpr,
):
    i_hv, i_b = tl.program_id(0), tl.program_id(1)
    i_h = i_hv // (HV // H)
    slot = tl.load(state_indices + i_b).to(tl.int64)
    if slot < 0:
        return
    NC: tl.constexpr = V // BV
    NS: tl.constexpr = K // BK
    o_r = tl.arange(0, BV)
    o_k = tl.arange(0, K)
    o_s = tl.arange(0, BK)
    # tile i = c * NS + s: rows c * BV .. + BV, columns s * BK .. + BK, streamed in that order
    p_state = state + slot * stride_slot + i_hv * stride_head + o_r[:, None] * stride_v + o_s[None, :]
    # the first PREFETCH tiles in flight before anything else: everything up to the loop is independent of them
    ahead = ()
    for j in tl.static_range(PREFETCH):
        ahead = ahead + (tl.load(p_state + (j // NS) * BV * stride_v + (j % NS) * BK, mask=j < NC * NS, other=0.0),)

    f_k, f_kscale, f_u, f_g = _factor_columns(factors, slot, stride_fslot, i_hv, HV, K, V)
    if HAS_PENDING:
        # the previous step's path to its accepted node a (`_pending_path`): per row its weight exp(c_a - c_j) /
        # |k_j|; exp(c_a) for h0. The u rows come chunk by chunk, the key rows tile by tile
        accepted, p_row, p_on, p_weight, p_root = _pending_path(
            pending_nodes, pending_ancestors, i_b, f_kscale, f_g, stride_frow, 1, PENDING_ROWS, PENDING_IS_CHAIN)
        p_root = p_root[0]
        p_key = ()
        for d in tl.static_range(PENDING_ROWS):
            p_key = p_key + (f_k + p_row[d],)
        store_commit = (o_r[:, None] * 0 + accepted) >= 0  # as a tile: a scalar mask does not broadcast everywhere

    # per node, once per program: gates, q/k norms, Gram matrices (`_node_terms`), and the solve's two [BT, BT]
    # matrices: u = r T^T with T = (I + L)^-1, o = exp(c) q_inv h q + r (P T)^T (see `_epilogue_in_mma_layout`)
    bos = tl.load(cu_nodes + i_b)
    n = tl.load(cu_nodes + i_b + 1) - bos
    rows = tl.arange(0, BT)
    valid = rows < n
    node = bos + rows
    q_row = qkv + node.to(tl.int64) * stride_qkv + i_h * K
    k_row = q_row + H * K
    g_own, b_beta, path_c, decay, q_inv, k_inv, kk, qk = _node_terms(
        a, b, A_log, dt_bias, ancestors, bos, n, q_row, k_row, i_hv, scale, stride_a, stride_b, K, BT, 1, MAX_ANC,
        IS_CHAIN)
    beta = b_beta[0]
    exp_c = tl.exp(path_c[0])
    lower = tl.where(rows[None, :] != rows[:, None], beta[:, None] * decay[0] * kk, 0.0)
    inverse = tl.where(rows[:, None] == rows[None, :], 1.0, 0.0)
    for i in tl.static_range(1, BT):  # rows above i are final when row i is solved
        l_row = tl.sum(tl.where(rows[:, None] == i, lower, 0.0), 0)
        inverse = tl.where(rows[:, None] == i, inverse - tl.sum(l_row[:, None] * inverse, 0)[None, :], inverse)
    p_inverse = tl.sum((decay[0] * qk)[:, :, None] * inverse[None, :, :], 1)
    # column j of each, for the per-chunk sums over r's columns
    inverse_cols = ()
    p_inverse_cols = ()
    for j in tl.static_range(BT):
        inverse_cols = inverse_cols + (tl.sum(tl.where(rows[None, :] == j, inverse, 0.0), 1),)
        p_inverse_cols = p_inverse_cols + (tl.sum(tl.where(rows[None, :] == j, p_inverse, 0.0), 1),)
    k_scaled = exp_c * k_inv
    q_scaled = exp_c * q_inv
    # the [BK, NQ] right operands, tile by tile: k_t in column 2t, q_t in 2t + 1 (`_node_columns`), zeros to 16
    NQ: tl.constexpr = max(16, 2 * BT)
    o_q = tl.arange(0, NQ)
    q_node = o_q // 2
    kq_ok = (q_node < n) & (o_q < 2 * BT)
    kq_row = qkv + (bos + q_node).to(tl.int64) * stride_qkv + tl.where(o_q % 2 == 0, H * K, 0) + i_h * K
    f_row = rows.to(tl.int64) * stride_frow

    sum_squares = tl.zeros([BT], dtype=tl.float32)
    outs = ()
    gates = ()
    for c in tl.static_range(NC):
        o_v = c * BV + o_r
        if HAS_PENDING:
            p_u = ()
            for d in tl.static_range(PENDING_ROWS):
                p_u = p_u + (p_weight[d] * tl.load(f_u + p_row[d] + o_v, mask=p_on[d], other=0.0),)
        # v and z of these rows, in flight with the chunk's tiles
        b_v_raw = tl.load(qkv + node.to(tl.int64)[None, :] * stride_qkv + 2 * H * K + i_hv * V + o_v[:, None],
                          mask=valid[None, :], other=0.0)
        b_z_raw = tl.load(z + node[None, :] * stride_z + i_hv * stride_zh + o_v[:, None], mask=valid[None, :],
                          other=0.0)
        acc = tl.zeros([BV, NQ], dtype=tl.float32)
        # a loop, not unrolled: unrolled, the compiler hoists the small q/k and key-row loads of many tiles
        for s in tl.range(0, NS, num_stages=1):
            h = ahead[0].to(tl.float32)
            following = c * NS + s + PREFETCH  # PREFETCH tiles on, across chunk ends
            rest = ()
            for j in tl.static_range(1, PREFETCH):
                rest = rest + (ahead[j],)
            ahead = rest + (tl.load(p_state + (following // NS) * BV * stride_v + (following % NS) * BK,
                                    mask=following < NC * NS, other=0.0),)
            cols = s * BK + o_s
            kq = tl.load(kq_row[None, :] + cols[:, None], mask=kq_ok[None, :], other=0.0).to(tl.float32)
            if HAS_PENDING:
                h = p_root * h
                for d in tl.static_range(PENDING_ROWS):
                    h += p_u[d][:, None] * tl.load(p_key[d] + cols, mask=p_on[d], other=0.0)[None, :]
                h = h.to(state.dtype.element_ty)
                tl.store(p_state + c * BV * stride_v + s * BK, h, mask=store_commit)
                h = h.to(tl.float32)
            acc = _state_products(h, kq, acc, STATE_PRODUCTS)
        if HAS_PENDING:
            # every thread's reads of this chunk's pending u rows before any thread writes the chunk's new ones
            tl.debug_barrier()
        hk, hq = _node_columns(acc, BT)
        # v and z in the accumulator's columns (v_t at 2t, z_t at 2t + 1), as in `_epilogue_in_mma_layout`
        b_vz = tl.reshape(tl.join(b_v_raw.to(tl.float32), b_z_raw.to(tl.float32)), [BV, 2 * BT])
        if 2 * BT < NQ:
            b_vz = tl.reshape(tl.permute(tl.join(b_vz, tl.zeros_like(b_vz)), (0, 2, 1)), [BV, NQ])
        b_v, b_z = _node_columns(_in_accumulator_layout(b_vz), BT)
        b_r = beta[None, :] * (b_v - k_scaled[None, :] * hk)
        b_u = tl.zeros([BV, BT], dtype=tl.float32)
        b_o = q_scaled[None, :] * hq
        for j in tl.static_range(BT):  # r's column j: a sum over the lanes that share a row
            r_j = tl.sum(tl.where(rows[None, :] == j, b_r, 0.0), 1)
            b_u += r_j[:, None] * inverse_cols[j][None, :]
            b_o += r_j[:, None] * p_inverse_cols[j][None, :]
        tl.store(f_u + f_row[None, :] + o_v[:, None], b_u, mask=valid[None, :])
        # the core output rounded to the output dtype before the norm, as vLLM stores it
        b_o = b_o.to(out.dtype.element_ty).to(tl.float32)
        sum_squares += tl.sum(b_o * b_o, 0)
        outs = outs + (b_o,)
        gates = gates + (_output_gate(b_z, ACT),)

    # the gated RMSNorm over all V rows of each node, output gate fused
    rstd = tl.rsqrt(sum_squares / V + eps)
    for c in tl.static_range(NC):
        o_v = c * BV + o_r
        w = tl.load(norm_weight + o_v).to(tl.float32)
        y = outs[c] * rstd[None, :] * w[:, None] * gates[c]
        tl.store(out + node[None, :] * stride_out + i_hv * stride_outh + o_v[:, None], y.to(out.dtype.element_ty),
                 mask=valid[None, :])
    # this step's key rows, inverse norms and log decays: the last chunk's barrier orders every read of the pending
    # ones (the prologue's, the tiles') before these stores
    k_raw = tl.load(k_row[:, None] + o_k[None, :], mask=valid[:, None], other=0.0).to(tl.float32)
    tl.store(f_k + f_row[:, None] + o_k[None, :], k_raw, mask=valid[:, None])
    tl.store(f_kscale + f_row, k_inv, mask=valid)
    tl.store(f_g + f_row, g_own[0], mask=valid)
