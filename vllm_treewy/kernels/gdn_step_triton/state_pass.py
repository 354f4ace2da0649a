"""The GDN step's first launch, the state pass: per request and value head, the previous step's commit applied to
the state in place, then the committed state's products with this step's raw keys and queries. One program per BV
value rows of a head: with no per-node work in it (gates, norms, the solve and the gated RMSNorm are the
epilogue's), a program holds a state tile and few registers, so many programs per SM keep the state stream in
flight.

    h_a       = exp(c_a) h0 + sum_{j on path(a)} exp(c_a - c_j) (u_j key_scale_j) key_j^T      (a: the commit node)
    products  = [h_a k_raw_t, h_a q_raw_t]_t  ->  products[b, hv, :2 BT, v] fp32, fp32-accurate (`_state_products`)

k_t's products go to column 2t, q_t's to 2t + 1, each column's V values side by side (node-major), for the
epilogues' [V]-vector loads. Without products (`DO_PRODUCTS` off) it is the commit alone (`gdn_commit_triton`).
The commit sums its terms in a fixed order (`_committed_chunk`), so the commit alone and the one inside a step
write the same state bit for bit. LAUNCH_DEPENDENTS: the epilogue is this launch's programmatic dependent
(Hopper), allowed to start once every program here has started.

Tiles narrower than a tensor-core dot (BV or BK of at least 16 over a head with V or K below 16, test shapes)
are masked to the head."""

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents

from ..factor_rows_triton import _factor_columns
from ..ancestor_table_triton import _ancestor
from .node_inputs import _request_indices


@triton.jit
def _round_tf32(x):
    """x rounded to the nearest tf32 (1 + 10 mantissa bits, ties away from zero: PTX's cvt.rna.tf32.f32) by bit
    arithmetic, which the interpreter runs too: half of the last kept bit added to the fp32 pattern, the 13 low
    bits cleared. Finite x (a carry out of the largest finite floats would give inf)."""
    bits = x.to(tl.uint32, bitcast=True)
    return ((bits + 0x1000) & 0xFFFFE000).to(tl.float32, bitcast=True)


@triton.jit
def _state_products(h, kq, acc, STATE_PRODUCTS: tl.constexpr):
    """acc + h @ kq on the tensor cores, h [BV, BK] a state chunk in fp32, kq [BK, NQ] raw q/k columns in fp32.

    "tf32": one tf32 pass; exact products (fp32 sums) where both operands are exact in tf32 (bf16 or fp16 values: at
    most 11 significant bits, exponents within tf32's).
    "2xtf32" (an fp32 state with fp16 q/k): h = h_hi + h_lo + e, h_hi = rna_tf32(h), h_lo = rna_tf32(h - h_hi)
    (h - h_hi is exact in fp32); |e| <= 2^-22 |h|. Each product h_hi k and h_lo k is exact in fp32 (11 + 11
    significant bits <= 24), so the two passes give sum_i h_i k_i within 2^-22 sum_i |h_i k_i| plus the fp32
    accumulation's rounding: ~80x inside the fp32 tolerance of the fp64-reference tests. (tf32x3's third pass,
    h_hi (k - rna_tf32(k)), is exactly zero for such k.)
    "3xbf16" (an fp32 state with bf16 q/k): h = h_1 + h_2 + h_3 + e, each piece the bf16 rounding of what the
    pieces before it left (exact differences in fp32), |e| <= 2^-27 |h|; each product h_j k is exact in fp32
    (8 + 8 significant bits): within 2^-27 of the exact products, below fp32's own 2^-24. Half a tf32 operand's
    shared-memory bytes and twice its tensor-core rate.
    "bf16" (a bf16 state with bf16 q/k): "3xbf16"'s one piece, as exact as "tf32" at half its operand bytes.
    "tf32x3": fp32 q/k, not exact in tf32."""
    if STATE_PRODUCTS == "2xtf32":
        h_hi = _round_tf32(h)
        pieces = (_round_tf32(h - h_hi), h_hi)
    elif STATE_PRODUCTS == "bf16":
        kq = kq.to(tl.bfloat16)  # exact: the raw bf16 values
        pieces = (h.to(tl.bfloat16),)  # exact: a bf16 state's values
    elif STATE_PRODUCTS == "3xbf16":
        kq = kq.to(tl.bfloat16)  # exact: the raw bf16 values
        h_1 = h.to(tl.bfloat16)
        rest = h - h_1.to(tl.float32)
        h_2 = rest.to(tl.bfloat16)
        pieces = ((rest - h_2.to(tl.float32)).to(tl.bfloat16), h_2, h_1)  # the small parts first
    else:
        pieces = (h,)
    for i in tl.static_range(len(pieces)):
        if STATE_PRODUCTS == "3xbf16" or STATE_PRODUCTS == "bf16":
            acc = tl.dot(pieces[i], kq, acc)
        elif STATE_PRODUCTS == "tf32x3":
            acc = tl.dot(pieces[i], kq, acc, input_precision="tf32x3")
        else:
            acc = tl.dot(pieces[i], kq, acc, input_precision="tf32")
    return acc


