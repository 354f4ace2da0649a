"""The whole GDN decode step after the conv, for packed draft chains and small trees, in one launch or two: gates,
q/k L2 norm, the closed-form verify, the gated RMSNorm with the output gate, and optionally the previous step's
commit (the same inputs and output as vLLM's compiled `fused_gdn_decode_post_conv_mtp`, so the two compare like for
like). With `state_pass_rows` (the default for chains and trees of up to 8 nodes) the commit and the state's
products run first in their own launch, a head's value rows over several programs (`state_pass`), and the row
epilogue (`row_epilogue`) does the rest from their products (bench/results/kernels.md, 2026-12-02d).

    g_i    = -exp(A_log) * softplus(a_i + dt_bias)            beta_i = sigmoid(b_i)
    q_i    = scale * q_i / sqrt(|q_i|^2 + 1e-6)              k_i    = k_i / sqrt(|k_i|^2 + 1e-6)
    (o_i, u_i) = closed-form tree verify from h0 (design notes §1)
    o_i    <- o_i rounded to the output dtype (bf16 in vLLM), as vLLM's decode and compiled MTP kernel do
    out_i  = o_i * rsqrt(mean_v(o_i^2) + eps) * norm_weight * act(z_i)      act = silu or sigmoid

One program per (value head, request) holds a whole head: the state [V, K] is streamed once through registers in
key chunks of BK columns; with `heads_per_program=2` (tensor-core layout) one program holds both value heads of one
key head (where HV = 2H), which share the q/k chunks, the key norms and Gram matrices and the pending key rows:
half the programs (on the H200 the 16-bit-state default for large batches of 5-8 nodes or of more than 8; slower
than one head for fp32 states, 2026-12-01). Two layouts (launch option `state_dot`):
- tensor cores (default): the chunk keeps its load's layout (a warp covers 4 rows x 128 bytes: whole line segments,
  loads and the commit's stores coalesced); the commit's rank-one updates are elementwise in that layout, and all
  products with the state come from one tensor-core dot per chunk, [h k_0 .. h k_{T-1}, h q_0 .. h q_{T-1}] =
  h [V, BK] @ [k; q]^T [BK, 16] (state as the 128-row operand, nodes padded to 16 columns), fp32 operands: one
  tf32 pass when the state and q/k are bf16 (exact products), tf32x3 (hi + lo parts) for an fp32 state (~fp32:
  measured 1-2e-7 on u and the committed state at K=128 against fp64), or with `split_state_tf32` two tf32 passes
  (2xTF32: the state's hi and lo parts against the raw bf16 q/k, which are exact in tf32; the fp32 default since
  2026-12-01), or with `split_state_bf16` bf16 passes (an fp32 state in three bf16 pieces: 160.0 vs 2xTF32's 159.5
  us at B=64, 2026-12-01; a bf16 state in one, exact: the 16-bit-state default up to 4 nodes, and for 5-8 at small
  batches); `_state_products`.
  The [BK, 16] q/k chunks are prefetched with the state chunks.
- one value row per thread (`state_dot=False`): broadcast multiplies and fp32 sums on the CUDA cores, BK columns
  per row per step. Its partial-line stores stream at ~0.6 TB/s (2026-11-30); kept as the reference
  layout (no tf32 at all) and for block_k < 16.

Measured on the H200 (bench/results/kernels.md, 2026-12-01f and 2026-12-02, the launch defaults): fp32 state, chain
T=4, 1.44x / 1.53x vLLM's compiled kernel at B=64 / 256, 1.20x at B=1; T=2 1.07x and T=8 1.10x at B=64 (the solve
by dots); bf16 state T=4 1.07x / 1.14x, 1.28x at B=1 (two CTAs per SM), T=2 0.92x and T=8 0.79x at B=64.
The fp32 step is at 2.1x the two-state HBM bound at B=64: latency-bound. The sixth session's ncu stall samples (fp32
T=4 B=64, before the key-row prefetch and the accumulator-layout epilogue) put 53% in the state loop, waiting for
loads issued in the same iteration, and 38% in the epilogue's cross-lane reductions and barriers.

A whole head per program is what the gated RMSNorm needs (it normalises over V); in one kernel, splitting a head's
value rows over programs measured slower (kernels.md, 2026-12-02); the two-launch step splits the state pass only.
Trees work (ancestor table, as in `verify_packed_triton`;
tested in the interpreter up to 12 nodes, on the H200 up to 29): beyond 8 nodes the epilogue solves by tensor-core
products (`solve_by_dots`), 2.1-2.3x (fp32) and 1.7x (bf16) the per-node serial baseline at B=64 for [2,2,1] and
[4,2,2] as timed, when the Gram matrices' tf32x3 products still spilled; `verify_packed_triton` (no gates, norm or
commit fused, value tiles of 64) is the kernel family's tree verify on its own, 11x serial in bf16 on [4,2,2].

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
from triton.tools.tensor_descriptor import TensorDescriptor

from ..gated import slot_factor_width, split_slot_factors
from ._tree import _ancestor
from . import path_epilogue, row_epilogue, state_pass
from .gates import _gated_rms_norm, _inverse_norm, _log_decay, _output_gate
from .state_ops import (_committed_chunk, _factor_columns, _node_kq_columns, _operand_pieces, _pending_path,
                        _pending_values, _piece_products, _request_indices, _state_products)
from .verify import interpreting, max_ancestors, tree_ancestors

ACTIVATIONS = ("silu", "sigmoid")

__all__ = ["gdn_commit_triton", "gdn_step_triton", "slot_factor_width", "split_slot_factors"]


@triton.jit
def _in_accumulator_layout(h):
    """h [V, BK] fp32, the same values in the tensor cores' accumulator layout: the accumulator of a product of
    zeros (h + 0, exact). With `split_in_mma_layout` the chunk changes layout once here, and the state products'
    operands are split from it in registers (16-bit pieces as they are, tf32 ones after `_tf32_operand_order`)
    instead of each piece's own round trip through shared memory into the operand layout."""
    zeros_a = tl.zeros([h.shape[0], 16], dtype=tl.bfloat16)
    zeros_b = tl.zeros([16, h.shape[1]], dtype=tl.bfloat16)
    return tl.dot(zeros_a, zeros_b, h)


