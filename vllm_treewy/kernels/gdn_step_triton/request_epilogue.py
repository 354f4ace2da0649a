"""The GDN step's second launch for chains and trees of up to 8 nodes, the request epilogue: one program per
(value head, request) takes all of the request's nodes, read from the state pass's products (`state_pass`).
Each node's per-node terms are scalars (every lane holds them), its per-row values a [V] vector over the lanes, so
the solve and the outputs are elementwise over the rows and only K- and V-long sums cross lanes; the nodes are a
static loop (hence at most 8: BT x BT pairs unroll), with no [V, nodes] tiles padded to a dot's 16 columns and no
layout changes.

    r_i = beta_i (v_i - exp(c_i) k_inv_i (h k_raw_i)),   u_i = r_i - sum_{j < i} beta_i exp(c_i - c_j) kk_ij u_j
    o_i = exp(c_i) q_inv_i (h q_raw_i) + sum_{j <= i} exp(c_i - c_j) qk_ij u_j

(h the committed state; kk, qk the normalised Gram matrices; exp(c_i - c_j) zero off i's path; forward
substitution: ancestors precede their nodes.) Then o rounded to the output dtype (as vLLM's decode rounds the core
output), the gated RMSNorm over V, and this step's factors into the slot's rows (`factor_rows`).

With DEPENDENT_LAUNCH the kernel is launched as a programmatic dependent of the state pass (Hopper): everything
that does not read the products (gates, path decays, norms, Gram matrices, v and z) runs while the state pass
drains; `gdc_wait` then orders the products' loads and the factor rows' stores (the state pass reads the previous
step's rows) after the state pass's writes."""

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait

from ..factor_rows_triton import _factor_columns
from ..ancestor_table_triton import _ancestor
from .node_inputs import _before_check, _gated_rms_norm, _node_inputs, _request_indices


@triton.jit
def _path_decays(ancestors, bos, n, g_own, BT: tl.constexpr, MAX_ANC: tl.constexpr, IS_CHAIN: tl.constexpr):
    """Per node i: c_i, the sum of g over i's path; per pair (i, j <= i), at i * BT + j: exp(c_i - c_j) if j is on
    i's path, else 0. The exponents are running sums up the path, never differences of path sums. A path's nodes
    are the request's own (ancestors precede), so their g comes from g_own: a chain's by index, a tree's by the
    table's entry."""
    path_c = ()
    decay = ()
    for i in tl.static_range(BT):
        running = tl.zeros([], dtype=tl.float32)
        weights = ()
        for j in tl.static_range(BT):
            weights = weights + (tl.zeros([], dtype=tl.float32),)
        for d in tl.static_range(MAX_ANC + 1):
            if IS_CHAIN:
                if d <= i:  # node i - d
                    row = ()
                    for j in tl.static_range(BT):
                        row = row + (tl.exp(running) if j == i - d else weights[j],)
                    weights = row
                    running += g_own[i - d]
            else:
                cur = _ancestor(ancestors, bos, tl.where(i < n, i, -1), d, MAX_ANC + 1, False)
                here = tl.exp(running)
                g_cur = tl.zeros([], dtype=tl.float32)  # past the root: nothing more
                row = ()
                for j in tl.static_range(BT):
                    if j <= i:
                        row = row + (tl.where(cur == j, here, weights[j]),)
                        g_cur = tl.where(cur == j, g_own[j], g_cur)
                    else:
                        row = row + (weights[j],)
                weights = row
                running += g_cur
        path_c = path_c + (running,)
        decay = decay + weights
    return path_c, decay


@triton.jit
def _append_node_products(hk, hq, p_columns, i, V: tl.constexpr):
    """Node i's products h k_raw_i and h q_raw_i ([V] each, columns 2i and 2i + 1) appended to the tuples."""
    return hk + (tl.load(p_columns + (2 * i) * V),), hq + (tl.load(p_columns + (2 * i + 1) * V),)