@triton.jit
def _commit_path(commit_node, commit_ancestors, f_kscale, f_g, stride_frow, COMMIT_ROWS: tl.constexpr,
                 COMMIT_IS_CHAIN: tl.constexpr):
    """The previous step's path to the commit node a (loaded by the caller with the slot: one load level fewer
    before the factor rows; row d: a's d-th ancestor, d = 0..COMMIT_ROWS-1, a - d in a chain, else from the table):
    (per row d its offset into the factor rows, whether it is on the path, and the weight
    exp(c_a - c_j) key_scale_j; exp(c_a), h0's weight). The decays are running sums of g up the path, never
    differences."""
    running = tl.zeros([], dtype=tl.float32)
    offsets = ()
    on_path = ()
    weights = ()
    for d in tl.static_range(COMMIT_ROWS):
        path_row = _ancestor(commit_ancestors, 0, commit_node, d, COMMIT_ROWS, COMMIT_IS_CHAIN)
        on = path_row >= 0
        row = tl.maximum(path_row, 0).to(tl.int64) * stride_frow
        k_scale = tl.load(f_kscale + row, mask=on, other=0.0)
        weights = weights + (tl.where(on, tl.exp(running), 0.0) * k_scale,)
        running = running + tl.load(f_g + row, mask=on, other=0.0)
        offsets = offsets + (row,)
        on_path = on_path + (on,)
    return offsets, on_path, weights, tl.exp(running)


@triton.jit
def _committed_chunk(h, root, values, keys, COMMIT_ROWS: tl.constexpr):
    """The state chunk h [BV, BK] (fp32) after the commit: exp(c_a) h + sum_d values_d keys_d^T, the path's rows in
    order (values_d: exp(c_a - c_j) u_j key_scale_j on the chunk's rows; keys_d: the raw key row's chunk)."""
    h = root * h
    for d in tl.static_range(COMMIT_ROWS):
        h += values[d][:, None] * keys[d][None, :]
    return h


@triton.jit
def _node_kq_columns(qkv, bos, n, stride_qkv, i_h, H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr):
    """Row pointers and masks of the [BK, NQ] right operand of the state products: per column a raw key or query
    row (key head i_h) of the request's nodes bos .. bos + n - 1, k_t at column 2t, q_t at 2t + 1, zeros up to
    NQ = max(16, 2 BT)."""
    o_q = tl.arange(0, max(16, 2 * BT))
    q_node = o_q // 2
    is_key = o_q % 2 == 0
    kq_ok = (q_node < n) & (o_q < 2 * BT)
    return qkv + (bos + q_node).to(tl.int64) * stride_qkv + tl.where(is_key, H * K, 0) + i_h * K, kq_ok


