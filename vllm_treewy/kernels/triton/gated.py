"""The whole GDN decode step after the conv, for packed draft chains and small trees, in one launch: gates, q/k L2
norm, the closed-form verify, the gated RMSNorm with the output gate, and optionally the previous step's commit
(the same inputs and output as vLLM's compiled `fused_gdn_decode_post_conv_mtp`, so the two compare like for like).

    g_i    = -exp(A_log) * softplus(a_i + dt_bias)            beta_i = sigmoid(b_i)
    q_i    = scale * q_i / sqrt(|q_i|^2 + 1e-6)              k_i    = k_i / sqrt(|k_i|^2 + 1e-6)
    (o_i, u_i) = closed-form tree verify from h0 (design notes §1)
    o_i    <- o_i rounded to the output dtype (bf16 in vLLM), as vLLM's decode and compiled MTP kernel do
    out_i  = o_i * rsqrt(mean_v(o_i^2) + eps) * norm_weight * act(z_i)      act = silu or sigmoid

One program per (value head, request) holds a whole head: the state [V, K] is streamed once through registers in
key chunks of BK columns. Two layouts (launch option `state_dot`):
- tensor cores (default): the chunk keeps its load's layout (a warp covers 4 rows x 128 bytes: whole line segments,
  loads and the commit's stores coalesced); the commit's rank-one updates are elementwise in that layout, and all
  products with the state come from one tensor-core dot per chunk, [h k_0 .. h k_{T-1}, h q_0 .. h q_{T-1}] =
  h [V, BK] @ [k; q]^T [BK, 16] (state as the 128-row operand, nodes padded to 16 columns), fp32 operands: one
  tf32 pass when the state and q/k are bf16 (exact products), tf32x3 (hi + lo parts) for an fp32 state (~fp32:
  measured 1-2e-7 on u and the committed state at K=128 against fp64). The [BK, 16] q/k chunks are prefetched
  with the state chunks.
- one value row per thread (`state_dot=False`): broadcast multiplies and fp32 sums on the CUDA cores, BK columns
  (16 bytes) per row per step. Its partial-line stores stream at ~0.6 TB/s (2026-11-30); kept as the reference
  layout (no tf32 at all) and for block_k < 16.

Measured on the H200 (bench/results/kernels.md, 2026-11-30b run 1, before the q/k prefetch): fp32 state, chain T=4,
1.09x / 1.15x vLLM's compiled kernel at B=64 / 256, 0.87x at B=1; the commit alone now streams at 3.0 TB/s, but
the verify part is latency-bound per program (~15 us of dependent steps per head at 2 resident programs per SM),
and T=8 is 0.55x. The bf16 tensor-core path of run 1 was wrong (fixed since, not yet re-measured on a GPU).

A whole head per program is what the gated RMSNorm needs (it normalises over V). Trees work (ancestor table, as in
`verify_packed_triton`; tested in the interpreter up to 12 nodes), but registers grow with the node count (BT = next
power of two): measured on the H200 are chains of up to 8 nodes; big trees stay with `verify_packed_triton`.

Factors for the commit live in the state slots' rows, `factors` [S, T, F] fp32 (`slot_factor_width`): per node
the raw key rows PER VALUE HEAD (a copy of mixed_qkv's k slice), their inverse norms, the pseudo-values u and the
log decays g. The commit folds the inverse norm into u (h_a = exp(c_a) h0 + sum_j exp(c_a - c_j) (u_j / |k_j|)
k_raw_j^T), so the normalised keys are never stored. Keys are stored per value head so that the program of (value
head hv, request b) owns every factor column it reads and writes: no two programs share a row segment.

Torch twin: `vllm_treewy.kernels.gated.gdn_step_packed` / `gdn_commit_packed`; fp64 ground truth:
`vllm_treewy.kernels.reference.reference_gated_tree` (the state after a chain's node a is its recurrence state).

For the adapter. Where vLLM would call `fused_gdn_decode_post_conv_mtp(mixed_qkv, a, b, A_log, dt_bias, ...,
state, output_gate, norm_weight, out, scale, norm_eps, activation)` after the conv, a reconstruct step calls

    out = gdn_step_triton(mixed_qkv, a, b, A_log, dt_bias, output_gate, norm_weight, state, state_indices,
                          parents, cu_nodes, factors=slot_factors, pending_nodes=accepted_last_step,
                          num_key_heads=H, max_nodes=T, chain=True, scale=K**-0.5, norm_eps=eps,
                          activation="silu", out=core_attn_out)

with `state_indices` [B] (one slot per request; negative = padding), `slot_factors` [S, T, F] (e.g. a view into
the KV cache page, stride(0) = page size in floats), and `accepted_last_step` int32 [B]: the local index of the
node accepted in the slot's previous step, -1 for none (a tree step passes `ancestors` for its verify and
`pending_ancestors`, the previous step's [T, D] table, for the commit; a chain needs neither). The kernel first
commits that node in place from the rows the previous call wrote, then verifies from the committed state, then
(after a barrier: every read of the pending rows comes first) overwrites the rows with this step's factors. The
end of a sequence (or a test) commits alone: `gdn_commit_triton(state, state_indices, slot_factors, accepted,
num_key_heads=H)` (a tree's: `pending_ancestors=` its table). Everything is preallocated by the caller (`out`
optional), so the call is CUDA-graph capturable. vLLM passes the layer's `layer_norm_epsilon` as norm_eps.
"""

