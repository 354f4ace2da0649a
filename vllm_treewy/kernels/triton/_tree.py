"""Triton helpers shared by the verify and commit kernels: tree ancestry as data, and the rebuild of one
committed state tile from its accepted path's factors.

Node indices are LOCAL to their request (0 .. n-1); `parents[bos + i]` is i's parent, -1 for children of the
committed state, parents before children (`vllm_treewy.tree`). MAX_ANC bounds the strict ancestors of a node
(the tree's max_depth - 1). Log decays between a node and its ancestor are accumulated along the walk as sums of
g strictly below the ancestor, never as differences of two long path sums (which would lose small decays).
"""

import triton
import triton.language as tl


@triton.jit
def _step_up(parents, bos, cur, IS_CHAIN: tl.constexpr):
    if IS_CHAIN:
        return tl.where(cur >= 0, cur - 1, -1)
    return tl.load(parents + bos + cur, mask=cur >= 0, other=-1)


@triton.jit
def ancestry(parents, g, bos, n, i_hv, HV: tl.constexpr, BT: tl.constexpr, MAX_ANC: tl.constexpr,
             IS_CHAIN: tl.constexpr):
    """For the BT (padded) nodes of one request and value head: decay[i, j] = exp(c_i - c_j) for j on the
    root-to-i path (i included), 0 elsewhere; and c_i, the sum of g over i's path."""
    rows = tl.arange(0, BT)
    cur = tl.where(rows < n, rows, -1)
    running = tl.zeros([BT], dtype=tl.float32)
    log_decay = tl.full([BT, BT], float("-inf"), tl.float32)
    # every node walks up at once, one level per step
    for step in tl.static_range(MAX_ANC + 1):
        log_decay = tl.where(rows[None, :] == cur[:, None], running[:, None], log_decay)
        running += tl.load(g + (bos + cur) * HV + i_hv, mask=cur >= 0, other=0.0).to(tl.float32)
        if step < MAX_ANC:
            cur = _step_up(parents, bos, cur, IS_CHAIN)
    return tl.exp(log_decay), running


@triton.jit
def path_factors(k, u, g, parents, bos, node, i_h, i_hv, o_v,
                 H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                 BP: tl.constexpr, MAX_ANC: tl.constexpr, IS_CHAIN: tl.constexpr):
    """What the rebuild of h_node needs besides h0, for the value rows o_v: the path's key rows (offsets into k and
    mask), exp(c_node - c_j) u_j as [BP, BV] fp32, and exp(c_node)."""
    slots = tl.arange(0, BP)
    nodes = tl.full([BP], -1, tl.int32)
    log_weight = tl.zeros([BP], dtype=tl.float32)
    running = tl.zeros([BP], dtype=tl.float32)
    cur = node
    for d in tl.static_range(MAX_ANC + 1):
        nodes = tl.where(slots == d, cur, nodes)
        log_weight = tl.where(slots == d, running, log_weight)
        running += tl.load(g + (bos + cur) * HV + i_hv, mask=cur >= 0, other=0.0).to(tl.float32)
        if d < MAX_ANC:
            cur = _step_up(parents, bos, cur, IS_CHAIN)
    on_path = nodes >= 0
    weight = tl.where(on_path, tl.exp(log_weight), 0.0)
    u_path = tl.load(u + ((bos + nodes) * HV + i_hv)[:, None] * V + o_v[None, :], mask=on_path[:, None], other=0.0)
    k_rows = ((bos + nodes) * H + i_h) * K
    return k_rows, on_path, u_path.to(tl.float32) * weight[:, None], tl.max(tl.exp(running), 0)


@triton.jit
def rebuild_chunk(h0, k, k_rows, on_path, weighted_u, root_weight, o_k, PRECISION: tl.constexpr):
    """h_node = exp(c_node) h0 + sum_{j on path(node)} exp(c_node - c_j) u_j k_j^T on one [BV, BK] chunk of the
    state (h0 as fp32, o_k the chunk's key columns)."""
    k_path = tl.load(k + k_rows[:, None] + o_k[None, :], mask=on_path[:, None], other=0.0).to(tl.float32)
    return root_weight * h0 + tl.dot(tl.trans(weighted_u), k_path, input_precision=PRECISION)