@triton.jit(do_not_specialize=["state_indices", "ancestors", "cu_nodes"])
def _request_epilogue_kernel(
    qkv, a, b, A_log, dt_bias, z, norm_weight, state_indices, ancestors, cu_nodes, out, factors, products,
    stride_qkv, stride_a, stride_b, stride_z, stride_zh, stride_out, stride_outh, stride_fslot, stride_frow,
    scale, eps,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, MAX_ANC: tl.constexpr,
    IS_CHAIN: tl.constexpr, ACT: tl.constexpr, DEPENDENT_LAUNCH: tl.constexpr,
):
    """products [B, HV, 2 BT, V] fp32: h k_raw_t at column 2t, h q_raw_t at 2t + 1 (`_state_pass_kernel`)."""
    i_hv, i_b = tl.program_id(0), tl.program_id(1)
    # every program of a batch is resident at once: its time is its chain of dependent loads, so the loads that
    # need nothing but the program ids go out together, before the padding check
    slot, _, bos, n = _request_indices(state_indices, state_indices, cu_nodes, i_b, False, True)
    a_log = _before_check(A_log + i_hv).to(tl.float32)
    bias = _before_check(dt_bias + i_hv).to(tl.float32)
    if slot < 0:
        if DEPENDENT_LAUNCH:  # every program waits: this launch then completes after the state pass, for what follows
            gdc_wait()
        return
    o_k = tl.arange(0, K)
    o_v = tl.arange(0, V)
    neg_exp_a_log = -tl.exp(a_log)
    i_h = i_hv // (HV // H)
    # per node: gates, the raw q/k rows and their inverse norms, v and z (none of it reads the state pass's output)
    g_own = ()
    beta = ()
    q_rows = ()
    k_rows = ()
    q_inv = ()
    k_inv = ()
    v_rows = ()
    z_rows = ()
    for t in tl.static_range(BT):
        g_t, beta_t, q_t, q_inv_t, k_t, k_inv_t, v_t, z_t = _node_inputs(
            qkv, a, b, z, (bos + t).to(tl.int64), t < n, o_k, o_v, i_h, i_hv, bias, neg_exp_a_log, scale, stride_qkv,
            stride_a, stride_b, stride_z, stride_zh, H, K, V, False, True, True)
        g_own = g_own + (g_t,)
        beta = beta + (beta_t,)
        q_rows = q_rows + (q_t,)
        k_rows = k_rows + (k_t,)
        q_inv = q_inv + (q_inv_t,)
        k_inv = k_inv + (k_inv_t,)
        v_rows = v_rows + (v_t,)
        z_rows = z_rows + (z_t,)
    path_c, decay = _path_decays(ancestors, bos, n, g_own, BT, MAX_ANC, IS_CHAIN)
    # the solve's and the outputs' coefficients: per pair (i, j), at i * BT + j, -beta_i exp(c_i - c_j) kk_ij
    # (j < i) and exp(c_i - c_j) qk_ij (j <= i); zero past the path
    lower = ()
    attend = ()
    for i in tl.static_range(BT):
        for j in tl.static_range(BT):
            if j < i:
                kk = tl.sum(k_rows[i] * k_rows[j], 0) * (k_inv[i] * k_inv[j])
                lower = lower + (-beta[i] * decay[i * BT + j] * kk,)
            else:
                lower = lower + (tl.zeros([], dtype=tl.float32),)
            if j <= i:
                attend = attend + (tl.sum(q_rows[i] * k_rows[j], 0) * (q_inv[i] * k_inv[j]) * decay[i * BT + j],)
            else:
                attend = attend + (tl.zeros([], dtype=tl.float32),)
    w = tl.load(norm_weight + o_v).to(tl.float32)
    if DEPENDENT_LAUNCH:
        gdc_wait()
    # node i's products are loaded AHEAD nodes before its solve, ahead of the stores in between (a load after a store is
    # issued after it, so each node would wait an L2 round trip); all of them up front for up to 4 nodes (measured
    # faster than in the loop, at 8 nodes too despite more registers: bench/results/kernels/README.md, "Choices inside
    # the kernels")
    AHEAD: tl.constexpr = min(BT, 4)
    p_columns = products + ((i_b * HV + i_hv) * (2 * BT)).to(tl.int64) * V + o_v
    hk = ()
    hq = ()
    for i in tl.static_range(AHEAD):
        hk, hq = _append_node_products(hk, hq, p_columns, i, V)
    f_k, f_kscale, f_u, f_g = _factor_columns(factors, slot, stride_fslot, i_hv, HV, K, V)
    u_rows = ()
    for i in tl.static_range(BT):
        if i + AHEAD < BT:
            hk, hq = _append_node_products(hk, hq, p_columns, i + AHEAD, V)
        valid = i < n
        node = (bos + i).to(tl.int64)
        exp_c = tl.exp(path_c[i])
        u_i = beta[i] * (v_rows[i] - (exp_c * k_inv[i]) * hk[i])
        o_i = (exp_c * q_inv[i]) * hq[i]
        for j in tl.static_range(i):
            u_i += lower[i * BT + j] * u_rows[j]
            o_i += attend[i * BT + j] * u_rows[j]
        o_i += attend[i * BT + i] * u_i
        u_rows = u_rows + (u_i,)
        # gated RMSNorm over V, the core output rounded to the output dtype first (as vLLM's decode)
        o_i = o_i.to(out.dtype.element_ty).to(tl.float32)
        y = _gated_rms_norm(o_i, w, z_rows[i], eps, V, ACT)
        tl.store(out + node * stride_out + i_hv * stride_outh + o_v, y.to(out.dtype.element_ty), mask=valid)
        f_row = i * stride_frow
        tl.store(f_k + f_row + o_k, k_rows[i], mask=valid)
        tl.store(f_kscale + f_row, k_inv[i], mask=valid)
        tl.store(f_u + f_row + o_v, u_i, mask=valid)
        tl.store(f_g + f_row, g_own[i], mask=valid)