import torch
import triton
import triton.language as tl

from ..gated import slot_factor_width, split_slot_factors
from ._tree import _ancestor
from .verify import interpreting, max_ancestors, tree_ancestors

ACTIVATIONS = ("silu", "sigmoid")
L2NORM_EPS = 1e-6  # vLLM's in-kernel q/k L2 norm

__all__ = ["gdn_commit_triton", "gdn_step_triton", "slot_factor_width", "split_slot_factors"]


@triton.jit
def _log_decay(a_raw, dt_bias, neg_exp_a_log):
    """g = -exp(A_log) * softplus(a + dt_bias), softplus with vLLM's threshold of 20. log(1 + e) via Kahan's
    log1p (log(u) * e / (u - 1), u = 1 + e rounded): accurate to a few ulps also where e = exp(x) is tiny, where
    the plain log(1 + e) loses all relative precision (g -> 0)."""
    x = a_raw + dt_bias
    e = tl.exp(x)
    u = 1.0 + e
    log1p = tl.where(u == 1.0, e, tl.log(u) * (e / (u - 1.0)))
    return neg_exp_a_log * tl.where(x <= 20.0, log1p, x)


@triton.jit
def _node_terms(qkv, a, b, ancestors, bos, n, q_row, k_row, bias, neg_exp_a_log, scale, stride_a, stride_b,
                i_hv, K: tl.constexpr, BT: tl.constexpr, MAX_ANC: tl.constexpr, IS_CHAIN: tl.constexpr):
    """Everything per node that does not touch the state: gates, path sums c and decays exp(c_i - c_j), q/k
    inverse norms and Gram matrices."""
    rows = tl.arange(0, BT)
    valid = rows < n
    node = bos + rows
    # gates of the nodes, and their path sums c and decays exp(c_i - c_j) (running sums: no differences of
    # long path sums)
    b_a = tl.load(a + node * stride_a + i_hv, mask=valid, other=0.0).to(tl.float32)
    g_own = _log_decay(b_a, bias, neg_exp_a_log)
    b_beta = tl.sigmoid(tl.load(b + node * stride_b + i_hv, mask=valid, other=0.0).to(tl.float32))
    local = tl.where(valid, rows, -1)
    running_c = tl.zeros([BT], dtype=tl.float32)
    log_decay = tl.full([BT, BT], float("-inf"), tl.float32)
    for d in tl.static_range(MAX_ANC + 1):
        cur = _ancestor(ancestors, bos, local, d, MAX_ANC + 1, IS_CHAIN)
        log_decay = tl.where(rows[None, :] == cur[:, None], running_c[:, None], log_decay)
        a_cur = tl.load(a + (bos + cur) * stride_a + i_hv, mask=cur >= 0, other=0.0).to(tl.float32)
        running_c += tl.where(cur >= 0, _log_decay(a_cur, bias, neg_exp_a_log), 0.0)
    decay = tl.exp(log_decay)
    # q/k norms and the small Gram matrices, from the whole rows (K elements; cached after the first touch)
    o_k = tl.arange(0, K)
    q_full = tl.load(q_row[:, None] + o_k[None, :], mask=valid[:, None], other=0.0).to(tl.float32)
    k_full = tl.load(k_row[:, None] + o_k[None, :], mask=valid[:, None], other=0.0).to(tl.float32)
    q_inv = tl.rsqrt(tl.sum(q_full * q_full, 1) + 1e-6) * scale
    k_inv = tl.rsqrt(tl.sum(k_full * k_full, 1) + 1e-6)
    # one column j at a time: [BT, K] tiles, not [BT, BT, K] products (registers at T=8)
    kk = tl.zeros([BT, BT], dtype=tl.float32)
    qk = tl.zeros([BT, BT], dtype=tl.float32)
    for j in tl.static_range(BT):
        k_j = tl.sum(tl.where(rows[:, None] == j, k_full, 0.0), 0)
        kk = tl.where(rows[None, :] == j, tl.sum(k_full * k_j[None, :], 1)[:, None], kk)
        qk = tl.where(rows[None, :] == j, tl.sum(q_full * k_j[None, :], 1)[:, None], qk)
    kk = kk * (k_inv[:, None] * k_inv[None, :])
    qk = qk * (q_inv[:, None] * k_inv[None, :])
    return g_own, b_beta, running_c, decay, q_inv, k_inv, kk, qk


