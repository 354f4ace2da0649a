"""The GDN step's second launch for draft trees of any size, the path epilogue: one program per (value head,
request, NB of its nodes), each node solved from its own path alone, read from the state pass's products.

In a tree, node i's u and o read only the nodes on its path. With the path's nodes p_0 = i, p_1 its parent, ...
(slot d = 0..MAX_ANC of the ancestor table, -1 past the root), r_d = beta_d (v_d - exp(c_d) k_inv_d (h k_raw_d))
each path node's own term and exp(c_d - c_e) the decay from p_d up to p_e, the solve restricted to the path is a
back substitution from the root:

    u_d = r_d - sum_{e > d} beta_d exp(c_d - c_e) kk_de u_e
    o   = exp(c_0) q_inv_0 (h q_raw_0) + sum_{e >= 0} exp(c_0 - c_e) qk_0e u_e

So no node waits on another's result: the nodes split over programs and lanes, where `request_epilogue`'s static
per-node loops unroll BT x BT pairs (1,024 at 32 nodes). Each node recomputes its ancestors' r and u (MAX_ANC + 1 of
each), the price of that independence. u_0 goes with the node's raw key, key inverse norm and g into the slot's
factor rows, o through the gated RMSNorm into out. The exponents are running sums of g up the path from each d,
never differences of path sums.

With DEPENDENT_LAUNCH, as `request_epilogue`: everything that does not read the products runs before `gdc_wait`."""

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait

from ..factor_rows_triton import _factor_columns
from ..ancestor_table_triton import _ancestor
from .node_inputs import _before_check, _gated_rms_norm, _node_inputs, _request_indices


@triton.jit
def _slot_decays(g, P: tl.constexpr):
    """Per path slot d: c_d (the sum of g from d to the root; g is 0 past it) and, at d * P + e for e >= d,
    exp(c_d - c_e) as exp of the running sum of g over slots d..e-1."""
    path_c = ()
    decay = ()
    for d in tl.static_range(P):
        running = tl.zeros_like(g[0])
        for e in tl.static_range(P):
            if e < d:
                decay = decay + (running,)  # unused: e is not above d
            else:
                decay = decay + (tl.exp(running),)
                running += g[e]
        path_c = path_c + (running,)
    return path_c, decay


