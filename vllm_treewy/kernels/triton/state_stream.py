"""The state pass (`state_pass`) as a stream: program p takes tiles p, p + programs, ..., a tile BV value rows of a
head and all its K columns (a padding request's tiles store nothing), and the state tiles arrive by TMA into shared
memory, which Triton's pipeliner issues STAGES - 1 tiles ahead. So a program
has state bytes in flight while it commits a tile, without registers holding them (kernels.md, 2026-12-02e: the
program-per-tile state pass waits on its loads at two 8-warp programs an SM, and every register spent on a
prefetched tile cost a program an SM). The tiles' slots, accepted nodes and node ranges are gathered before the
loop, so no copy waits on an index load. The same math as `state_pass` (`_committed_chunk`, `_state_products`):
the same committed state bit for bit."""

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents

from .state_ops import (_committed_chunk, _factor_columns, _node_kq_columns, _pending_path, _pending_values,
                        _state_products)


@triton.jit
def _tile(t, HV: tl.constexpr, V: tl.constexpr, BV: tl.constexpr):
    """Tile t: (request, value head, its first value row); request-major, then head, then row block (the order of a
    program-per-tile grid's programs)."""
    ROW_BLOCKS: tl.constexpr = V // BV
    return t // (HV * ROW_BLOCKS), (t // ROW_BLOCKS) % HV, (t % ROW_BLOCKS) * BV


@triton.jit
def _pick(values, index, k):
    """values[k] of a small per-program vector (index: its arange), as a scalar: a select and a sum, no load."""
    return tl.sum(tl.where(index == k, values, 0), 0)


# integer arrays read as gathers, not specialised on alignment (as `_state_pass_kernel`)
@triton.jit(do_not_specialize=["state_indices", "cu_nodes", "pending_nodes", "pending_ancestors", "tiles"])
def _state_stream_kernel(
    qkv, state, state_desc, state_indices, cu_nodes, factors, pending_nodes, pending_ancestors, products, tiles,
    stride_qkv, stride_slot, stride_head, stride_v, stride_fslot, stride_frow,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr, BT: tl.constexpr,
    DO_PRODUCTS: tl.constexpr, HAS_PENDING: tl.constexpr, PENDING_ROWS: tl.constexpr, PENDING_IS_CHAIN: tl.constexpr,
    STATE_PRODUCTS: tl.constexpr, LAUNCH_DEPENDENTS: tl.constexpr, TILES_PER_PROGRAM: tl.constexpr,
    STAGES: tl.constexpr,
):
    """state_desc: a TMA descriptor over the pool [S, HV, V, K], block [1, 1, BV, K]. TILES_PER_PROGRAM: at least
    the tiles of any program, a power of two (the gathered vectors' length)."""
    if LAUNCH_DEPENDENTS:
        gdc_launch_dependents()
    first = tl.program_id(0)
    programs = tl.num_programs(0)
    TILES_PER_REQUEST: tl.constexpr = HV * (V // BV)
    o_t = tl.arange(0, TILES_PER_PROGRAM)
    mine = first + o_t * programs
    inside = mine < tiles
    requests = mine // TILES_PER_REQUEST
    slots = tl.load(state_indices + requests, mask=inside, other=-1)
    if HAS_PENDING:
        accepted_nodes = tl.load(pending_nodes + requests, mask=inside, other=-1)
    if DO_PRODUCTS:
        starts = tl.load(cu_nodes + requests, mask=inside, other=0)
        ends = tl.load(cu_nodes + requests + 1, mask=inside, other=0)
    o_k = tl.arange(0, K)
    for k in tl.range(0, tl.cdiv(tiles - first, programs), num_stages=STAGES):
        t = first + k * programs
        i_b, i_hv, v0 = _tile(t, HV, V, BV)
        slot = _pick(slots, o_t, k)
        live = slot >= 0  # a padding request's tile: nothing read through its slot, nothing stored
        slot = tl.maximum(slot, 0).to(tl.int64)
        h = state_desc.load([slot.to(tl.int32), i_hv, v0, 0]).reshape(BV, K).to(tl.float32)
        o_v = v0 + tl.arange(0, BV)
        p_state = state + slot * stride_slot + i_hv * stride_head + o_v[:, None] * stride_v + o_k[None, :]
        if HAS_PENDING:
            accepted = tl.where(live, _pick(accepted_nodes, o_t, k), -1)
            f_k, f_kscale, f_u, f_g = _factor_columns(factors, slot, stride_fslot, i_hv, HV, K, V)
            p_rows, p_on, p_weight, p_root = _pending_path(
                accepted, pending_ancestors, f_kscale, f_g, stride_frow, 1, PENDING_ROWS, PENDING_IS_CHAIN)
            p_wu = _pending_values(f_u, p_rows, p_on, p_weight, o_v, V, 1, PENDING_ROWS)
            keys = ()
            for d in tl.static_range(PENDING_ROWS):
                keys = keys + (tl.load(f_k + p_rows[d] + o_k, mask=p_on[d], other=0.0),)
            h = _committed_chunk(h, p_root[0], p_wu, keys, 0, 1, PENDING_ROWS).to(state.dtype.element_ty)
            tl.store(p_state, h, mask=(o_v[:, None] * 0 + accepted) >= 0)
            h = h.to(tl.float32)
        if DO_PRODUCTS:
            NQ: tl.constexpr = max(16, 2 * BT)
            o_q = tl.arange(0, NQ)
            bos = _pick(starts, o_t, k)
            n = tl.where(live, _pick(ends, o_t, k) - bos, 0)
            kq_row, kq_ok = _node_kq_columns(qkv, bos, n, stride_qkv, i_hv // (HV // H), H, K, BT, True)
            kq = tl.load(kq_row[None, :] + o_k[:, None], mask=kq_ok[None, :], other=0.0).to(tl.float32)
            acc = _state_products(h, kq, tl.zeros([BV, NQ], dtype=tl.float32), STATE_PRODUCTS)
            p_out = products + ((i_b * HV + i_hv) * (2 * BT) + o_q[None, :]).to(tl.int64) * V + o_v[:, None]
            tl.store(p_out, acc, mask=(o_q < 2 * BT)[None, :] & live)
