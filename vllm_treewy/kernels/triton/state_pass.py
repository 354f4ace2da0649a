"""The fused GDN step's state pass on its own: per request and value head, the previous step's pending commit applied
to the state in place and the committed state's products with this step's raw keys and queries, in tiles of BV
value rows of a head. With no per-node work left in it (gates, norms, the solve and the gated RMSNorm run after it,
`row_epilogue`), a program holds a few registers and a state tile: many programs per SM keep the state stream in
flight, where the one-kernel step waits on its epilogue (kernels.md: latency-bound at ~2x the two-state HBM bound).

    h_a       = exp(c_a) h0 + sum_{j on path(a)} exp(c_a - c_j) (u_j / |k_j|) k_raw_j^T    (as `gdn_commit_triton`)
    products  = [h_a k_raw_t, h_a q_raw_t]_t  ->  products[b, hv, :2 BT, v] fp32, fp32-accurate (`_state_products`)

The products' columns are interleaved as the one-kernel step's accumulator columns (k_t at 2t, q_t at 2t + 1) and
stored node-major. Without the products (`DO_PRODUCTS` off) it is the commit alone. A program per tile, or fewer
programs that each loop over tiles (persistent: the next tile's state in flight while one is committed).
LAUNCH_DEPENDENTS: the row epilogue is this launch's programmatic dependent (Hopper), allowed to start once every
program here has; SIGNAL_READY: each (request, head) counts its finished tiles in `ready`, so that its row epilogue
program can start on it before the whole launch ends."""

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents

from .state_ops import (_committed_chunk, _factor_columns, _node_kq_columns, _pending_path, _pending_values,
                        _state_products)