@triton.jit(do_not_specialize=["state_indices", "ancestors", "cu_nodes"])
def _path_epilogue_kernel(
    qkv, a, b, A_log, dt_bias, z, norm_weight, state_indices, ancestors, cu_nodes, out, factors, products,
    stride_qkv, stride_a, stride_b, stride_z, stride_zh, stride_out, stride_outh, stride_fslot, stride_frow,
    scale, eps,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, NB: tl.constexpr,
    MAX_ANC: tl.constexpr, IS_CHAIN: tl.constexpr, ACT: tl.constexpr, DEPENDENT_LAUNCH: tl.constexpr,
):
    """products [B, HV, 2 BT, V] fp32: h k_raw_t at column 2t, h q_raw_t at 2t + 1 (`_state_pass_kernel`)."""
    i_hv, i_b, i_nb = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    slot, _, bos, n = _request_indices(state_indices, state_indices, cu_nodes, i_b, False, True)
    a_log = _before_check(A_log + i_hv).to(tl.float32)
    bias = _before_check(dt_bias + i_hv).to(tl.float32)
    if (slot < 0) | (i_nb * NB >= n):
        if DEPENDENT_LAUNCH:  # every program waits: this launch then completes after the state pass, for what follows
            gdc_wait()
        return
    P: tl.constexpr = MAX_ANC + 1
    o_k = tl.arange(0, K)
    o_v = tl.arange(0, V)
    local = i_nb * NB + tl.arange(0, NB)
    live = local < n
    neg_exp_a_log = -tl.exp(a_log)
    i_h = i_hv // (HV // H)
    # per path slot d: the node (local), its gates, raw key row and inverse norm, v row (zeros past the root)
    path = ()
    g = ()
    beta = ()
    k_rows = ()
    k_inv = ()
    v_rows = ()
    for d in tl.static_range(P):
        p = _ancestor(ancestors, bos, tl.where(live, local, -1), d, P, IS_CHAIN)
        on = p >= 0
        node = (bos + tl.maximum(p, 0)).to(tl.int64)
        g_d, beta_d, _, _, k_d, k_inv_d, v_d, _ = _node_inputs(
            qkv, a, b, z, node, on, o_k, o_v, i_h, i_hv, bias, neg_exp_a_log, scale, stride_qkv, stride_a, stride_b,
            stride_z, stride_zh, H, K, V, True, True, False)
        g = g + (tl.where(on, g_d, 0.0),)
        beta = beta + (beta_d,)
        k_rows = k_rows + (k_d,)
        k_inv = k_inv + (k_inv_d,)
        v_rows = v_rows + (v_d,)
        path = path + (p,)
    # the node's own query row and z
    node_0 = (bos + tl.maximum(local, 0)).to(tl.int64)
    _, _, q_0, q_inv, _, _, _, z_0 = _node_inputs(
        qkv, a, b, z, node_0, live, o_k, o_v, i_h, i_hv, bias, neg_exp_a_log, scale, stride_qkv, stride_a, stride_b,
        stride_z, stride_zh, H, K, V, True, False, True)
    path_c, decay = _slot_decays(g, P)
    # the solve's and the output's coefficients: at d * P + e (e > d) -beta_d exp(c_d - c_e) kk_de; per e >= 0
    # exp(c_0 - c_e) qk_0e
    lower = ()
    for d in tl.static_range(P):
        for e in tl.static_range(P):
            if e > d:
                kk = tl.sum(k_rows[d] * k_rows[e], 1) * (k_inv[d] * k_inv[e])
                lower = lower + (-beta[d] * decay[d * P + e] * kk,)
            else:
                lower = lower + (tl.zeros_like(beta[d]),)
    attend = ()
    for e in tl.static_range(P):
        attend = attend + (tl.sum(q_0 * k_rows[e], 1) * (q_inv * k_inv[e]) * decay[e],)
    w = tl.load(norm_weight + o_v).to(tl.float32)
    if DEPENDENT_LAUNCH:
        gdc_wait()
    p_columns = products + ((i_b * HV + i_hv) * (2 * BT)).to(tl.int64) * V + o_v[None, :]
    hk = ()
    for d in tl.static_range(P):
        hk = hk + (tl.load(p_columns + (2 * tl.maximum(path[d], 0))[:, None] * V, mask=(path[d] >= 0)[:, None],
                           other=0.0),)
    hq = tl.load(p_columns + (2 * local + 1)[:, None] * V, mask=live[:, None], other=0.0)
    # back substitution from the root's slot down: u of slots d + 1.. first (`u_above[e - d - 1]`)
    u_above = ()
    for d in tl.static_range(P - 1, -1, -1):
        u_d = beta[d][:, None] * (v_rows[d] - (tl.exp(path_c[d]) * k_inv[d])[:, None] * hk[d])
        for e in tl.static_range(d + 1, P):
            u_d += lower[d * P + e][:, None] * u_above[e - d - 1]
        u_above = (u_d,) + u_above
    o = (tl.exp(path_c[0]) * q_inv)[:, None] * hq
    for e in tl.static_range(P):
        o += attend[e][:, None] * u_above[e]
    # gated RMSNorm over V, the core output rounded to the output dtype first (as vLLM's decode)
    o = o.to(out.dtype.element_ty).to(tl.float32)
    y = _gated_rms_norm(o, w[None, :], z_0, eps, V, ACT)
    tl.store(out + node_0[:, None] * stride_out + i_hv * stride_outh + o_v[None, :], y.to(out.dtype.element_ty),
             mask=live[:, None])
    f_k, f_kscale, f_u, f_g = _factor_columns(factors, slot, stride_fslot, i_hv, HV, K, V)
    f_row = local.to(tl.int64) * stride_frow
    tl.store(f_k + f_row[:, None] + o_k[None, :], k_rows[0], mask=live[:, None])
    tl.store(f_kscale + f_row, k_inv[0], mask=live)
    tl.store(f_u + f_row[:, None] + o_v[None, :], u_above[0], mask=live[:, None])
    tl.store(f_g + f_row, g[0], mask=live)