@triton.jit
def _tf32_operand_order(h):
    """h [V, BK] in the accumulator layout with its columns reordered in each block of 8, 2t + e -> 4e + t: there a
    thread holds columns 2t and 2t + 1 of a block, in a tf32 operand columns t and t + 4, so the reordered chunk is
    the operand with no data movement. The q/k rows take the same order (`_tf32_operand_columns`): the products sum
    over the columns, in any order."""
    V: tl.constexpr = h.shape[0]
    BK: tl.constexpr = h.shape[1]
    return tl.reshape(tl.permute(tl.reshape(h, [V, BK // 8, 4, 2]), (0, 1, 3, 2)), [V, BK])


@triton.jit
def _tf32_operand_columns(c):
    """The chunk column that column c of `_tf32_operand_order`'s result holds: 8j + 4e + t -> 8j + 2t + e."""
    return 8 * (c // 8) + 2 * (c % 4) + (c // 4) % 2


@triton.jit
def _node_columns(acc, BT: tl.constexpr):
    """The even and odd columns of a [V, NQ] tile in the tensor cores' accumulator layout as [V, BT] tiles, node t in
    column t (the accumulator's k_t at 2t and q_t at 2t + 1, or v_t and z_t; zeros from 2 BT on). There a thread
    holds the column pairs (2c, 2c + 1) and (2c + 8, 2c + 9), so the reshape and splits move no data. BT >= 4: the
    zero block (columns 8..15 at BT = 4) is the in-thread one."""
    V: tl.constexpr = acc.shape[0]
    NQ: tl.constexpr = acc.shape[1]
    if NQ == 4 * BT:
        nodes, zeros = tl.split(tl.permute(tl.reshape(acc, [V, 2, BT, 2]), (0, 2, 3, 1)))
    else:
        nodes = tl.reshape(acc, [V, BT, 2])
    return tl.split(nodes)


@triton.jit
def _gate_terms(a, b, A_log, dt_bias, ancestors, bos, n, i_hv, stride_a, stride_b, BT: tl.constexpr,
                MAX_ANC: tl.constexpr, IS_CHAIN: tl.constexpr):
    """One value head's gates of the nodes: g, beta, the path sums c and the decays exp(c_i - c_j) (running sums up
    the path: no differences of long path sums)."""
    neg_exp_a_log = -tl.exp(tl.load(A_log + i_hv).to(tl.float32))
    bias = tl.load(dt_bias + i_hv).to(tl.float32)
    rows = tl.arange(0, BT)
    valid = rows < n
    node = bos + rows
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
    return g_own, b_beta, running_c, tl.exp(log_decay)


@triton.jit
def _node_terms(a, b, A_log, dt_bias, ancestors, bos, n, q_row, k_row, i_hv0, scale, stride_a, stride_b,
                K: tl.constexpr, BT: tl.constexpr, G: tl.constexpr, MAX_ANC: tl.constexpr, IS_CHAIN: tl.constexpr,
                GRAM_BY_DOTS: tl.constexpr):
    """Everything per node that does not touch the state: the key head's q/k inverse norms and Gram matrices (once
    for the program's G value heads), and per value head i_hv0 + g the gates (`_gate_terms`, tuples over g).
    GRAM_BY_DOTS (BT >= 16): the Gram matrices as tensor-core products, of the 16-bit rows as they are (exact
    products), tf32x3 for fp32 rows."""
    rows = tl.arange(0, BT)
    valid = rows < n
    g_own = ()
    b_beta = ()
    path_c = ()
    decay = ()
    for g in tl.static_range(G):
        head_terms = _gate_terms(a, b, A_log, dt_bias, ancestors, bos, n, i_hv0 + g, stride_a, stride_b, BT,
                                 MAX_ANC, IS_CHAIN)
        g_own = g_own + (head_terms[0],)
        b_beta = b_beta + (head_terms[1],)
        path_c = path_c + (head_terms[2],)
        decay = decay + (head_terms[3],)
    # q/k norms and the small Gram matrices, from the whole rows (K elements; cached after the first touch)
    o_k = tl.arange(0, K)
    q_raw = tl.load(q_row[:, None] + o_k[None, :], mask=valid[:, None], other=0.0)
    k_raw = tl.load(k_row[:, None] + o_k[None, :], mask=valid[:, None], other=0.0)
    q_full = q_raw.to(tl.float32)
    k_full = k_raw.to(tl.float32)
    q_inv = _inverse_norm(q_full) * scale
    k_inv = _inverse_norm(k_full)
    if GRAM_BY_DOTS and q_raw.dtype == tl.float32:
        kk = tl.dot(k_full, tl.trans(k_full), input_precision="tf32x3")
        qk = tl.dot(q_full, tl.trans(k_full), input_precision="tf32x3")
    elif GRAM_BY_DOTS:  # 16-bit rows as they are: exact products, fp32 sums (tf32x3's split spilled at BT >= 16)
        kk = tl.dot(k_raw, tl.trans(k_raw))
        qk = tl.dot(q_raw, tl.trans(k_raw))
    else:  # one column j at a time: [BT, K] tiles, not [BT, BT, K] products (registers at T=8)
        kk = tl.zeros([BT, BT], dtype=tl.float32)
        qk = tl.zeros([BT, BT], dtype=tl.float32)
        for j in tl.static_range(BT):
            k_j = tl.sum(tl.where(rows[:, None] == j, k_full, 0.0), 0)
            kk = tl.where(rows[None, :] == j, tl.sum(k_full * k_j[None, :], 1)[:, None], kk)
            qk = tl.where(rows[None, :] == j, tl.sum(q_full * k_j[None, :], 1)[:, None], qk)
    kk = kk * (k_inv[:, None] * k_inv[None, :])
    qk = qk * (q_inv[:, None] * k_inv[None, :])
    return g_own, b_beta, path_c, decay, q_inv, k_inv, kk, qk


@triton.jit
def _epilogue_in_mma_layout(acc_kq, qkv, z, out, norm_weight, node, valid, b_beta, path_c, decay, q_inv, k_inv, kk,
                            qk, i_hv0, eps, stride_qkv, stride_z, stride_zh, stride_out, stride_outh, H: tl.constexpr,
                            K: tl.constexpr, V: tl.constexpr, G: tl.constexpr, BT: tl.constexpr, ACT: tl.constexpr,
                            MAX_ANC: tl.constexpr, SOLVE_BY_DOTS: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """The verify's epilogue with node t in column t of [V, BT] tiles in the accumulator's layout
    (EPILOGUE_IN_MMA_LAYOUT; interleaved q/k columns, `_node_columns`): stores the normed, gated outputs and returns
    per head u [V, BT].

    Row v of u depends only on row v of r = beta (v - exp(c) k_inv h k): (I + L) u_v = r_v with L the strictly lower
    matrix beta_i exp(c_i - c_j) k_i.k_j, so u = r T^T with T = (I + L)^-1 (unit lower triangular, forward
    substitution on the [BT, BT] matrix), and o = exp(c) q_inv h q + u P^T = exp(c) q_inv h q + r (P T)^T with
    P = exp(c_i - c_j) q_i.k_j. Each of u's and o's columns sums r's columns: one column of r at a time (a sum over
    the 4 lanes that share a row), no per-node rows to gather.
    SOLVE_BY_DOTS (trees, BT >= 16): BT column passes and the [BT, BT, BT] product P T cost too much there; instead
    u = r - u L^T, MAX_ANC times (L is nilpotent: its powers past the deepest path vanish, so this is the Neumann
    series to its last term, in Horner form), and o = exp(c) q_inv h q + u P^T, products of [V, BT] by [BT, BT] on
    the tensor cores (DOT_PRECISION: tf32x3 for an fp32 state)."""
    o_v = tl.arange(0, V)
    rows = tl.arange(0, BT)
    NQ: tl.constexpr = acc_kq[0].shape[1]
    w = tl.load(norm_weight + o_v).to(tl.float32)
    b_us = ()
    for g in tl.static_range(G):
        hk, hq = _node_columns(acc_kq[g], BT)
        head = i_hv0 + g
        # v and z in the accumulator's columns (v_t at 2t, z_t at 2t + 1), moved into its layout at once: loaded in
        # their own layout, they would pull the per-node math out of the accumulator's
        b_vz = tl.reshape(tl.join(
            tl.load(qkv + node.to(tl.int64)[None, :] * stride_qkv + 2 * H * K + head * V + o_v[:, None],
                    mask=valid[None, :], other=0.0).to(tl.float32),
            tl.load(z + node[None, :] * stride_z + head * stride_zh + o_v[:, None], mask=valid[None, :],
                    other=0.0).to(tl.float32)), [V, 2 * BT])
        if 2 * BT < NQ:  # zero columns up to the accumulator's 16: [V, 8] and zeros side by side
            b_vz = tl.reshape(tl.permute(tl.join(b_vz, tl.zeros_like(b_vz)), (0, 2, 1)), [V, NQ])
        b_v, b_z = _node_columns(_in_accumulator_layout(b_vz), BT)
        exp_c = tl.exp(path_c[g])
        b_r = b_beta[g][None, :] * (b_v - (exp_c * k_inv)[None, :] * hk)
        lower = tl.where(rows[None, :] != rows[:, None], b_beta[g][:, None] * decay[g] * kk, 0.0)
        if SOLVE_BY_DOTS:
            b_u = b_r
            for _ in tl.static_range(MAX_ANC):
                b_u = b_r - tl.dot(b_u, tl.trans(lower), input_precision=DOT_PRECISION)
            b_o = (exp_c * q_inv)[None, :] * hq + tl.dot(b_u, tl.trans(decay[g] * qk), input_precision=DOT_PRECISION)
        else:
            inverse = tl.where(rows[:, None] == rows[None, :], 1.0, 0.0)
            for i in tl.static_range(1, BT):  # rows above i are final when row i is solved
                l_row = tl.sum(tl.where(rows[:, None] == i, lower, 0.0), 0)
                inverse = tl.where(rows[:, None] == i, inverse - tl.sum(l_row[:, None] * inverse, 0)[None, :],
                                   inverse)
            p_inverse = tl.sum((decay[g] * qk)[:, :, None] * inverse[None, :, :], 1)
            b_u = tl.zeros([V, BT], dtype=tl.float32)
            b_o = (exp_c * q_inv)[None, :] * hq
            for j in tl.static_range(BT):  # r's column j: a sum over the 4 lanes of a quad
                r_j = tl.sum(tl.where(rows[None, :] == j, b_r, 0.0), 1)
                b_u += r_j[:, None] * tl.sum(tl.where(rows[None, :] == j, inverse, 0.0), 1)[None, :]
                b_o += r_j[:, None] * tl.sum(tl.where(rows[None, :] == j, p_inverse, 0.0), 1)[None, :]
        b_us = b_us + (b_u,)
        # gated RMSNorm over V (the rows), the core output rounded to the output dtype first, as in the other layout
        b_o = b_o.to(out.dtype.element_ty).to(tl.float32)
        rstd = tl.rsqrt(tl.sum(b_o * b_o, 0) / V + eps)
        y = b_o * rstd[None, :] * w[:, None] * _output_gate(b_z, ACT)
        tl.store(out + node[None, :] * stride_out + head * stride_outh + o_v[:, None], y.to(out.dtype.element_ty),
                 mask=valid[None, :])
    return b_us


# the integer-array pointers are read as scalars or gathers: their alignment buys nothing, and without the alignment
# key a caller's offset view cannot compile a second variant. The int arguments (strides) are model constants in vLLM
# (views of the projections, the pools and pages) and stay specialised: their divisibility by 16 vectorises the
# q/k/v/z loads (tests/kernels/test_jit_variants.py counts one variant across batch sizes)
@triton.jit(do_not_specialize=["state_indices", "ancestors", "cu_nodes", "pending_nodes", "pending_ancestors"])
def _gated_step_kernel(
    qkv, a, b, A_log, dt_bias, z, norm_weight, state, state_desc, state_indices, ancestors, cu_nodes, out, factors,
    pending_nodes, pending_ancestors,
    stride_qkv, stride_a, stride_b, stride_z, stride_zh, stride_out, stride_outh,
    stride_slot, stride_head, stride_v, stride_fslot, stride_frow,
    scale, eps,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, G: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, PREFETCH: tl.constexpr, ROW_SUMS: tl.constexpr,
    LATE_NODE_TERMS: tl.constexpr, MAX_ANC: tl.constexpr, IS_CHAIN: tl.constexpr,
    ACT: tl.constexpr, DO_VERIFY: tl.constexpr, HAS_PENDING: tl.constexpr, PENDING_ROWS: tl.constexpr,
    PENDING_IS_CHAIN: tl.constexpr, STATE_DOT: tl.constexpr, STATE_PRODUCTS: tl.constexpr,
    SPLIT_IN_MMA_LAYOUT: tl.constexpr, LAGGED_PRODUCTS: tl.constexpr, STATE_TMA: tl.constexpr,
    EPILOGUE_IN_MMA_LAYOUT: tl.constexpr, SOLVE_BY_DOTS: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    # value heads i_hv0 .. i_hv0 + G - 1 of request i_b, all of key head i_h (G divides HV // H); per-head values
    # are tuples indexed by g (and by j * G + g for the prefetched chunks, d * G + g for the pending rows)
    i_hv0, i_b = tl.program_id(0) * G, tl.program_id(1)
    i_h = i_hv0 // (HV // H)
    slot, accepted, _, _ = _request_indices(state_indices, pending_nodes, cu_nodes, i_b, HAS_PENDING, False)
    if slot < 0:
        return
    o_v = tl.arange(0, V)
    o_kc = tl.arange(0, BK)
    p_state = ()
    for g in tl.static_range(G):
        p_state = p_state + (state + slot * stride_slot + (i_hv0 + g) * stride_head + o_v[:, None] * stride_v,)
    # this program's columns of the slot's factor rows (see `slot_factor_width`): only (slot, its heads) touches
    # them; head i_hv0 + g's at + g (k scale, g) or + g * K / + g * V (keys, u). The pending commit reads the key
    # and k scale copies of head i_hv0 for all G heads: one key head's copies are equal (the contract)
    f_k, f_kscale, f_u, f_g = _factor_columns(factors, slot, stride_fslot, i_hv0, HV, K, V)
    # the first PREFETCH state chunks in flight before anything else (everything below is independent of them);
    # STATE_TMA: Triton's pipeliner issues them (bulk copies into shared memory, see the loop)
    ahead = ()
    if not STATE_TMA:
        for j in tl.static_range(PREFETCH):
            for g in tl.static_range(G):
                ahead = ahead + (tl.load(p_state[g] + (j * BK + o_kc)[None, :], mask=j * BK < K, other=0.0),)

    if HAS_PENDING:
        # the previous step's path to its accepted node a (`_pending_path`): per row the key row, and per head
        # exp(c_a - c_j) u_j / |k_j| as a [V] vector; exp(c_a) for h0. Every pending row is read before the epilogue
        # overwrites the rows (barrier there).
        p_rows, p_on, p_weight, p_root = _pending_path(
            accepted, pending_ancestors, f_kscale, f_g, stride_frow, G, PENDING_ROWS, PENDING_IS_CHAIN)
        p_wu = _pending_values(f_u, p_rows, p_on, p_weight, o_v, V, G, PENDING_ROWS)
        p_krow = ()
        for d in tl.static_range(PENDING_ROWS):
            p_krow = p_krow + (f_k + p_rows[d],)
        # the key rows' first PREFETCH chunks in flight like the state's (chunk j's row d at j * PENDING_ROWS + d):
        # loaded in the iteration that used them, they were the loop's hottest stall (ncu, 2026-12-01). STATE_TMA:
        # the loop loads them, for the pipeliner. Two heads too: there the prefetch coincided with a slower commit
        # (kernels.md, 2026-12-01f) and more spill (offline sm_90, T=8 fused: 584 bytes of stack against 256)
        PREFETCH_PENDING_KEYS: tl.constexpr = not STATE_TMA and G == 1
        ahead_pk = ()
        if PREFETCH_PENDING_KEYS:
            for j in tl.static_range(PREFETCH):
                for d in tl.static_range(PENDING_ROWS):
                    ahead_pk = ahead_pk + (tl.load(p_krow[d] + j * BK + o_kc, mask=p_on[d] & (j * BK + o_kc < K),
                                                   other=0.0),)
        store_commit = (o_v[:, None] * 0 + accepted) >= 0  # as a tile: a scalar mask does not broadcast everywhere

    if DO_VERIFY:
        bos = tl.load(cu_nodes + i_b)
        n = tl.load(cu_nodes + i_b + 1) - bos
        rows = tl.arange(0, BT)
        valid = rows < n
        node = bos + rows
        q_row = qkv + node.to(tl.int64) * stride_qkv + i_h * K
        k_row = q_row + H * K
        if not LATE_NODE_TERMS:
            g_own, b_beta, path_c, decay, q_inv, k_inv, kk, qk = _node_terms(
                a, b, A_log, dt_bias, ancestors, bos, n, q_row, k_row, i_hv0, scale, stride_a, stride_b, K, BT, G,
                MAX_ANC, IS_CHAIN, SOLVE_BY_DOTS)
        if not STATE_DOT:  # the row layout's per-node q/k row offsets
            row_off = ()
            row_ok = ()
            for t in tl.static_range(BT):
                row_off = row_off + ((bos + t).to(tl.int64) * stride_qkv,)
                row_ok = row_ok + (t < n,)
        else:
            # EPILOGUE_IN_MMA_LAYOUT: k_t and q_t side by side, as that epilogue reads them (`_node_columns`)
            NQ: tl.constexpr = max(16, 2 * BT)
            o_q = tl.arange(0, NQ)
            kq_row, kq_ok = _node_kq_columns(qkv, bos, n, stride_qkv, i_h, H, K, BT, EPILOGUE_IN_MMA_LAYOUT)

    # the state, BK key columns at a time; PREFETCH chunks (state, q/k and, one head a program, pending key rows)
    # are in flight ahead of the one in use, loaded before the commit stores the current chunk. STATE_DOT: one
    # [V, 16] accumulator of tensor-core products per head, the [BK, 16] q/k chunk shared by the G heads. Else
    # (G = 1, BK columns per value row) each thread owns whole value rows, and every product with the state
    # accumulates elementwise into per-node [V, BK] partial sums (no reduction, no shuffle, no layout change inside
    # the loop)
    if DO_VERIFY:
        if STATE_DOT:
            acc_kq = ()
            for g in tl.static_range(G):
                acc_kq = acc_kq + (tl.zeros([V, NQ], dtype=tl.float32),)
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
        if SPLIT_IN_MMA_LAYOUT and STATE_PRODUCTS != "3xbf16" and STATE_PRODUCTS != "bf16":  # tf32 operand order
            o_kq = _tf32_operand_columns(o_kc)
        else:
            o_kq = o_kc
        ahead_kq = ()
        if not STATE_TMA:
            for j in tl.static_range(PREFETCH):
                ahead_kq = ahead_kq + (tl.load(kq_row[None, :] + (j * BK + o_kq)[:, None],
                                               mask=kq_ok[None, :] & (j * BK < K), other=0.0),)
    # LAGGED_PRODUCTS: a chunk's products come one iteration later (one more iteration, the first on zero pieces),
    # from its operand pieces carried through the loop: a loop-carried operand goes to the tensor cores from shared
    # memory (one store per piece), not back through shared memory into registers
    if DO_VERIFY and LAGGED_PRODUCTS:
        lagged = ()
        for g in tl.static_range(G):
            lagged = lagged + (_operand_pieces(tl.zeros([V, BK], dtype=tl.float32),
                                               tl.zeros([BK, NQ], dtype=tl.float32), STATE_PRODUCTS),)
    # a loop, not unrolled: unrolled, the compiler hoists the small q/k loads of many chunks and runs out of
    # registers; in flight stay the PREFETCH chunks ahead. STATE_TMA: the loop loads chunk i_k itself and Triton's
    # pipeliner turns the loads into asynchronous copies (TMA for the state, tracked by mbarriers; cp.async for q/k
    # and the pending key rows): no register load is outstanding at the tensor-core products' proxy fences. Triton
    # 3.6 gives num_stages - 1 buffers and issues chunk i + num_stages - 1 at the end of iteration i, so PREFETCH + 2
    # stages keep PREFETCH chunks in flight while a chunk is worked on
    for i_k in tl.range(0, K // BK + LAGGED_PRODUCTS, num_stages=PREFETCH + 2 if STATE_TMA else 1):
        if DO_VERIFY and LAGGED_PRODUCTS:
            products = ()
            for g in tl.static_range(G):
                products = products + (_piece_products(lagged[g][0], lagged[g][1], acc_kq[g], STATE_PRODUCTS),)
            acc_kq = products
        cols = i_k * BK + o_kc
        hs = ()
        if STATE_TMA:  # columns past K (the lagged iteration's) arrive as zeros
            for g in tl.static_range(G):
                chunk = state_desc.load([slot.to(tl.int32), i_hv0 + g, 0, i_k * BK])
                hs = hs + (chunk.reshape([V, BK]).to(tl.float32),)
        else:
            for g in tl.static_range(G):
                hs = hs + (ahead[g].to(tl.float32),)
            rest = ()
            for j in tl.static_range(G, PREFETCH * G):
                rest = rest + (ahead[j],)
            for g in tl.static_range(G):
                rest = rest + (tl.load(p_state[g] + (cols + PREFETCH * BK)[None, :],
                                       mask=(i_k + PREFETCH) * BK < K, other=0.0),)
            ahead = rest
        if DO_VERIFY and STATE_DOT:
            if STATE_TMA:
                kq = tl.load(kq_row[None, :] + (i_k * BK + o_kq)[:, None], mask=kq_ok[None, :] & (i_k * BK < K),
                             other=0.0).to(tl.float32)
            else:
                kq = ahead_kq[0].to(tl.float32)
                rest = ()
                for j in tl.static_range(1, PREFETCH):
                    rest = rest + (ahead_kq[j],)
                ahead_kq = rest + (tl.load(kq_row[None, :] + ((i_k + PREFETCH) * BK + o_kq)[:, None],
                                           mask=kq_ok[None, :] & ((i_k + PREFETCH) * BK < K), other=0.0),)
        if HAS_PENDING:
            p_k = ()
            if not PREFETCH_PENDING_KEYS:
                for d in tl.static_range(PENDING_ROWS):
                    p_k = p_k + (tl.load(p_krow[d] + cols, mask=p_on[d] & (cols < K), other=0.0),)
            else:
                for d in tl.static_range(PENDING_ROWS):
                    p_k = p_k + (ahead_pk[d],)
                rest = ()
                for j in tl.static_range(PENDING_ROWS, PREFETCH * PENDING_ROWS):
                    rest = rest + (ahead_pk[j],)
                for d in tl.static_range(PENDING_ROWS):
                    rest = rest + (tl.load(p_krow[d] + cols + PREFETCH * BK, mask=p_on[d] & (cols + PREFETCH * BK < K),
                                           other=0.0),)
                ahead_pk = rest
            committed = ()
            for g in tl.static_range(G):
                h = _committed_chunk(hs[g], p_root[g], p_wu, p_k, g, G, PENDING_ROWS).to(state.dtype.element_ty)
                tl.store(p_state[g] + cols[None, :], h, mask=store_commit & (cols < K)[None, :])
                committed = committed + (h.to(tl.float32),)
            hs = committed
        if DO_VERIFY and STATE_DOT:
            # every h k_t and h q_t of the chunk in one tensor-core product per head, the state as the 128-row
            # operand
            products = ()
            for g in tl.static_range(G):
                h = hs[g]
                if SPLIT_IN_MMA_LAYOUT:
                    h = _in_accumulator_layout(h)
                    if STATE_PRODUCTS != "3xbf16" and STATE_PRODUCTS != "bf16":
                        h = _tf32_operand_order(h)
                if LAGGED_PRODUCTS:
                    products = products + (_operand_pieces(h, kq, STATE_PRODUCTS),)
                else:
                    products = products + (_state_products(h, kq, acc_kq[g], STATE_PRODUCTS),)
            if LAGGED_PRODUCTS:
                lagged = products
            else:
                acc_kq = products
        if DO_VERIFY and not STATE_DOT:
            h = hs[0]
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
        # LATE_NODE_TERMS: nothing of this is needed in the loop; late, its [BT, BT] tiles stay out of the loop's
        # registers
        if LATE_NODE_TERMS:
            g_own, b_beta, path_c, decay, q_inv, k_inv, kk, qk = _node_terms(
                a, b, A_log, dt_bias, ancestors, bos, n, q_row, k_row, i_hv0, scale, stride_a, stride_b, K, BT, G,
                MAX_ANC, IS_CHAIN, SOLVE_BY_DOTS)
        if EPILOGUE_IN_MMA_LAYOUT:
            b_us = _epilogue_in_mma_layout(acc_kq, qkv, z, out, norm_weight, node, valid, b_beta, path_c, decay, q_inv,
                                           k_inv, kk, qk, i_hv0, eps, stride_qkv, stride_z, stride_zh, stride_out,
                                           stride_outh, H, K, V, G, BT, ACT, MAX_ANC, SOLVE_BY_DOTS, DOT_PRECISION)
        else:
            # per head: h k_t, h q_t as [BT, V] tiles, r = beta (v - exp(c) h k), the solve's off-diagonal matrix
            # beta_i exp(c_i - c_j) k_i.k_j; the norm's inputs (z, weight) in flight before the solve's loop
            w = tl.load(norm_weight + o_v).to(tl.float32)
            exp_c = ()
            hqs = ()
            b_us = ()
            gmats = ()
            b_zs = ()
            for g in tl.static_range(G):
                exp_c = exp_c + (tl.exp(path_c[g]),)
                hk = tl.zeros([BT, V], dtype=tl.float32)
                hq = tl.zeros([BT, V], dtype=tl.float32)
                for t in tl.static_range(BT):
                    if STATE_DOT:
                        hk = tl.where(rows[:, None] == t,
                                      tl.sum(tl.where(o_q[None, :] == t, acc_kq[g], 0.0), 1)[None, :], hk)
                        hq = tl.where(rows[:, None] == t,
                                      tl.sum(tl.where(o_q[None, :] == BT + t, acc_kq[g], 0.0), 1)[None, :], hq)
                    elif ROW_SUMS:
                        hk = tl.where(rows[:, None] == t, acc_k[t][None, :], hk)
                        hq = tl.where(rows[:, None] == t, acc_q[t][None, :], hq)
                    else:
                        hk = tl.where(rows[:, None] == t, tl.sum(acc_k[t], 1)[None, :], hk)
                        hq = tl.where(rows[:, None] == t, tl.sum(acc_q[t], 1)[None, :], hq)
                b_v = tl.load(qkv + node.to(tl.int64)[:, None] * stride_qkv + 2 * H * K + (i_hv0 + g) * V
                              + o_v[None, :], mask=valid[:, None], other=0.0).to(tl.float32)
                b_us = b_us + (b_beta[g][:, None] * (b_v - exp_c[g][:, None] * (hk * k_inv[:, None])),)
                hqs = hqs + (hq * q_inv[:, None],)
                gmats = gmats + (tl.where(rows[None, :] != rows[:, None], b_beta[g][:, None] * decay[g] * kk, 0.0),)
                b_zs = b_zs + (tl.load(z + node[:, None] * stride_z + (i_hv0 + g) * stride_zh + o_v[None, :],
                                       mask=valid[:, None], other=0.0).to(tl.float32),)
            # forward substitution, the heads side by side: rows above i are final when row i is solved
            for i in range(1, n):
                solved = ()
                for g in tl.static_range(G):
                    g_row = tl.sum(tl.where(rows[:, None] == i, gmats[g], 0.0), 0)
                    solved = solved + (tl.where(rows[:, None] == i,
                                                b_us[g] - tl.sum(g_row[:, None] * b_us[g], 0)[None, :], b_us[g]),)
                b_us = solved
            for g in tl.static_range(G):
                pmat = decay[g] * qk
                b_o = exp_c[g][:, None] * hqs[g]
                for j in tl.static_range(BT):  # one node's u at a time: no [BT, BT, V] product (registers at T=8)
                    u_j = tl.sum(tl.where(rows[:, None] == j, b_us[g], 0.0), 0)
                    p_j = tl.sum(tl.where(rows[None, :] == j, pmat, 0.0), 1)
                    b_o += p_j[:, None] * u_j[None, :]
                # gated RMSNorm over the head's V values, output gate fused; the core output rounded to the output
                # dtype first, as vLLM's non-speculative decode stores it (and its compiled MTP kernel rounds it)
                b_o = b_o.to(out.dtype.element_ty).to(tl.float32)
                y = _gated_rms_norm(b_o, w[None, :], b_zs[g], eps, V, ACT)
                tl.store(out + node[:, None] * stride_out + (i_hv0 + g) * stride_outh + o_v[None, :],
                         y.to(out.dtype.element_ty), mask=valid[:, None])
        # this step's factors into the slot's rows, after every thread's last read of the pending rows
        tl.debug_barrier()
        _store_factors(k_row, f_k, f_kscale, f_u, f_g, valid, k_inv, b_us, g_own, stride_frow, K, V, G, BT,
                       EPILOGUE_IN_MMA_LAYOUT)


@triton.jit
def _store_factors(k_row, f_k, f_kscale, f_u, f_g, valid, k_inv, b_us, g_own, stride_frow, K: tl.constexpr,
                   V: tl.constexpr, G: tl.constexpr, BT: tl.constexpr, U_IN_COLUMNS: tl.constexpr):
    """This step's factors into the slot's rows (`_factor_columns`), one copy per value head: the raw keys (reloaded
    here rather than kept live through the state loop), their inverse norms, u (U_IN_COLUMNS: [V, BT] tiles, else
    [BT, V]) and the log decays."""
    f_row = tl.arange(0, BT).to(tl.int64) * stride_frow
    o_k = tl.arange(0, K)
    o_v = tl.arange(0, V)
    k_raw = tl.load(k_row[:, None] + o_k[None, :], mask=valid[:, None], other=0.0).to(tl.float32)
    for g in tl.static_range(G):
        tl.store(f_k + g * K + f_row[:, None] + o_k[None, :], k_raw, mask=valid[:, None])
        tl.store(f_kscale + g + f_row, k_inv, mask=valid)
        if U_IN_COLUMNS:
            tl.store(f_u + g * V + f_row[None, :] + o_v[:, None], b_us[g], mask=valid[None, :])
        else:
            tl.store(f_u + g * V + f_row[:, None] + o_v[None, :], b_us[g], mask=valid[:, None])
        tl.store(f_g + g + f_row, g_own[g], mask=valid)


# Launch defaults: the fastest candidates measured correct on the H200 at H=16, HV=32, K=V=128, chain T=4. Until
# 2026-12-01d (bench/results/2026-12-01/device/gated.json, tuned at B=1 and B=64; what T <= 2 and trees of more than
# 8 nodes still run, and 16-bit states of 5-8 nodes at B > 8 apart from the epilogue): fp32 states: the
# tensor-core layout, block_k 32, 8 warps, 2xTF32 (159.5 / 14.4 us at B=64 / 1, against tf32x3's 163.8 / 14.6).
# 16-bit states: the tensor-core layout; few requests want 8 warps on one head's 64-column chunks (12.4 us at B=1;
# 32/4/1 with two heads: 20.2), many want two value heads per program at 32/4/1 (128.5 us at B=64; one head 64/4/1:
# 141.0; 64/8/1: 189.4).
# Between B=1 and B=64 the crossover is not measured; SMALL_BATCH puts B=8 with B=1. fp32 states with 5-8 nodes
# (T=8 measured, `results/2026-12-01b/device/gated.json`) and many requests took two value heads per program at
# 16/8/1 (593.4 us at B=64 against 677.8 for one head at 32/8/1; at B=1 one head stayed, 42.8 against 72.4).
# Since 2026-12-01d (`bench/results/2026-12-01d/device/gated.json`, kernels.md, seventh session), for 3-8 nodes (T=4
# tuned, T=2 and T=8 run with the T=4 choice; T=3 and T=5-7 not run, taken with their neighbours):
# - fp32, 3-8 nodes: the same 32/8/1 2xTF32 with `epilogue_in_mma_layout` (FP32_STATE_EPILOGUE_LAUNCH), every batch.
#   T=4: 133.85 / 11.50 us at B=64 / 1 against 145.75 / 12.69 without, same run; T=8: 302.2 / 24.3 us at B=64 / 1,
#   against 558.9 for the two-heads 16/8/1 rule (gone) / 41.0 for one head without (2026-12-01c; vLLM's compiled
#   349.8 / 22.5). At T=2 it measured 124.1 at B=64 against the old default's 113.2 (2026-12-01c, another run):
#   T <= 2, and trees of more than 8 nodes (not measured), keep FP32_STATE_LAUNCH.
# - 16-bit states, 3-4 nodes: 64/8/1 with `split_state_bf16` (HALF_STATE_BF16_LAUNCH), every batch: 127.3 / 10.55 us
#   at B=64 / 1 against 147.2 (32/4/1 two heads, the old large-batch default) / 11.26 (64/8/1 one tf32 pass, the old
#   small-batch default), same run. The bf16 pass needs a bf16 state and bf16 q/k (`_state_products_mode`); an fp16
#   state (or fp32 q/k) runs the same 64/8/1 with its tf32 (tf32x3) pass, for which this run has 140.8 us at B=64
#   against two heads' 147.2 (the sixth session had 148.3 against 129.7: not settled). Not at T=8 (515 us at B=64
#   against the old default's 337, 2026-12-01c) nor at T=2 (81.1 against 77.0): the old rules there.
# Since 2026-12-01e (`bench/results/2026-12-01e/device/gated.json`, eighth session, T=4 and T=8 tuned at B=64 / 1):
# two CTAs per SM for 16-bit states. 64/8/1 with the bf16 pass takes 166 registers (one CTA per SM); capped at 128
# (`max_registers`, no spill in the offline sm_90 compile) and with the accumulator-layout epilogue it is
# HALF_STATE_BF16_LAUNCH: T=4 98.8 / 9.44 us at B=64 / 1 against 162.2 / 10.59 uncapped without the epilogue, same
# run (2026-12-01d had 127.3 for that one); vLLM's compiled 106.3 / 12.2. 5-8 nodes (T=8): few requests take the same
# (23.9 us at B=1 against 39.6 for the old 64/8/1 tf32 pass; compiled 19.4), many take two heads 32/4/1 with the
# epilogue (251.0 at B=64 against 369.5 for the old two heads without; compiled 198.7). T <= 2 kept the old rules
# (T=2 ran with T=4's choice: 88.7 us at B=64 against 77.0 for the old rule in 2026-12-01c, another run).
# Since 2026-12-01f (`bench/results/2026-12-01f/device/gated.json`, tenth session): 16-bit states with 1-2 nodes at
# B > 8 take HALF_STATE_BF16_LAUNCH too. The old rule (two heads 32/4/1) ran 116.7 / 497.9 us at T=2, B=64 / 256
# there (77.0 at B=64 in 2026-12-01c; its commit part grew, kernels.md), against 88.7 / 325.1 for
# HALF_STATE_BF16_LAUNCH at T=2 in 2026-12-01e, which holds between runs at T=4 (98.8 e, 98.9 f). Not yet one run.
# Since 2026-12-02 (`bench/results/2026-12-02/device/gated.json`, T=2 tuned at B=64 / 1): 16-bit states with 1-2
# nodes take HALF_STATE_FEW_NODES_LAUNCH at every batch, 64/8/1 with the bf16 pass, uncapped, without the epilogue:
# 69.8 / 7.0 us at B=64 / 1 against 89.3 / 8.7 for HALF_STATE_BF16_LAUNCH and 76.9 / 13.4 for two heads 32/4/1, same
# run (the small-batch rule's tf32 pass, 64/8/1, measured 7.75 at B=1 in 2026-12-01f, another run).
# Also since 2026-12-02, the epilogue's solve by tensor-core products (`solve_by_dots`, nodes padded to 16):
# - more than 8 nodes (trees), every state (`results/2026-12-02/trees_solve_by_dots/`, B=64, root + N nodes, the
#   previous step's deepest leaf committed): fp32 32/8/1 2xTF32 (FP32_STATE_SOLVE_BY_DOTS_LAUNCH) [2,2,1] 278.7 /
#   [4,2,2] 723.6 us against 1082.4 / 2486.2 for the rule before (FP32_STATE_LAUNCH; `results/2026-12-02/trees/`,
#   another run), 16/8/1 436.5 / 903.6; 16-bit states 64/8/1 with the bf16 pass uncapped
#   (HALF_STATE_SOLVE_BY_DOTS_LAUNCH) 212.5 / 626.3 against 595.3 / 1596.6 (two heads 32/4/1), 32/8/1 304.0 / 804.3,
#   64/8/1 capped at 128 registers 489.8 / 1476.0.
# - fp32 states with 5-8 nodes, every batch (`results/2026-12-02/t8_solve_by_dots/`, chain T=8 tuned at B=64 / 1):
#   317.6 / 19.9 us against the epilogue's 401.8 / 24.5 and 16/8/1 capped 387.1 / 25.5, same run (vLLM's compiled
#   349.7 / 22.4). T=5-7 not run, taken with T=8. 16-bit states with 5-8 nodes keep their rules: a chain of 8 nodes
#   as a tree, B=64, 247.7 us by dots against 223.3 for two heads (`trees_solve_by_dots/`).
# Since 2026-12-02b (`results/2026-12-02b/kernels/trees.json`, thirteenth session, B=64): fp32 states with more than
# 8 nodes (trees) cap the by-dots launch at 128 registers (two CTAs per SM; FP32_STATE_TREE_LAUNCH): [2,2,1] 161.0 /
# [4,2,2] 263.8 us against 224.1 / 306.6 uncapped, same run (per-node serial 573.7 / 1696.4). 16-bit trees keep the
# uncapped launch: capped won on bf16 [2,2,1] (113.6 against 163.0) but [4,2,2] was not timed, and capped lost there
# by 2.4x before the Gram matrices stopped spilling (2026-12-02).
FP32_STATE_LAUNCH = dict(block_k=32, num_warps=8, prefetch=1, max_registers=0, row_sums=False,
                         late_node_terms=True, state_dot=True, split_state_tf32=True, split_state_bf16=False,
                         heads_per_program=1, split_in_mma_layout=False, lagged_products=False, tma_state=False,
                         epilogue_in_mma_layout=False, solve_by_dots=False, state_pass_rows=0,
                         state_pass_block_k=128, state_pass_warps=4, dependent_launch=False,
                         path_epilogue_nodes=0)
FP32_STATE_EPILOGUE_LAUNCH = dict(FP32_STATE_LAUNCH, epilogue_in_mma_layout=True)
HALF_STATE_LAUNCH = dict(FP32_STATE_LAUNCH, split_state_tf32=False)
HALF_STATE_BF16_LAUNCH = dict(HALF_STATE_LAUNCH, block_k=64, split_state_bf16=True, max_registers=128,
                              epilogue_in_mma_layout=True)
# Since 2026-12-02e (`results/2026-12-02e/kernels/trees.json`, seventeenth session, B=64, one run): 16-bit states with
# 9-16 nodes (trees; nodes padded to 16) cap the by-dots launch at 128 registers, two CTAs per SM: [2,2,1] (11 nodes)
# 113 us against 163.3 uncapped. More than 16 nodes (padded to 32) keep it uncapped: [4,2,2] (29 nodes) 229.9 against
# 254 capped at 128 (376 bytes spilled there, offline sm_90) and 227 at 168 (still one CTA per SM; not taken).
# The one-kernel tree launches named above (FP32_STATE_SOLVE_BY_DOTS_LAUNCH, FP32_STATE_TREE_LAUNCH,
# HALF_STATE_FEW_NODES_LAUNCH, HALF_STATE_SOLVE_BY_DOTS_LAUNCH, HALF_STATE_SMALL_TREE_LAUNCH) were removed with
# TREE_TWO_LAUNCH below (2026-12-03b); `bench/gated_bench.py` TREE_CONFIGS keeps the last ones as candidates.
# Since 2026-12-02c (`results/2026-12-02c/kernels/t4c.json` and `rows.json`, fifteenth session, T=4 tuned at B=64):
# 3-4 nodes and more than SMALL_BATCH requests take two launches, the state pass (`state_pass`) and then the
# epilogue kernel, one warp a program: fp32 64 value rows / 64 key columns / 4 warps with 3xBF16 products, 101.4 us
# at B=64 against the one kernel's 133.9 (state pass 83.6, epilogue 16.4; 32 rows: 106.4, 88.9 + 16.5, the pass
# alone without products 72.5; with 2xTF32 products 126.8); 16-bit 128 rows / 128 columns / 8 warps with the bf16
# pass, 67.8 against 99.1 (50.2 + 17.3). Epilogues of 2 and 4 warps: 24.3 / 42.3 us (fp32). At B=1 the one kernel
# stays (11.7 / 9.5 us against 12.8 / 11.4 for two launches); B=8 is taken with B=1 (not measured with two).
# Since 2026-12-02d (`results/2026-12-02d/kernels/final.json`, sixteenth session, chains of T = 2, 4, 8 tuned at
# B = 64, 8, 1; `t4.json` the same day, the first version against the accumulator-layout epilogue kernel): every
# chain or tree of at most 8 nodes takes two launches, the state pass and then the row epilogue (`row_epilogue`,
# one warp a program) as its programmatic dependent. The state pass: fp32 64 value rows / 64 key columns / 4 warps
# with 3xBF16 products (FP32_STATE_TWO_LAUNCH) for 3-4 nodes at more than FEW_REQUESTS requests, and for 1-2 nodes
# at FEW_REQUESTS..SMALL_BATCH; 16-bit 128 rows / 128 columns / 8 warps with the bf16 pass (HALF_STATE_TWO_LAUNCH)
# for 3-4 nodes at more than SMALL_BATCH, 64 / 64 / 4 at FEW_REQUESTS..SMALL_BATCH; everything else 16 rows / 128
# columns / 2 warps (*_16_ROWS). T=4 (us, fp32 / bf16): B=64 89.9 / 60.0 against the one kernel's 133.9 / 98.8;
# B=8 16.4 / 12.1 against 19.5 / 14.6 (16 rows 18.3 / 13.1); B=1 with 16 rows 6.9 / 6.0 against 11.6 / 9.5. T=8:
# 16 rows at B = 64 / 8 / 1 138.7 / 24.2 / 10.4 (fp32; the one kernel's solve by dots 259.2 / 34.8 / 16.2) and
# 105.0 / 20.1 / 10.0 (bf16; its rules 218.6 / 43.3 / 23.9). T=2: fp32 16 rows 83.0 / 5.6 at B = 64 / 1, 64 rows
# 14.2 at B=8 (the one kernel 108.1 / 9.0 / 16.1); bf16 16 rows 46.9 / 8.9 / 4.7 (70.7 / 11.0 / 7.1). B=2 and 4 ran
# with B=1's choice, B=256 with B=64's. Trees of more than 8 nodes keep the one kernel (the row epilogue's static
# per-node loops stop at 8).
FP32_STATE_TWO_LAUNCH = dict(FP32_STATE_EPILOGUE_LAUNCH, split_state_bf16=True, num_warps=1, state_pass_rows=64,
                             state_pass_block_k=64, state_pass_warps=4, dependent_launch=True)
FP32_STATE_TWO_LAUNCH_16_ROWS = dict(FP32_STATE_TWO_LAUNCH, state_pass_rows=16, state_pass_block_k=128,
                                     state_pass_warps=2)
HALF_STATE_TWO_LAUNCH = dict(HALF_STATE_BF16_LAUNCH, block_k=32, num_warps=1, max_registers=0, state_pass_rows=128,
                             state_pass_block_k=128, state_pass_warps=8, dependent_launch=True)
HALF_STATE_TWO_LAUNCH_64_ROWS = dict(HALF_STATE_TWO_LAUNCH, state_pass_rows=64, state_pass_block_k=64,
                                     state_pass_warps=4)
HALF_STATE_TWO_LAUNCH_16_ROWS = dict(HALF_STATE_TWO_LAUNCH, state_pass_rows=16, state_pass_warps=2)
# Since 2026-12-03b (`results/2026-12-03b/kernels/trees.json` and `trees_final.json`, twentieth session, root + N
# nodes, the previous step's deepest leaf committed): trees of more than 8 nodes take two launches too, every state:
# the state pass (the bf16 pass; 3xBF16 for fp32 states) and the path epilogue (`path_epilogue`: each node solved
# from its own path) as its dependent; above FEW_REQUESTS requests 64 rows / 64 columns / 4 warps and 4 nodes an
# epilogue program over 2 warps (TREE_TWO_LAUNCH), up to it 16 rows / 128 columns / 2 warps and 8 nodes over 4 warps
# (TREE_TWO_LAUNCH_16_ROWS; B=2-4 not run, as for chains). B=64: bf16 [4,2,2] / [2,2,1] 159.0 / 95.3 us against the
# one kernel's 230.2 / 113.7 (HALF_STATE_SOLVE_BY_DOTS_LAUNCH / HALF_STATE_SMALL_TREE_LAUNCH), fp32 190.0 / 125.4
# against 261.0 / 158.9 (FP32_STATE_TREE_LAUNCH), same run; per-node serial 1048.5 / 368.2 and 1706.3 / 580.1. B=256:
# bf16 635.4 / 377.7 against 875.2 / 425.0, fp32 758.8 / 492.7 against 980.8 / 582.3. B=1 (16 rows): bf16 6.72 / 6.10
# against 13.81 / 10.72, fp32 7.35 / 7.00 against 20.69 / 13.46 (TREE_TWO_LAUNCH 7.85 / 7.69 and 9.35 / 8.84). Other
# tiles at B=64 (bf16 [4,2,2] / [2,2,1]): epilogue programs of 8 nodes over 4 warps 162.3 / 105.2, 2 over 1 159.6 /
# 97.9, 16 over 4 226.3 / 126.7; state passes of 128 / 32 / 16 rows 185.7 / 169.4 / 181.0 on [4,2,2]. At B=256 8
# nodes over 4 warps tied on [4,2,2] (628.2 / 751.6, bf16 / fp32) and lost on [2,2,1] (408.9 / 524.4).
# Chains keep the row epilogue: the path epilogue of 1-4 nodes a program ran 13.8-15.9 us alone against its 8.6 (bf16
# T=4 B=64; the step 63.7-65.9 against 59.9; fp32 89.0-91.3 against 85.6; `chains.json`).
TREE_TWO_LAUNCH = dict(FP32_STATE_TWO_LAUNCH, num_warps=2, path_epilogue_nodes=4)
TREE_TWO_LAUNCH_16_ROWS = dict(TREE_TWO_LAUNCH, state_pass_rows=16, state_pass_block_k=128, state_pass_warps=2,
                               num_warps=4, path_epilogue_nodes=8)
FEW_REQUESTS = 4
SMALL_BATCH = 8


# heads narrower than a tensor-core dot's 16 columns (test shapes): one value row per thread, with row sums
NARROW_HEAD_LAUNCH = dict(FP32_STATE_LAUNCH, block_k=8, num_warps=4, prefetch=2, row_sums=True, state_dot=False,
                          split_state_tf32=False)


def launch_defaults(state_dtype: torch.dtype, batch: int, head_k_dim: int, max_nodes: int = 4) -> dict:
    """`gdn_step_triton`'s launch options for a state dtype, a batch of requests (a CUDA graph's padded batch is
    static, so each captured size keeps its own choice), a head shape and the nodes per request (a static shape).
    Measured choices: the comments above FP32_STATE_LAUNCH, SMALL_BATCH and TREE_TWO_LAUNCH (bench/results/2026-12-01d,
    -01e, -01f, 2026-12-02, -02c, -02d and -03b)."""
    if head_k_dim < 16:
        return NARROW_HEAD_LAUNCH
    if max_nodes > 8:
        return TREE_TWO_LAUNCH_16_ROWS if batch <= FEW_REQUESTS else TREE_TWO_LAUNCH
    fp32 = state_dtype == torch.float32
    if batch <= FEW_REQUESTS or max_nodes > 4:
        return FP32_STATE_TWO_LAUNCH_16_ROWS if fp32 else HALF_STATE_TWO_LAUNCH_16_ROWS
    if fp32:
        return FP32_STATE_TWO_LAUNCH_16_ROWS if max_nodes <= 2 and batch > SMALL_BATCH else FP32_STATE_TWO_LAUNCH
    if max_nodes <= 2:
        return HALF_STATE_TWO_LAUNCH_16_ROWS
    return HALF_STATE_TWO_LAUNCH_64_ROWS if batch <= SMALL_BATCH else HALF_STATE_TWO_LAUNCH


# bf16 and fp16 values are exact in tf32 (at most 11 significant bits, exponents within tf32's range)
EXACT_IN_TF32 = (torch.bfloat16, torch.float16)


def _state_products_mode(state_dtype, qkv_dtype, split_state_tf32: bool, split_state_bf16: bool) -> str:
    """How the tensor cores form the products with the state (`_state_products`): one tf32 pass where both operands
    are exact in tf32 (one bf16 pass where both are bf16 and `split_state_bf16` asks for bf16 pieces); where only the
    state is not, its split into three bf16 pieces (bf16 q/k; asked for, it wins over the default's tf32 split) or
    two tf32 pieces if asked for; else tf32x3."""
    if qkv_dtype in EXACT_IN_TF32:
        if state_dtype == torch.bfloat16 and qkv_dtype == torch.bfloat16 and split_state_bf16:
            return "bf16"
        if state_dtype in EXACT_IN_TF32:
            return "tf32"
        if split_state_bf16 and qkv_dtype == torch.bfloat16:
            return "3xbf16"
        if split_state_tf32:
            return "2xtf32"
    return "tf32x3"


def _nodes_block(max_nodes: int, epilogue_in_mma_layout: bool = False, solve_by_dots: bool = False) -> int:
    """BT: the node count padded to a power of two, at least 2; the accumulator-layout epilogue puts a column per
    node and 4 per lane quad, so at least 4 there; its solve by tensor-core products needs 16 (a dot's least
    inner and outer size)."""
    return max(16 if solve_by_dots else 4 if epilogue_in_mma_layout else 2, triton.next_power_of_2(max_nodes))


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


def _launch(*args, **kwargs):
    launches, out = _launch_arguments(*args, **kwargs)
    for kernel, grid, kernel_args, kernel_kwargs in launches:
        kernel[grid](*kernel_args, **kernel_kwargs)
    return out


def _launch_arguments(mixed_qkv, a, b, A_log, dt_bias, output_gate, norm_weight, state, state_indices, parents,
                      cu_nodes, factors, pending_nodes, pending_ancestors, *, num_key_heads, max_nodes, max_depth,
                      chain, scale, norm_eps, activation, ancestors, out, do_verify, **launch):
    """([(kernel, grid, positional arguments, keyword arguments)] in launch order, out): checks and launch options
    resolved, nothing launched (the JIT-variant test binds them without compiling). One launch of
    `_gated_step_kernel`, or with `state_pass_rows` the state pass (`state_pass`) and, for a verify, the row
    epilogue (`row_epilogue`) on its products."""
    S, HV, V, K = state.shape
    H = num_key_heads
    assert HV % H == 0 and state.stride(-1) == 1 and K == triton.next_power_of_2(K)
    assert V == triton.next_power_of_2(V) and activation in ACTIVATIONS
    _check_factors(factors, state, state_indices, pending_nodes, pending_ancestors)
    batch = state_indices.shape[0]
    launch = {**launch_defaults(state.dtype, batch, K, max_nodes),
              **{k: v for k, v in launch.items() if v is not None}}
    block_k = min(launch["block_k"], K)
    heads = launch["heads_per_program"]
    assert (HV // H) % heads == 0, "a program's value heads share one key head"
    two_pass = launch["state_pass_rows"] > 0
    path_nodes = launch["path_epilogue_nodes"]
    assert path_nodes == 0 or path_nodes == triton.next_power_of_2(path_nodes), "path_epilogue_nodes: a power of 2"
    assert not (two_pass and do_verify) or max_nodes <= 8 or path_nodes, \
        "two launches: the row epilogue takes at most 8 nodes, the path epilogue (path_epilogue_nodes) any"
    assert not (launch["state_dot"] and do_verify) or block_k >= 16 or two_pass, "tl.dot needs block_k >= 16"
    assert heads == 1 or launch["state_dot"] or not do_verify, "several heads per program: the state_dot layout"
    assert not (launch["split_in_mma_layout"] and launch["lagged_products"]), "two ways to the operands: one at a time"
    # the one kernel's epilogue options (two launches: the row epilogue, one value head a program, its own solve)
    mma_epilogue = launch["epilogue_in_mma_layout"] and launch["state_dot"] and not two_pass
    # a refinement of the accumulator-layout epilogue: without it (e.g. pinned off over a tree default) it is off
    solve_by_dots = launch["solve_by_dots"] and mma_epilogue and do_verify
    options = dict(num_warps=launch["num_warps"], num_stages=1)
    if launch["max_registers"] and not interpreting():
        options["maxnreg"] = launch["max_registers"]
    max_anc, bt = 0, 2
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
        strides = (mixed_qkv.stride(0), a.stride(0), b.stride(0), output_gate.stride(0), output_gate.stride(1),
                   out3.stride(0), out3.stride(1))
        bt = _nodes_block(max_nodes, mma_epilogue, solve_by_dots)
    state_products = _state_products_mode(state.dtype, mixed_qkv.dtype if do_verify else None,
                                          launch["split_state_tf32"], launch["split_state_bf16"])
    pending = dict(HAS_PENDING=pending_nodes is not None,
                   PENDING_ROWS=factors.shape[1] if pending_ancestors is None else pending_ancestors.shape[1],
                   PENDING_IS_CHAIN=pending_ancestors is None)
    # absent arrays stand in as pointers that are never dereferenced
    pending_arrays = (state_indices if pending_nodes is None else pending_nodes,
                      state_indices if pending_ancestors is None else pending_ancestors)
    scalars = (float(K**-0.5 if scale is None else scale), float(norm_eps))
    if two_pass:
        rows = min(launch["state_pass_rows"], V)
        # Hopper's programmatic dependent launch (not in the interpreter: inline PTX)
        dependent = do_verify and launch["dependent_launch"] and not interpreting()
        # the commit alone writes no products: `factors` stands in for the pointer
        products = torch.empty(batch, HV, 2 * bt, V, device=state.device) if do_verify else factors
        launches = [(state_pass._state_pass_kernel, (V // rows, HV, batch), (
            mixed_qkv if do_verify else factors, state, state_indices, cu_nodes if do_verify else state_indices,
            factors, *pending_arrays, products, mixed_qkv.stride(0) if do_verify else 0, state.stride(0),
            state.stride(1), state.stride(2), factors.stride(0), factors.stride(1)), dict(
            H=H, HV=HV, K=K, V=V, BV=rows, BK=min(launch["state_pass_block_k"], K), BT=bt, DO_PRODUCTS=do_verify,
            STATE_PRODUCTS=state_products, LAUNCH_DEPENDENTS=dependent, num_warps=launch["state_pass_warps"],
            num_stages=1, **pending))]
        if do_verify:
            epilogue_args = (mixed_qkv, a, b, A_log, dt_bias, output_gate, norm_weight, state_indices, ancestors,
                             cu_nodes, out3, factors, products, *strides, factors.stride(0), factors.stride(1),
                             *scalars)
            epilogue_kwargs = dict(H=H, HV=HV, K=K, V=V, BT=bt, MAX_ANC=max_anc, IS_CHAIN=chain, ACT=activation,
                                   DEPENDENT_LAUNCH=dependent, launch_pdl=dependent, **options)
            if path_nodes:
                launches.append((path_epilogue._path_epilogue_kernel, (HV, batch, triton.cdiv(max_nodes, path_nodes)),
                                 epilogue_args, dict(epilogue_kwargs, NB=path_nodes)))
            else:
                launches.append((row_epilogue._row_epilogue_kernel, (HV, batch), epilogue_args, epilogue_kwargs))
        return launches, out
    # host-side descriptor: encoded by the launcher from the pool's fixed pointer and strides, a kernel parameter
    # (a CUDA graph keeps it); no device workspace. Its asserts check TMA's 16-byte alignment of base and strides
    state_desc = (TensorDescriptor(state, list(state.shape), list(state.stride()), [1, 1, V, block_k])
                  if launch["tma_state"] else state)
    if do_verify:
        v_args = (mixed_qkv, a, b, A_log, dt_bias, output_gate, norm_weight, state, state_desc, state_indices,
                  ancestors, cu_nodes, out3)
    else:  # commit alone: the verify's pointers are never dereferenced
        v_args = (factors,) * 7 + (state, state_desc, state_indices, state_indices, state_indices, factors)
        strides = (0,) * 7
    kernel_args = (
        *v_args, factors, *pending_arrays, *strides, state.stride(0), state.stride(1), state.stride(2),
        factors.stride(0), factors.stride(1), *scalars)
    kernel_kwargs = dict(
        H=H, HV=HV, K=K, V=V, G=heads, BT=bt, BK=block_k, PREFETCH=launch["prefetch"],
        ROW_SUMS=launch["row_sums"], LATE_NODE_TERMS=launch["late_node_terms"], MAX_ANC=max_anc, IS_CHAIN=chain,
        ACT=activation, DO_VERIFY=do_verify, STATE_DOT=launch["state_dot"] and do_verify,
        SPLIT_IN_MMA_LAYOUT=launch["split_in_mma_layout"] and launch["state_dot"] and do_verify,
        LAGGED_PRODUCTS=launch["lagged_products"] and launch["state_dot"] and do_verify,
        STATE_TMA=launch["tma_state"],
        EPILOGUE_IN_MMA_LAYOUT=launch["epilogue_in_mma_layout"] and launch["state_dot"] and do_verify,
        SOLVE_BY_DOTS=solve_by_dots, DOT_PRECISION="tf32x3" if state.dtype == torch.float32 else "tf32",
        STATE_PRODUCTS=state_products, **pending, **options,
    )
    return [(_gated_step_kernel, (HV // heads, batch), kernel_args, kernel_kwargs)], out


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
    split_state_tf32: bool | None = None,
    split_state_bf16: bool | None = None,
    heads_per_program: int | None = None,
    split_in_mma_layout: bool | None = None,
    lagged_products: bool | None = None,
    tma_state: bool | None = None,
    epilogue_in_mma_layout: bool | None = None,
    solve_by_dots: bool | None = None,
    state_pass_rows: int | None = None,
    state_pass_block_k: int | None = None,
    state_pass_warps: int | None = None,
    dependent_launch: bool | None = None,
    path_epilogue_nodes: int | None = None,
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
    Launch options left None take `launch_defaults`' value for this state, batch and node count; `max_registers` is
    ptxas's register cap (maxnreg), 0 for none (None keeps the default's cap, e.g. 128 for 16-bit states).
    `ancestors`: as in `verify_packed_triton`. `row_sums`: one per-node sum per row, summed over the thread's BK
    columns every step (2T registers instead of 2T x BK); `late_node_terms`: gates, decays and Gram matrices
    computed after the state loop, so their [BT, BT] tiles are not live in it. `state_dot`: the products with the
    state on the tensor cores, [h k_0 .. h q_{T-1}] = h [V, BK] @ [k; q]^T per chunk (the state tile stays in the
    load's coalesced layout for the commit and its stores; block_k >= 16). `split_state_tf32`: with
    `state_dot`, an fp32 state and bf16/fp16 q/k, two tf32 passes (the state split into tf32 hi and lo parts, q/k
    exact) instead of tf32x3's three; relative error of each product 2^-22 (`_state_products`). `split_state_bf16`:
    the same with bf16 q/k, three bf16 passes (2^-27); for a bf16 state, one bf16 pass (exact products).
    `heads_per_program` (1 or 2; divides HV // H; with `state_dot`): one program verifies that many value heads of
    one key head for one request, sharing the q/k chunks, the key norms and Gram matrices and the pending key rows;
    half the programs at 2.
    `split_in_mma_layout` (with `state_dot`): each committed chunk changes layout once, into the tensor cores'
    accumulator layout (`_in_accumulator_layout`: one round trip through shared memory, half the bytes of 2xTF32's
    two), and the products' operand pieces are split from it in registers (tf32 pieces in a column order that needs
    no data movement, `_tf32_operand_order`; 16-bit pieces as they are). `lagged_products` (with `state_dot`; not
    with `split_in_mma_layout`): each chunk's products one loop iteration later, from its operand pieces carried
    through the loop, which the tensor cores read from shared memory (one store per piece, no load back into
    registers); one more iteration. `tma_state`: the state chunks arrive through TMA (a host-side tensor descriptor
    over the pool, block [1, 1, V, block_k]; base and strides 16-byte aligned) as asynchronous copies into shared
    memory that Triton's pipeliner keeps `prefetch` chunks ahead (prefetch + 1 buffers, mbarriers), the q/k chunks
    loaded in the loop for the same pipeliner, so no register load is outstanding at the products' fences.
    `epilogue_in_mma_layout` (with `state_dot`): the q/k columns interleaved (k_t, q_t side by side), so the
    epilogue takes each node's h k_t, h q_t as a column of the accumulator in place and works on [V, nodes] tiles,
    the solve as products with a small precomputed inverse (`_epilogue_in_mma_layout`); nodes padded to 4.
    `solve_by_dots` (with `epilogue_in_mma_layout`; for trees): the Gram matrices, the solve and o's solve term as
    tensor-core products of the node tiles (a Neumann series as long as the deepest path); nodes padded to 16.
    `state_pass_rows` (0: one kernel; at most 8 nodes without `path_epilogue_nodes`): two launches, the state pass
    (the pending commit and the state products, `state_pass`: one program per that many value rows of a head, key
    chunks of `state_pass_block_k`, `state_pass_warps` warps) into an fp32 workspace [B, HV, 2 * nodes padded, V]
    allocated per call (33.5 MiB at B=256, T=4; 256 MiB at B=256 with 29-node trees; in a CUDA graph, its private
    pool), then the rest of the step, one value head a program (`row_epilogue`, with `num_warps` and
    `max_registers`; the one kernel's epilogue options `epilogue_in_mma_layout`, `solve_by_dots` and
    `heads_per_program` do not apply). `dependent_launch`: the second launch is the first's programmatic dependent
    (Hopper; a plain launch in the interpreter), its programs computing what does not read the products while the
    state pass drains. `path_epilogue_nodes` (0: the row
    epilogue, at most 8 nodes): with `state_pass_rows`, the second launch solves each node from its own path
    (`path_epilogue`; any node count, for trees), that many nodes a program.
    No host sync, no data-dependent shapes: capturable in a CUDA graph."""
    return _launch(mixed_qkv, a, b, A_log, dt_bias, output_gate, norm_weight, state, state_indices, parents,
                   cu_nodes, factors, pending_nodes, pending_ancestors, num_key_heads=num_key_heads,
                   max_nodes=max_nodes, max_depth=max_depth, chain=chain, scale=scale, norm_eps=norm_eps,
                   activation=activation, ancestors=ancestors, out=out, do_verify=True, block_k=block_k,
                   num_warps=num_warps, prefetch=prefetch, max_registers=max_registers, row_sums=row_sums,
                   late_node_terms=late_node_terms, state_dot=state_dot, split_state_tf32=split_state_tf32,
                   split_state_bf16=split_state_bf16, heads_per_program=heads_per_program,
                   split_in_mma_layout=split_in_mma_layout, lagged_products=lagged_products, tma_state=tma_state,
                   epilogue_in_mma_layout=epilogue_in_mma_layout, solve_by_dots=solve_by_dots,
                   state_pass_rows=state_pass_rows, state_pass_block_k=state_pass_block_k,
                   state_pass_warps=state_pass_warps, dependent_launch=dependent_launch,
                   path_epilogue_nodes=path_epilogue_nodes)


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
    heads_per_program: int | None = None,
    state_pass_rows: int | None = None,
    state_pass_block_k: int | None = None,
    state_pass_warps: int | None = None,
) -> None:
    """The pending commit alone, in place (for the end of a sequence, and tests): for each request b with slot
    s = state_indices[b] >= 0 and a = pending_nodes[b] >= 0, the slot's state becomes the state after node a, whose
    path (a and its ancestors: rows 0..a for a chain, else `pending_ancestors[a]`, as in `gdn_step_triton`) has its
    factors in rows factors[s, j]: h_a = exp(c_a) h0 + sum_{j on the path} exp(c_a - c_j) (u_j k_scale_j) k_j^T.
    With `state_pass_rows`, the state pass without products (`state_pass`; its other options as in
    `gdn_step_triton`): a head's value rows over several programs."""
    _launch(None, None, None, None, None, None, None, state, state_indices, None, None, factors, pending_nodes,
            pending_ancestors,
            num_key_heads=num_key_heads, max_nodes=1, max_depth=None, chain=True, scale=None, norm_eps=0.0,
            activation="silu", ancestors=None, out=None, do_verify=False, block_k=block_k, num_warps=num_warps,
            prefetch=prefetch, max_registers=max_registers, heads_per_program=heads_per_program,
            state_pass_rows=state_pass_rows, state_pass_block_k=state_pass_block_k, state_pass_warps=state_pass_warps)