@triton.jit
def _gated_step_kernel(
    qkv, a, b, A_log, dt_bias, z, norm_weight, state, state_indices, ancestors, cu_nodes, out, factors,
    pending_nodes, pending_ancestors,
    stride_qkv, stride_a, stride_b, stride_z, stride_zh, stride_out, stride_outh,
    stride_slot, stride_head, stride_v, stride_fslot, stride_frow,
    scale, eps,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, PREFETCH: tl.constexpr, ROW_SUMS: tl.constexpr,
    LATE_NODE_TERMS: tl.constexpr, MAX_ANC: tl.constexpr, IS_CHAIN: tl.constexpr,
    ACT: tl.constexpr, DO_VERIFY: tl.constexpr, HAS_PENDING: tl.constexpr, PENDING_ROWS: tl.constexpr,
    PENDING_IS_CHAIN: tl.constexpr, STATE_DOT: tl.constexpr, EXACT_TF32: tl.constexpr,
):
    i_hv, i_b = tl.program_id(0), tl.program_id(1)
    i_h = i_hv // (HV // H)
    slot = tl.load(state_indices + i_b).to(tl.int64)
    if slot < 0:
        return
    o_v = tl.arange(0, V)
    o_kc = tl.arange(0, BK)
    p_state = state + slot * stride_slot + i_hv * stride_head + o_v[:, None] * stride_v
    # this program's columns of the slot's factor rows (see `slot_factor_width`): only (slot, i_hv) touches them
    f_slot = factors + slot * stride_fslot
    f_k = f_slot + i_hv * K
    f_kscale = f_slot + HV * K + i_hv
    f_u = f_slot + HV * (K + 1) + i_hv * V
    f_g = f_slot + HV * (K + 1 + V) + i_hv
    # the first PREFETCH state chunks in flight before anything else (everything below is independent of them)
    ahead = ()
    for j in tl.static_range(PREFETCH):
        ahead = ahead + (tl.load(p_state + (j * BK + o_kc)[None, :], mask=j * BK < K, other=0.0),)

    if HAS_PENDING:
        # the previous step's path to its accepted node a, row j = the d-th ancestor of a (d = 0..PENDING_ROWS-1;
        # a chain's is a - d, a tree's comes from the table): the key row, and exp(c_a - c_j) u_j / |k_j| as a [V]
        # vector (running sums of g up the path); exp(c_a) for h0. Every pending row is read before the epilogue
        # overwrites the rows (barrier there).
        accepted = tl.load(pending_nodes + i_b)
        running = tl.zeros([], dtype=tl.float32)
        p_wu = ()
        p_krow = ()
        p_on = ()
        for d in tl.static_range(PENDING_ROWS):
            path_row = _ancestor(pending_ancestors, 0, accepted, d, PENDING_ROWS, PENDING_IS_CHAIN)
            on = path_row >= 0
            row = tl.maximum(path_row, 0).to(tl.int64) * stride_frow
            weight = tl.where(on, tl.exp(running), 0.0) * tl.load(f_kscale + row, mask=on, other=0.0)
            p_wu = p_wu + (tl.load(f_u + row + o_v, mask=on, other=0.0) * weight,)
            p_krow = p_krow + (f_k + row,)
            p_on = p_on + (on,)
            running += tl.load(f_g + row, mask=on, other=0.0)
        p_root = tl.exp(running)
        store_commit = (o_v[:, None] * 0 + accepted) >= 0  # as a tile: a scalar mask does not broadcast everywhere

    if DO_VERIFY:
        neg_exp_a_log = -tl.exp(tl.load(A_log + i_hv).to(tl.float32))
        bias = tl.load(dt_bias + i_hv).to(tl.float32)
        bos = tl.load(cu_nodes + i_b)
        n = tl.load(cu_nodes + i_b + 1) - bos
        rows = tl.arange(0, BT)
        valid = rows < n
        node = bos + rows
        q_row = qkv + node.to(tl.int64) * stride_qkv + i_h * K
        k_row = q_row + H * K
        if not LATE_NODE_TERMS:
            g_own, b_beta, running_c, decay, q_inv, k_inv, kk, qk = _node_terms(
                qkv, a, b, ancestors, bos, n, q_row, k_row, bias, neg_exp_a_log, scale, stride_a, stride_b, i_hv,
                K, BT, MAX_ANC, IS_CHAIN)
        if not STATE_DOT:  # the row layout's per-node q/k row offsets
            row_off = ()
            row_ok = ()
            for t in tl.static_range(BT):
                row_off = row_off + ((bos + t).to(tl.int64) * stride_qkv,)
                row_ok = row_ok + (t < n,)
        else:
            # columns of the [BK, NQ] right operand: k_0..k_{BT-1}, q_0..q_{BT-1}, zero padding up to 16
            NQ: tl.constexpr = max(16, 2 * BT)
            o_q = tl.arange(0, NQ)
            q_node = o_q % BT
            kq_ok = (q_node < n) & (o_q < 2 * BT)
            kq_row = qkv + (bos + q_node).to(tl.int64) * stride_qkv + tl.where(o_q < BT, H * K, 0) + i_h * K

    # the state, BK key columns at a time; PREFETCH chunks are in flight ahead of the one in use, loaded before the
    # commit stores the current chunk. STATE_DOT: one [V, 16] accumulator of tensor-core products. Else (BK = one
    # 16-byte vector per value row) each thread owns whole value rows, and every product with the state accumulates
    # elementwise into per-node [V, BK] partial sums (no reduction, no shuffle, no layout change inside the loop)
    if DO_VERIFY:
        if STATE_DOT:
            acc_kq = tl.zeros([V, NQ], dtype=tl.float32)
        else:
            acc_k = ()
            acc_q = ()
            for t in tl.static_range(BT):
                if ROW_SUMS:
                    acc_k = acc_k + (tl.zeros([V], dtype=tl.float32),)
                    acc_q = acc_q + (tl.zeros([V], dtype=tl.float32),)
                else:
                    acc_k = acc_k + (tl.zeros([V, BK], dtype=tl.float32),)
                    acc_q = acc_q + (tl.zeros([V, BK], dtype=tl.float32),)
    if DO_VERIFY and STATE_DOT:  # the [BK, NQ] q/k chunks travel with the state chunks: off the loop's critical path
        ahead_kq = ()
        for j in tl.static_range(PREFETCH):
            ahead_kq = ahead_kq + (tl.load(kq_row[None, :] + (j * BK + o_kc)[:, None],
                                           mask=kq_ok[None, :] & (j * BK < K), other=0.0),)
    # a loop, not unrolled: unrolled, the compiler hoists the small q/k loads of many chunks and runs out of
    # registers; in flight stay the PREFETCH chunks ahead
    for i_k in tl.range(0, K // BK):
        cols = i_k * BK + o_kc
        h = ahead[0].to(tl.float32)
        rest = ()
        for j in tl.static_range(1, PREFETCH):
            rest = rest + (ahead[j],)
        ahead = rest + (tl.load(p_state + (cols + PREFETCH * BK)[None, :], mask=(i_k + PREFETCH) * BK < K,
                                other=0.0),)
        if DO_VERIFY and STATE_DOT:
            kq = ahead_kq[0].to(tl.float32)
            rest = ()
            for j in tl.static_range(1, PREFETCH):
                rest = rest + (ahead_kq[j],)
            ahead_kq = rest + (tl.load(kq_row[None, :] + (cols + PREFETCH * BK)[:, None],
                                       mask=kq_ok[None, :] & ((i_k + PREFETCH) * BK < K), other=0.0),)
        if HAS_PENDING:
            h = p_root * h
            for d in tl.static_range(PENDING_ROWS):
                pk = tl.load(p_krow[d] + cols, mask=p_on[d], other=0.0)
                h += p_wu[d][:, None] * pk[None, :]
            h = h.to(state.dtype.element_ty)
            tl.store(p_state + cols[None, :], h, mask=store_commit)
            h = h.to(tl.float32)
        if DO_VERIFY and STATE_DOT:
            # every h k_t and h q_t of the chunk in one tensor-core product, the state as the 128-row operand, in
            # fp32 operands: one tf32 pass where both are exact in tf32 (a bf16 state, bf16 q/k: exact products,
            # fp32 sums), else tf32x3 (hi and lo parts; ~fp32 accuracy)
            if EXACT_TF32:
                acc_kq = tl.dot(h, kq, acc_kq, input_precision="tf32")
            else:
                acc_kq = tl.dot(h, kq, acc_kq, input_precision="tf32x3")
        if DO_VERIFY and not STATE_DOT:
            new_k = ()
            new_q = ()
            for t in tl.static_range(BT):
                kc = tl.load(qkv + row_off[t] + H * K + i_h * K + cols, mask=row_ok[t], other=0.0).to(tl.float32)
                qc = tl.load(qkv + row_off[t] + i_h * K + cols, mask=row_ok[t], other=0.0).to(tl.float32)
                if ROW_SUMS:  # a thread's BK columns summed at once: in-thread when lanes run along V only
                    new_k = new_k + (acc_k[t] + tl.sum(h * kc[None, :], 1),)
                    new_q = new_q + (acc_q[t] + tl.sum(h * qc[None, :], 1),)
                else:
                    new_k = new_k + (acc_k[t] + h * kc[None, :],)
                    new_q = new_q + (acc_q[t] + h * qc[None, :],)
            acc_k = new_k
            acc_q = new_q

    if DO_VERIFY:
        # LATE_NODE_TERMS: nothing of this is needed in the loop; late, its [BT, BT] tiles stay out of the loop's registers
        if LATE_NODE_TERMS:
            g_own, b_beta, running_c, decay, q_inv, k_inv, kk, qk = _node_terms(
                qkv, a, b, ancestors, bos, n, q_row, k_row, bias, neg_exp_a_log, scale, stride_a, stride_b, i_hv,
                K, BT, MAX_ANC, IS_CHAIN)
        exp_c = tl.exp(running_c)
        hk = tl.zeros([BT, V], dtype=tl.float32)
        hq = tl.zeros([BT, V], dtype=tl.float32)
        for t in tl.static_range(BT):
            if STATE_DOT:
                hk = tl.where(rows[:, None] == t, tl.sum(tl.where(o_q[None, :] == t, acc_kq, 0.0), 1)[None, :], hk)
                hq = tl.where(rows[:, None] == t, tl.sum(tl.where(o_q[None, :] == BT + t, acc_kq, 0.0), 1)[None, :],
                              hq)
            elif ROW_SUMS:
                hk = tl.where(rows[:, None] == t, acc_k[t][None, :], hk)
                hq = tl.where(rows[:, None] == t, acc_q[t][None, :], hq)
            else:
                hk = tl.where(rows[:, None] == t, tl.sum(acc_k[t], 1)[None, :], hk)
                hq = tl.where(rows[:, None] == t, tl.sum(acc_q[t], 1)[None, :], hq)
        hk = hk * k_inv[:, None]
        hq = hq * q_inv[:, None]
        b_v = tl.load(qkv + node.to(tl.int64)[:, None] * stride_qkv + 2 * H * K + i_hv * V + o_v[None, :],
                      mask=valid[:, None], other=0.0).to(tl.float32)
        r = b_beta[:, None] * (b_v - exp_c[:, None] * hk)
        gmat = tl.where(rows[None, :] != rows[:, None], b_beta[:, None] * decay * kk, 0.0)
        # forward substitution: rows above i are final when row i is solved
        b_u = r
        for i in range(1, n):
            g_row = tl.sum(tl.where(rows[:, None] == i, gmat, 0.0), 0)
            b_u = tl.where(rows[:, None] == i, b_u - tl.sum(g_row[:, None] * b_u, 0)[None, :], b_u)
        # the norm's inputs in flight before the solve's loop (a later block: not hoisted over it)
        w = tl.load(norm_weight + o_v).to(tl.float32)
        b_z = tl.load(z + node[:, None] * stride_z + i_hv * stride_zh + o_v[None, :], mask=valid[:, None],
                      other=0.0).to(tl.float32)
        pmat = decay * qk
        b_o = exp_c[:, None] * hq
        for j in tl.static_range(BT):  # one node's u at a time: no [BT, BT, V] product (registers at T=8)
            u_j = tl.sum(tl.where(rows[:, None] == j, b_u, 0.0), 0)
            p_j = tl.sum(tl.where(rows[None, :] == j, pmat, 0.0), 1)
            b_o += p_j[:, None] * u_j[None, :]
        # gated RMSNorm over the head's V values, output gate fused; the core output rounded to the output dtype
        # first, as vLLM's non-speculative decode stores it (and its compiled MTP kernel rounds it) before the norm
        b_o = b_o.to(out.dtype.element_ty).to(tl.float32)
        rstd = tl.rsqrt(tl.sum(b_o * b_o, 1) / V + eps)
        if ACT == "silu":
            gate = b_z * tl.sigmoid(b_z)
        else:
            gate = tl.sigmoid(b_z)
        y = b_o * rstd[:, None] * w[None, :] * gate
        tl.store(out + node[:, None] * stride_out + i_hv * stride_outh + o_v[None, :], y.to(out.dtype.element_ty),
                 mask=valid[:, None])
        # this step's factors into the slot's rows, after every thread's last read of the pending rows; the raw
        # keys reloaded here rather than kept live through the state loop
        tl.debug_barrier()
        f_row = rows.to(tl.int64) * stride_frow
        o_k = tl.arange(0, K)
        k_raw = tl.load(k_row[:, None] + o_k[None, :], mask=valid[:, None], other=0.0).to(tl.float32)
        tl.store(f_k + f_row[:, None] + o_k[None, :], k_raw, mask=valid[:, None])
        tl.store(f_kscale + f_row, k_inv, mask=valid)
        tl.store(f_u + f_row[:, None] + o_v[None, :], b_u, mask=valid[:, None])
        tl.store(f_g + f_row, g_own, mask=valid)


# launch defaults per state dtype, the fastest candidate measured correct on the H200 at H=16, HV=32, K=V=128, chain
# T=4 (bench/results/2026-11-30b/gated_run1.json): fp32, the tensor-core layout at block_k=32, 8 warps, one chunk
# ahead (176.2 / 15.7 us at B=64 / 1); bf16, one value row per thread with row sums and late node terms (160.3 /
# 20.9 us) until the corrected bf16 tensor-core path (101 registers at T=4, bench/results/2026-11-30b/
# compile_report.jsonl; its uncorrected run took 137-147 us) is measured correct on the GPU.
LAUNCH_DEFAULTS = {
    torch.float32: dict(block_k=32, num_warps=8, prefetch=1, max_registers=None, row_sums=False,
                        late_node_terms=True, state_dot=True),
    torch.bfloat16: dict(block_k=8, num_warps=4, prefetch=2, max_registers=None, row_sums=True,
                         late_node_terms=True, state_dot=False),
}


def _nodes_block(max_nodes: int) -> int:
    return max(2, triton.next_power_of_2(max_nodes))


def _check_factors(factors, state, state_indices, pending_nodes, pending_ancestors):
    S, HV, V, K = state.shape
    assert factors.dtype == torch.float32 and factors.dim() == 3 and factors.stride(2) == 1
    assert factors.shape[0] >= S and factors.shape[2] == slot_factor_width(HV, K, V)
    assert pending_nodes is None or (pending_nodes.shape == state_indices.shape and
                                     pending_nodes.dtype == torch.int32 and pending_nodes.stride(0) == 1)
    assert pending_ancestors is None or (pending_ancestors.dim() == 2 and pending_ancestors.is_contiguous() and
                                         pending_ancestors.dtype == torch.int32 and
                                         pending_ancestors.shape[0] <= factors.shape[1]), \
        "pending_ancestors: int32 [T, D] contiguous, one row per factor row of the previous step's tree"
    assert state_indices.stride(0) == 1, "the kernels index state_indices flat (a strided column would be misread)"


def _launch(mixed_qkv, a, b, A_log, dt_bias, output_gate, norm_weight, state, state_indices, parents, cu_nodes,
            factors, pending_nodes, pending_ancestors, *, num_key_heads, max_nodes, max_depth, chain, scale,
            norm_eps, activation, ancestors, out, do_verify, **launch):
    S, HV, V, K = state.shape
    H = num_key_heads
    assert HV % H == 0 and state.stride(-1) == 1 and K == triton.next_power_of_2(K)
    assert V == triton.next_power_of_2(V) and activation in ACTIVATIONS
    _check_factors(factors, state, state_indices, pending_nodes, pending_ancestors)
    launch = {**LAUNCH_DEFAULTS[state.dtype], **{k: v for k, v in launch.items() if v is not None}}
    block_k = min(launch["block_k"], K)
    assert not (launch["state_dot"] and do_verify) or block_k >= 16, "tl.dot needs block_k >= 16"
    options = dict(num_warps=launch["num_warps"], num_stages=1)
    if launch["max_registers"] and not interpreting():
        options["maxnreg"] = launch["max_registers"]
    batch = state_indices.shape[0]
    if do_verify:
        n_nodes = mixed_qkv.shape[0]
        assert mixed_qkv.shape[1] == 2 * H * K + HV * V
        assert n_nodes == 0 or (mixed_qkv.stride(1) == 1 and a.stride(1) == 1 and b.stride(1) == 1 and
                                output_gate.stride(2) == 1)
        assert max_nodes <= factors.shape[1], "a slot holds factors.shape[1] node rows"
        max_anc = max_ancestors(max_nodes, max_depth, chain)
        ancestors = tree_ancestors(parents, cu_nodes, max_anc, chain, ancestors)
        if out is None:
            out = torch.empty(n_nodes, HV, V, dtype=mixed_qkv.dtype, device=mixed_qkv.device)
        out3 = out.view(n_nodes, HV, V)
        v_args = (mixed_qkv, a, b, A_log, dt_bias, output_gate, norm_weight, state, state_indices, ancestors,
                  cu_nodes, out3)
        strides = (mixed_qkv.stride(0), a.stride(0), b.stride(0), output_gate.stride(0), output_gate.stride(1),
                   out3.stride(0), out3.stride(1))
        bt = _nodes_block(max_nodes)
    else:  # commit alone: the verify's pointers are never dereferenced
        max_anc, bt = 0, 2
        v_args = (factors,) * 7 + (state, state_indices, state_indices, state_indices, factors)
        strides = (0,) * 7
    _gated_step_kernel[(HV, batch)](
        *v_args, factors, state_indices if pending_nodes is None else pending_nodes,
        state_indices if pending_ancestors is None else pending_ancestors,
        *strides, state.stride(0), state.stride(1), state.stride(2), factors.stride(0), factors.stride(1),
        float(K**-0.5 if scale is None else scale), float(norm_eps),
        H=H, HV=HV, K=K, V=V, BT=bt, BK=block_k, PREFETCH=launch["prefetch"],
        ROW_SUMS=launch["row_sums"], LATE_NODE_TERMS=launch["late_node_terms"], MAX_ANC=max_anc, IS_CHAIN=chain,
        ACT=activation, DO_VERIFY=do_verify, HAS_PENDING=pending_nodes is not None,
        PENDING_ROWS=factors.shape[1] if pending_ancestors is None else pending_ancestors.shape[1],
        PENDING_IS_CHAIN=pending_ancestors is None, STATE_DOT=launch["state_dot"] and do_verify,
        EXACT_TF32=do_verify and state.dtype == mixed_qkv.dtype == torch.bfloat16, **options,
    )
    return out


def gdn_step_triton(
    mixed_qkv: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    output_gate: torch.Tensor,
    norm_weight: torch.Tensor,
    state: torch.Tensor,
    state_indices: torch.Tensor,
    parents: torch.Tensor,
    cu_nodes: torch.Tensor,
    *,
    factors: torch.Tensor,
    pending_nodes: torch.Tensor | None = None,
    pending_ancestors: torch.Tensor | None = None,
    num_key_heads: int,
    max_nodes: int,
    max_depth: int | None = None,
    chain: bool = False,
    scale: float | None = None,
    norm_eps: float = 1e-6,
    activation: str = "silu",
    ancestors: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    block_k: int | None = None,
    num_warps: int | None = None,
    prefetch: int | None = None,
    max_registers: int | None = None,
    row_sums: bool | None = None,
    late_node_terms: bool | None = None,
    state_dot: bool | None = None,
) -> torch.Tensor:
    """One GDN layer's speculative decode step after the conv: the normed, gated core output of every draft node;
    the factors of its commit go to the slots' rows. Same inputs as vLLM's `fused_gdn_decode_post_conv_mtp`:

    mixed_qkv [N, 2*H*K + HV*V] (post-conv q | k | v, row stride free, last dim contiguous); a, b [N, HV] (raw
    gate inputs); A_log, dt_bias [HV]; output_gate z [N, HV, V]; norm_weight [V]; state pool [S, HV, V, K] fp32 or
    bf16; state_indices [B] (negative: padding request, nothing read or written); parents [N] local, cu_nodes [B+1]
    (`vllm_treewy.tree.pack_trees`; requests may have 0 nodes); scale defaults to K**-0.5.
    factors: fp32 [S, T, F] (`slot_factor_width`; strides of the first two dims free, last dim contiguous), T >=
    max_nodes: request b's node t writes row factors[state_indices[b], t].
    pending_nodes: int32 [B] or None. pending_nodes[b] = a (0 <= a < T) first commits the slot's previous step in
    place, the path to node a from the rows the previous call left there (`gdn_commit_triton`); -1 leaves the slot
    as it is. pending_ancestors: the previous step's tree, shared by every slot (a static shape), as an int32 [T', D]
    ancestor table (T' <= T; row i: node i's d-th ancestors, d = 0 is i, -1 past the root;
    `vllm_treewy.kernels.triton._tree.ancestor_table`); None: a chain, a's path is 0..a. The verify then reads the
    committed state. One state read and (with a pending commit) one write per request.
    Returns out [N, HV, V] (mixed_qkv's dtype; `out` may be a [N, HV*V] view; padding requests' rows untouched).
    `ancestors`: as in `verify_packed_triton`. `row_sums`: one per-node sum per row, summed over the thread's BK
    columns every step (2T registers instead of 2T x BK); `late_node_terms`: gates, decays and Gram matrices
    computed after the state loop, so their [BT, BT] tiles are not live in it. `state_dot`: the products with the
    state on the tensor cores, [h k_0 .. h q_{T-1}] = h [V, BK] @ [k; q]^T per chunk (the state tile stays in the
    load's coalesced layout for the commit and its stores; block_k >= 16; T <= 8).
    No host sync, no data-dependent shapes: capturable in a CUDA graph."""
    return _launch(mixed_qkv, a, b, A_log, dt_bias, output_gate, norm_weight, state, state_indices, parents,
                   cu_nodes, factors, pending_nodes, pending_ancestors, num_key_heads=num_key_heads,
                   max_nodes=max_nodes, max_depth=max_depth, chain=chain, scale=scale, norm_eps=norm_eps,
                   activation=activation, ancestors=ancestors, out=out, do_verify=True, block_k=block_k,
                   num_warps=num_warps, prefetch=prefetch, max_registers=max_registers, row_sums=row_sums,
                   late_node_terms=late_node_terms, state_dot=state_dot)


def gdn_commit_triton(
    state: torch.Tensor,
    state_indices: torch.Tensor,
    factors: torch.Tensor,
    pending_nodes: torch.Tensor,
    *,
    num_key_heads: int,
    pending_ancestors: torch.Tensor | None = None,
    block_k: int | None = None,
    num_warps: int | None = None,
    prefetch: int | None = None,
    max_registers: int | None = None,
) -> None:
    """The pending commit alone, in place (for the end of a sequence, and tests): for each request b with slot
    s = state_indices[b] >= 0 and a = pending_nodes[b] >= 0, the slot's state becomes the state after node a, whose
    path (a and its ancestors: rows 0..a for a chain, else `pending_ancestors[a]`, as in `gdn_step_triton`) has its
    factors in rows factors[s, j]: h_a = exp(c_a) h0 + sum_{j on the path} exp(c_a - c_j) (u_j k_scale_j) k_j^T."""
    _launch(None, None, None, None, None, None, None, state, state_indices, None, None, factors, pending_nodes,
            pending_ancestors,
            num_key_heads=num_key_heads, max_nodes=1, max_depth=None, chain=True, scale=None, norm_eps=0.0,
            activation="silu", ancestors=None, out=None, do_verify=False, block_k=block_k, num_warps=num_warps,
            prefetch=prefetch, max_registers=max_registers)