# integer arrays read as scalars or gathers, not specialised on alignment
@triton.jit(do_not_specialize=["state_indices", "cu_nodes", "commit_nodes", "commit_ancestors"])
def _state_pass_kernel(
    qkv, state, state_indices, cu_nodes, factors, commit_nodes, commit_ancestors, products,
    stride_qkv, stride_slot, stride_head, stride_v, stride_fslot, stride_frow,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr, BK: tl.constexpr,
    BT: tl.constexpr, DO_PRODUCTS: tl.constexpr, HAS_COMMIT: tl.constexpr, COMMIT_ROWS: tl.constexpr,
    COMMIT_IS_CHAIN: tl.constexpr, STATE_PRODUCTS: tl.constexpr, LAUNCH_DEPENDENTS: tl.constexpr,
):
    """Grid (cdiv(V, BV), HV, B). products [B, HV, 2 BT, V] fp32 (unused without DO_PRODUCTS); commit_ancestors
    the previous step's [T', COMMIT_ROWS] table (a tree's; unused for a chain)."""
    if LAUNCH_DEPENDENTS:
        gdc_launch_dependents()
    i_v, i_hv, i_b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    # the commit node and the node range leave with the slot, ahead of its check: the factor rows, the state and
    # the q/k columns then wait on one level of loads
    slot, commit_node, bos, n = _request_indices(state_indices, commit_nodes, cu_nodes, i_b, HAS_COMMIT,
                                                 DO_PRODUCTS)
    if slot < 0:
        return
    PADDED: tl.constexpr = (BK > K) or (BV > V)  # a head narrower than the tile: masked to the head
    o_v = i_v * BV + tl.arange(0, BV)
    o_kc = tl.arange(0, BK)
    p_state = state + slot * stride_slot + i_hv * stride_head + o_v[:, None] * stride_v
    if HAS_COMMIT:
        f_k, f_kscale, f_u, f_g = _factor_columns(factors, slot, stride_fslot, i_hv, HV, K, V)
        p_rows, p_on, p_weight, p_root = _commit_path(commit_node, commit_ancestors, f_kscale, f_g, stride_frow,
                                                      COMMIT_ROWS, COMMIT_IS_CHAIN)
        p_wu = ()
        for d in tl.static_range(COMMIT_ROWS):
            if PADDED:
                u_d = tl.load(f_u + p_rows[d] + o_v, mask=p_on[d] & (o_v < V), other=0.0)
            else:
                u_d = tl.load(f_u + p_rows[d] + o_v, mask=p_on[d], other=0.0)
            p_wu = p_wu + (u_d * p_weight[d],)
        store_commit = (o_v[:, None] * 0 + commit_node) >= 0  # as a tile: a scalar mask does not broadcast
    if DO_PRODUCTS:
        NQ: tl.constexpr = max(16, 2 * BT)
        o_q = tl.arange(0, NQ)
        kq_row, kq_ok = _node_kq_columns(qkv, bos, n, stride_qkv, i_hv // (HV // H), H, K, BT)
        acc = tl.zeros([BV, NQ], dtype=tl.float32)
    NK: tl.constexpr = (K + BK - 1) // BK
    for i_k in tl.static_range(NK):
        cols = i_k * BK + o_kc
        if PADDED:
            in_head = (o_v < V)[:, None] & (cols < K)[None, :]
            h = tl.load(p_state + cols[None, :], mask=in_head, other=0.0).to(tl.float32)
        else:
            h = tl.load(p_state + cols[None, :]).to(tl.float32)
        if DO_PRODUCTS:  # before the commit's store: a load after a store is issued after it
            if PADDED:
                kq = tl.load(kq_row[None, :] + cols[:, None], mask=kq_ok[None, :] & (cols < K)[:, None], other=0.0)
            else:
                kq = tl.load(kq_row[None, :] + cols[:, None], mask=kq_ok[None, :], other=0.0)
        if HAS_COMMIT:
            keys = ()
            for d in tl.static_range(COMMIT_ROWS):
                if PADDED:
                    keys = keys + (tl.load(f_k + p_rows[d] + cols, mask=p_on[d] & (cols < K), other=0.0),)
                else:
                    keys = keys + (tl.load(f_k + p_rows[d] + cols, mask=p_on[d], other=0.0),)
            h = _committed_chunk(h, p_root, p_wu, keys, COMMIT_ROWS).to(state.dtype.element_ty)
            if PADDED:
                tl.store(p_state + cols[None, :], h, mask=store_commit & in_head)
            else:
                tl.store(p_state + cols[None, :], h, mask=store_commit)
            h = h.to(tl.float32)
        if DO_PRODUCTS:
            acc = _state_products(h, kq.to(tl.float32), acc, STATE_PRODUCTS)
    if DO_PRODUCTS:
        # the request's own nodes' columns only (a tree of 11 nodes pads BT to 16): no output or factor row depends
        # on a column past 2n (the request epilogue loads them for nodes past n, whose rows it never stores)
        p_out = products + ((i_b * HV + i_hv) * (2 * BT) + o_q[None, :]).to(tl.int64) * V + o_v[:, None]
        if PADDED:
            tl.store(p_out, acc, mask=(o_q < 2 * n)[None, :] & (o_v < V)[:, None])
        else:
            tl.store(p_out, acc, mask=(o_q < 2 * n)[None, :])
