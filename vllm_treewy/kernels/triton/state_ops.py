"""Jit helpers that the fused step (`gated`), its state pass (`state_pass`) and its row epilogue share: a
request's indices loaded ahead of the padding check (`_request_indices`, `_before_check`); the products of a state
chunk with raw q/k columns on the tensor cores, exact to fp32 accuracy by splitting the state (`_state_products`),
and where their q/k columns come from (`_node_kq_columns`); the slot's factor rows: where a head's columns are
(`_factor_columns`), the previous step's path to its accepted node (`_pending_path`), its weighted pseudo-values
(`_pending_values`) and the committed chunk (`_committed_chunk`: both kernels sum it in the same order, so they
commit the same state bit for bit)."""

import triton
import triton.language as tl

from ._tree import _ancestor


@triton.jit
def _round_tf32(x):
    """x rounded to the nearest tf32 (1 + 10 mantissa bits, ties away from zero: PTX's cvt.rna.tf32.f32) by bit
    arithmetic, which the interpreter runs too: half of the last kept bit added to the fp32 pattern, the 13 low
    bits cleared. Finite x (a carry out of the largest finite floats would give inf)."""
    bits = x.to(tl.uint32, bitcast=True)
    return ((bits + 0x1000) & 0xFFFFE000).to(tl.float32, bitcast=True)


@triton.jit
def _state_products(h, kq, acc, STATE_PRODUCTS: tl.constexpr):
    """acc + h @ kq on the tensor cores, h [V, BK] a state chunk in fp32, kq [BK, NQ] raw q/k columns in fp32.

    "tf32": one tf32 pass; exact products (fp32 sums) where both operands are exact in tf32 (bf16 or fp16 values: at
    most 11 significant bits, exponents within tf32's).
    "2xtf32" (an fp32 state with bf16/fp16 q/k): h = h_hi + h_lo + e, h_hi = rna_tf32(h), h_lo = rna_tf32(h - h_hi)
    (h - h_hi is exact in fp32); |h - h_hi| <= 2^-11 |h| and |e| <= 2^-11 |h - h_hi| <= 2^-22 |h|. Each product
    h_hi k and h_lo k is exact in fp32 (11 + 8 significant bits for bf16, 11 + 11 for fp16, both <= 24), so the two
    passes give sum_i h_i k_i within 2^-22 sum_i |h_i k_i| (2.4e-7 relative; fp32 products: 2^-24) plus the fp32
    accumulation's rounding, which every fp32 dot has: ~80x inside the fp32 tolerance (2e-5) of the fp64-reference
    tests. tf32x3 computes these same two products and a third, h_hi (k - rna_tf32(k)), exactly zero for such k:
    2xTF32 drops only that pass.
    "3xbf16" (an fp32 state with bf16 q/k): h = h_1 + h_2 + h_3 + e, each piece the bf16 rounding of what the
    pieces before it left (exact differences in fp32), |e| <= 2^-9 |h - h_1 - h_2| <= 2^-27 |h|; each product
    h_j k is exact in fp32 (8 + 8 significant bits): within 2^-27 of the exact products, below fp32's own 2^-24.
    Three bf16 passes (half the bytes of a tf32 operand in shared memory, twice the tensor-core rate of tf32).
    "bf16" (a bf16 state with bf16 q/k): "3xbf16"'s one piece, as exact as "tf32" at half its operand bytes.
    "tf32x3": q/k in fp32, not exact in tf32.
    `_operand_pieces` splits, `_piece_products` multiplies."""
    pieces, kq_operand = _operand_pieces(h, kq, STATE_PRODUCTS)
    return _piece_products(pieces, kq_operand, acc, STATE_PRODUCTS)


@triton.jit
def _operand_pieces(h, kq, STATE_PRODUCTS: tl.constexpr):
    """(the state chunk's operand pieces, the small parts first; the q/k operand) of `_state_products`."""
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
        pieces = ((rest - h_2.to(tl.float32)).to(tl.bfloat16), h_2, h_1)
    else:
        pieces = (h,)
    return pieces, kq


@triton.jit
def _piece_products(pieces, kq, acc, STATE_PRODUCTS: tl.constexpr):
    """acc + sum over the pieces of piece @ kq (`_operand_pieces`)."""
    for i in tl.static_range(len(pieces)):
        if STATE_PRODUCTS == "3xbf16" or STATE_PRODUCTS == "bf16":
            acc = tl.dot(pieces[i], kq, acc)
        elif STATE_PRODUCTS == "tf32x3":
            acc = tl.dot(pieces[i], kq, acc, input_precision="tf32x3")
        else:
            acc = tl.dot(pieces[i], kq, acc, input_precision="tf32")
    return acc


@triton.jit
def _before_check(pointer):
    """A load meant to leave before the caller's padding check (`if slot < 0: return`), with the slot's own, so that
    what depends on it waits on one load level: volatile, because LLVM sinks a plain load below the check into the
    one branch that uses it (offline sm_90 SASS, 2026-12-03)."""
    return tl.load(pointer, volatile=True)