# integer arrays read as scalars or gathers, not specialised on alignment (as `_gated_step_kernel`)
@triton.jit(do_not_specialize=["state_indices", "cu_nodes", "pending_nodes", "pending_ancestors", "tiles"])
def _state_pass_kernel(
    qkv, state, state_indices, cu_nodes, factors, pending_nodes, pending_ancestors, products, ready, tiles,
    stride_qkv, stride_slot, stride_head, stride_v, stride_fslot, stride_frow,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr, BK: tl.constexpr,
    BT: tl.constexpr, DO_PRODUCTS: tl.constexpr, HAS_PENDING: tl.constexpr, PENDING_ROWS: tl.constexpr,
    PENDING_IS_CHAIN: tl.constexpr, STATE_PRODUCTS: tl.constexpr, LAUNCH_DEPENDENTS: tl.constexpr,
    SIGNAL_READY: tl.constexpr, PERSISTENT: tl.constexpr, STATE_FIRST: tl.constexpr, L2_PREFETCH: tl.constexpr,
):
    """A program per tile of `tiles` (`_tile`), or PERSISTENT: program p takes tiles p, p + programs, ..., each
    tile's first state chunk loaded one tile ahead and its request's slot and accepted node two ahead, so that a
    program has a state chunk in flight while it commits the one before and no load waits on an index.
    STATE_FIRST (a program per tile): the state chunk goes out before the pending commit's factor-row loads.
    L2_PREFETCH > 0: each program first has the L2 fetch the state rows of tile program + L2_PREFETCH (one bulk
    prefetch of a tile's contiguous rows: the program that takes that tile a wave later finds them there)."""
    if LAUNCH_DEPENDENTS:
        gdc_launch_dependents()
    first = tl.program_id(0)
    TILES_PER_REQUEST: tl.constexpr = HV * (V // BV)
    slot, accepted = _tile_request(state_indices, pending_nodes, first, tiles, TILES_PER_REQUEST, HAS_PENDING)
    if L2_PREFETCH > 0:
        _prefetch_rows(state, state_indices, first + L2_PREFETCH, tiles, stride_slot, stride_head, stride_v, HV, K,
                       V, BV, TILES_PER_REQUEST)
    if PERSISTENT or STATE_FIRST:
        h_first = _first_chunk(state, slot, first, stride_slot, stride_head, stride_v, HV, V, BV, BK)
    else:
        h_first = slot  # not read: the tile loads its first chunk
    if PERSISTENT:
        programs = tl.num_programs(0)
        slot_next, accepted_next = _tile_request(state_indices, pending_nodes, first + programs, tiles,
                                                 TILES_PER_REQUEST, HAS_PENDING)
        for t in range(first, tiles, programs):
            h_next = _first_chunk(state, slot_next, t + programs, stride_slot, stride_head, stride_v, HV, V, BV, BK)
            slot_after, accepted_after = _tile_request(state_indices, pending_nodes, t + 2 * programs, tiles,
                                                       TILES_PER_REQUEST, HAS_PENDING)
            if slot >= 0:
                _state_tile(qkv, state, cu_nodes, factors, pending_ancestors, products, ready, t, slot, accepted,
                            h_first, stride_qkv, stride_slot, stride_head, stride_v, stride_fslot, stride_frow, H,
                            HV, K, V, BV, BK, BT, DO_PRODUCTS, HAS_PENDING, PENDING_ROWS, PENDING_IS_CHAIN,
                            STATE_PRODUCTS, SIGNAL_READY, True)
            slot, accepted, h_first = slot_next, accepted_next, h_next
            slot_next, accepted_next = slot_after, accepted_after
    elif slot >= 0:
        _state_tile(qkv, state, cu_nodes, factors, pending_ancestors, products, ready, first, slot, accepted, h_first,
                    stride_qkv, stride_slot, stride_head, stride_v, stride_fslot, stride_frow, H, HV, K, V, BV, BK,
                    BT, DO_PRODUCTS, HAS_PENDING, PENDING_ROWS, PENDING_IS_CHAIN, STATE_PRODUCTS, SIGNAL_READY,
                    STATE_FIRST)


@triton.jit
def _tile(t, HV: tl.constexpr, V: tl.constexpr, BV: tl.constexpr):
    """Tile t: (request, value head, its first value row); tiles are request-major, then head, then row block."""
    ROW_BLOCKS: tl.constexpr = V // BV
    return t // (HV * ROW_BLOCKS), (t // ROW_BLOCKS) % HV, (t % ROW_BLOCKS) * BV


@triton.jit
def _tile_request(state_indices, pending_nodes, t, tiles, TILES_PER_REQUEST: tl.constexpr, HAS_PENDING: tl.constexpr):
    """Tile t's (slot, accepted node of the pending commit); past the last tile a padding request's slot, -1."""
    inside = t < tiles
    request = t // TILES_PER_REQUEST
    slot = tl.load(state_indices + request, mask=inside, other=-1).to(tl.int64)
    if HAS_PENDING:
        accepted = tl.load(pending_nodes + request, mask=inside, other=-1)
    else:
        accepted = tl.full([], -1, tl.int32)
    return slot, accepted


@triton.jit
def _prefetch_rows(state, state_indices, t, tiles, stride_slot, stride_head, stride_v, HV: tl.constexpr,
                   K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr, TILES_PER_REQUEST: tl.constexpr):
    """Tile t's state rows (BV rows of K, contiguous) into the L2, if t is a tile with a slot."""
    slot = tl.load(state_indices + t // TILES_PER_REQUEST, mask=t < tiles, other=-1).to(tl.int64)
    if slot >= 0:
        _, i_hv, v0 = _tile(t, HV, V, BV)
        _l2_prefetch(state + slot * stride_slot + i_hv * stride_head + v0 * stride_v,
                     BV * K * state.dtype.element_ty.primitive_bitwidth // 8)


@triton.jit
def _l2_prefetch(address, BYTES: tl.constexpr):
    """cp.async.bulk.prefetch.L2 of BYTES contiguous bytes at `address` (both multiples of 16), from the program's
    first thread: no registers wait for it."""
    tl.inline_asm_elementwise(
        "{ .reg .pred first; .reg .b32 thread; mov.u32 thread, %tid.x; setp.eq.u32 first, thread, 0; "
        "@first cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r", [address, tl.full([], BYTES, tl.int32)], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _first_chunk(state, slot, t, stride_slot, stride_head, stride_v, HV: tl.constexpr, V: tl.constexpr,
                 BV: tl.constexpr, BK: tl.constexpr):
    """Tile t's state rows, key columns 0 .. BK - 1 (zeros for a negative slot: nothing is read)."""
    _, i_hv, v0 = _tile(t, HV, V, BV)
    o_v = v0 + tl.arange(0, BV)
    p = (state + tl.maximum(slot, 0) * stride_slot + i_hv * stride_head + o_v[:, None] * stride_v +
         tl.arange(0, BK)[None, :])
    return tl.load(p, mask=(o_v[:, None] * 0 + slot) >= 0, other=0.0)


@triton.jit
def _state_tile(qkv, state, cu_nodes, factors, pending_ancestors, products, ready, t, slot, accepted, h_first,
                stride_qkv, stride_slot, stride_head, stride_v, stride_fslot, stride_frow, H: tl.constexpr,
                HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr, BK: tl.constexpr,
                BT: tl.constexpr, DO_PRODUCTS: tl.constexpr, HAS_PENDING: tl.constexpr, PENDING_ROWS: tl.constexpr,
                PENDING_IS_CHAIN: tl.constexpr, STATE_PRODUCTS: tl.constexpr, SIGNAL_READY: tl.constexpr,
                FIRST_LOADED: tl.constexpr):
    """Tile t of a slot (FIRST_LOADED: h_first is its first key chunk, already loaded): the pending commit of node
    `accepted` in place (none for -1), the products.
    SIGNAL_READY: then one arrival on its (request, head)'s counter, released after every thread's stores."""
    i_b, i_hv, v0 = _tile(t, HV, V, BV)
    o_v = v0 + tl.arange(0, BV)
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
        bos = tl.load(cu_nodes + i_b)
        n = tl.load(cu_nodes + i_b + 1) - bos
        kq_row, kq_ok = _node_kq_columns(qkv, bos, n, stride_qkv, i_hv // (HV // H), H, K, BT, True)
        acc = tl.zeros([BV, NQ], dtype=tl.float32)
    for i_k in tl.static_range(K // BK):
        cols = i_k * BK + o_kc
        if i_k == 0 and FIRST_LOADED:
            h = h_first.to(tl.float32)
        else:
            h = tl.load(p_state + cols[None, :]).to(tl.float32)
        if HAS_PENDING:
            keys = ()
            for d in tl.static_range(PENDING_ROWS):
                keys = keys + (tl.load(f_k + p_rows[d] + cols, mask=p_on[d], other=0.0),)
            h = _committed_chunk(h, p_root[0], p_wu, keys, 0, 1, PENDING_ROWS).to(state.dtype.element_ty)
            tl.store(p_state + cols[None, :], h, mask=store_commit)
            h = h.to(tl.float32)
        if DO_PRODUCTS:
            kq = tl.load(kq_row[None, :] + cols[:, None], mask=kq_ok[None, :], other=0.0).to(tl.float32)
            acc = _state_products(h, kq, acc, STATE_PRODUCTS)
    if DO_PRODUCTS:  # node-major: each column's V values side by side, for the row epilogue's vector loads
        p_out = products + ((i_b * HV + i_hv) * (2 * BT) + o_q[None, :]).to(tl.int64) * V + o_v[:, None]
        tl.store(p_out, acc, mask=(o_q < 2 * BT)[None, :])
    if SIGNAL_READY:
        tl.debug_barrier()  # every thread's stores of the tile before the release (one thread's)
        tl.atomic_add(ready + i_b * HV + i_hv, 1, sem="release", scope="gpu")
