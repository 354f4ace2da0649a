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
    """For the BT (padded) nodes of one request and value head: on_path[i, j] (j on the root-to-i path, i
    included), log_decay[i, j] = c_i - c_j there (0 elsewhere), and c_i = sum of g over i's path."""
    rows = tl.arange(0, BT)
    cur = tl.where(rows < n, rows, -1)
    running = tl.zeros([BT], dtype=tl.float32)
    on_path = (rows[:, None] + rows[None, :]) < 0
    log_decay = tl.zeros([BT, BT], dtype=tl.float32)
    # every node walks up at once, one level per step
    for step in tl.static_range(MAX_ANC + 1):
        hit = rows[None, :] == cur[:, None]
        on_path = on_path | hit
        log_decay = tl.where(hit, running[:, None], log_decay)
        running += tl.load(g + (bos + cur) * HV + i_hv, mask=cur >= 0, other=0.0).to(tl.float32)
        if step < MAX_ANC:
            cur = _step_up(parents, bos, cur, IS_CHAIN)
    return on_path, log_decay, running


@triton.jit
def rebuild_tile(h0, k, u, g, parents, bos, node, i_h, i_hv, o_v,
                 H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                 BP: tl.constexpr, MAX_ANC: tl.constexpr, IS_CHAIN: tl.constexpr, PRECISION: tl.constexpr):
    """h_node = exp(c_node) h0 + sum_{j on path(node)} exp(c_node - c_j) u_j k_j^T for one [BV, K] tile of the
    [V, K] state; h0 as fp32 registers, u fp32 [N, HV, V]."""
    slots = tl.arange(0, BP)
    nodes = tl.full([BP], -1, tl.int32)
    log_weight = tl.zeros([BP], dtype=tl.float32)
    running = 0.0
    cur = node
    for d in tl.static_range(MAX_ANC + 1):
        nodes = tl.where(slots == d, cur, nodes)
        log_weight = tl.where(slots == d, running, log_weight)
        running += tl.load(g + (bos + cur) * HV + i_hv, mask=cur >= 0, other=0.0).to(tl.float32)
        if d < MAX_ANC:
            cur = _step_up(parents, bos, cur, IS_CHAIN)
    on_path = nodes >= 0
    weight = tl.where(on_path, tl.exp(log_weight), 0.0)
    o_k = tl.arange(0, K)
    u_path = tl.load(u + ((bos + nodes) * HV + i_hv)[:, None] * V + o_v[None, :], mask=on_path[:, None], other=0.0)
    k_path = tl.load(k + ((bos + nodes) * H + i_h)[:, None] * K + o_k[None, :], mask=on_path[:, None], other=0.0)
    delta = tl.dot(tl.trans(u_path.to(tl.float32) * weight[:, None]), k_path.to(tl.float32),
                   input_precision=PRECISION)
    return tl.exp(running) * h0 + delta