@triton.jit
def _request_indices(state_indices, pending_nodes, cu_nodes, i_b, HAS_PENDING: tl.constexpr,
                     HAS_NODES: tl.constexpr):
    """Request i_b's (slot, accepted node, first node, node count), loaded together ahead of the padding check
    (`_before_check`): the accepted node -1 without HAS_PENDING, the node range 0, 0 without HAS_NODES."""
    slot = tl.load(state_indices + i_b).to(tl.int64)
    accepted = _before_check(pending_nodes + i_b) if HAS_PENDING else -1
    bos = 0
    n = 0
    if HAS_NODES:
        bos = _before_check(cu_nodes + i_b)
        n = _before_check(cu_nodes + i_b + 1) - bos
    return slot, accepted, bos, n


@triton.jit
def _factor_columns(factors, slot, stride_fslot, i_hv, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr):
    """Pointers to value head i_hv's columns of the slot's factor rows (`slot_factor_width`): its key copy [K], key
    inverse norm, u [V] and log decay (head i_hv + g's at + g * K, + g, + g * V, + g)."""
    f_slot = factors + slot * stride_fslot
    return (f_slot + i_hv * K, f_slot + HV * K + i_hv, f_slot + HV * (K + 1) + i_hv * V,
            f_slot + HV * (K + 1 + V) + i_hv)


@triton.jit
def _pending_path(accepted, pending_ancestors, f_kscale, f_g, stride_frow, G: tl.constexpr,
                  PENDING_ROWS: tl.constexpr, PENDING_IS_CHAIN: tl.constexpr):
    """The previous step's path to a request's accepted node a (its pending_nodes entry, loaded by the caller with
    the slot: one load level fewer before the factor rows; row d: a's d-th ancestor, d = 0..PENDING_ROWS-1; a
    chain's is a - d, a tree's comes from the table) for G value heads (log decays at f_g + g; the key scale of the
    first head serves all G: one key head's copies are equal): (per row d its offset into the factor rows and
    whether it is on the path; per row d and head g, at d * G + g, the weight exp(c_a - c_j) / |k_j|; per head
    exp(c_a), h0's weight). The decays are running sums of g up the path, never differences."""
    running = ()
    for g in tl.static_range(G):
        running = running + (tl.zeros([], dtype=tl.float32),)
    offsets = ()
    on_path = ()
    weights = ()
    for d in tl.static_range(PENDING_ROWS):
        path_row = _ancestor(pending_ancestors, 0, accepted, d, PENDING_ROWS, PENDING_IS_CHAIN)
        on = path_row >= 0
        row = tl.maximum(path_row, 0).to(tl.int64) * stride_frow
        k_scale = tl.load(f_kscale + row, mask=on, other=0.0)
        summed = ()
        for g in tl.static_range(G):
            weights = weights + (tl.where(on, tl.exp(running[g]), 0.0) * k_scale,)
            summed = summed + (running[g] + tl.load(f_g + g + row, mask=on, other=0.0),)
        running = summed
        offsets = offsets + (row,)
        on_path = on_path + (on,)
    roots = ()
    for g in tl.static_range(G):
        roots = roots + (tl.exp(running[g]),)
    return offsets, on_path, weights, roots


@triton.jit
def _pending_values(f_u, p_rows, p_on, p_weight, o_v, V: tl.constexpr, G: tl.constexpr, PENDING_ROWS: tl.constexpr):
    """Per pending row d and head g (at d * G + g): exp(c_a - c_j) u_j / |k_j| on value rows o_v (`_pending_path`'s
    weights; head g's u at f_u + g * V)."""
    values = ()
    for d in tl.static_range(PENDING_ROWS):
        for g in tl.static_range(G):
            values = values + (tl.load(f_u + g * V + p_rows[d] + o_v, mask=p_on[d], other=0.0) * p_weight[d * G + g],)
    return values


@triton.jit
def _committed_chunk(h, root, values, keys, g, G: tl.constexpr, PENDING_ROWS: tl.constexpr):
    """Head g's state chunk h [rows, BK] (fp32) after the pending commit: exp(c_a) h + sum_d values_d keys_d^T, the
    path's rows in order (`_pending_values`; keys[d] the raw key row's chunk)."""
    h = root * h
    for d in tl.static_range(PENDING_ROWS):
        h += values[d * G + g][:, None] * keys[d][None, :]
    return h


@triton.jit
def _node_kq_columns(qkv, bos, n, stride_qkv, i_h, H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr,
                     INTERLEAVED: tl.constexpr):
    """Row pointers and masks of the [BK, NQ] right operand of the state products: per column a node's raw key or
    query row (key head i_h) of the request's nodes bos .. bos + n - 1, NQ = max(16, 2 BT) columns: k_0..k_{BT-1},
    q_0..q_{BT-1}, zero padding; INTERLEAVED (the accumulator-layout epilogue's): k_t at 2t, q_t at 2t + 1."""
    o_q = tl.arange(0, max(16, 2 * BT))
    if INTERLEAVED:
        q_node = o_q // 2
        is_key = o_q % 2 == 0
    else:
        q_node = o_q % BT
        is_key = o_q < BT
    kq_ok = (q_node < n) & (o_q < 2 * BT)
    return qkv + (bos + q_node).to(tl.int64) * stride_qkv + tl.where(is_key, H * K, 0) + i_h * K, kq_ok
