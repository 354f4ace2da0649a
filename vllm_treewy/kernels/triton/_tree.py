"""Tree ancestry as data for the verify and commit kernels, and the rebuild of a committed state from the accepted
path's factors.

Node indices are LOCAL to their request (0 .. n-1). Trees come as an ancestor table `ancestors [N, D]` (int32,
D = max_depth): `ancestors[bos + i, d]` is the local index of i's d-th ancestor (d = 0: i itself), -1 past the
root. Every entry is one independent load, so no kernel waits on a chain of parent lookups. Chains need no table
(the d-th ancestor of i is i - d). Log decays between a node and an ancestor are running sums of g strictly below
the ancestor along the walk, never differences of two long path sums (which would lose small decays).
"""

import torch
import triton
import triton.language as tl


def ancestor_table(parents: torch.Tensor, cu_nodes: torch.Tensor, max_depth: int) -> torch.Tensor:
    """`ancestors [N, max_depth]` int32 from local `parents [N]` and `cu_nodes [B+1]`; no host sync (capturable).
    Build it once per step: every GDN layer shares the tree. CUDA: one launch; elsewhere the torch twin."""
    if parents.is_cuda:
        return ancestor_table_triton(parents, cu_nodes, max_depth)
    return ancestor_table_torch(parents, cu_nodes, max_depth)


def ancestor_table_torch(parents: torch.Tensor, cu_nodes: torch.Tensor, max_depth: int) -> torch.Tensor:
    """Torch twin of `ancestor_table_triton`: the walk up the parents, one step per column, for all nodes at once."""
    num_nodes = parents.numel()
    node = torch.arange(num_nodes, device=parents.device)
    cu = cu_nodes.long()
    start = cu[torch.searchsorted(cu[1:], node, right=True)]
    parent = parents.long()
    global_parent = torch.where(parent >= 0, parent + start, -1)
    table = torch.empty(num_nodes, max(1, max_depth), dtype=torch.int32, device=parents.device)
    cur = node
    for d in range(table.shape[1]):
        table[:, d] = torch.where(cur >= 0, cur - start, -1)
        cur = torch.where(cur >= 0, global_parent[cur.clamp(min=0)], -1)
    return table


@triton.jit
def _ancestor_table_kernel(parents, cu_nodes, table, D: tl.constexpr, BN: tl.constexpr):
    i_b = tl.program_id(0)
    bos = tl.load(cu_nodes + i_b)
    n = tl.load(cu_nodes + i_b + 1) - bos
    for first in range(0, n, BN):
        node = first + tl.arange(0, BN)
        live = node < n
        cur = tl.where(live, node, -1)
        for d in tl.static_range(D):
            tl.store(table + (bos + node) * D + d, cur, mask=live)
            cur = tl.load(parents + bos + cur, mask=cur >= 0, other=-1).to(tl.int32)


def ancestor_table_triton(parents: torch.Tensor, cu_nodes: torch.Tensor, max_depth: int) -> torch.Tensor:
    """`ancestor_table` in one launch, one program per request (the torch twin is a dozen small launches)."""
    table = torch.empty(parents.numel(), max(1, max_depth), dtype=torch.int32, device=parents.device)
    _ancestor_table_kernel[(cu_nodes.numel() - 1,)](parents, cu_nodes, table, D=table.shape[1], BN=64)
    return table


@triton.jit
def _ancestor(ancestors, bos, node, d, D: tl.constexpr, IS_CHAIN: tl.constexpr):
    """d-th ancestor of local `node` (-1 past the root, and for node = -1)."""
    if IS_CHAIN:
        return tl.where((node >= 0) & (node - d >= 0), node - d, -1)
    return tl.load(ancestors + (bos + node) * D + d, mask=node >= 0, other=-1)


@triton.jit
def ancestry(ancestors, g, bos, n, i_hv, HV: tl.constexpr, BT: tl.constexpr, MAX_ANC: tl.constexpr,
             IS_CHAIN: tl.constexpr):
    """For the BT (padded) nodes of one request and value head: decay[i, j] = exp(c_i - c_j) for j on the
    root-to-i path (i included), 0 elsewhere; and c_i, the sum of g over i's path."""
    rows = tl.arange(0, BT)
    node = tl.where(rows < n, rows, -1)
    running = tl.zeros([BT], dtype=tl.float32)
    log_decay = tl.full([BT, BT], float("-inf"), tl.float32)
    for d in tl.static_range(MAX_ANC + 1):
        cur = _ancestor(ancestors, bos, node, d, MAX_ANC + 1, IS_CHAIN)
        log_decay = tl.where(rows[None, :] == cur[:, None], running[:, None], log_decay)
        running += tl.load(g + (bos + cur) * HV + i_hv, mask=cur >= 0, other=0.0).to(tl.float32)
    return tl.exp(log_decay), running


@triton.jit
def path_factors(k, u, g, ancestors, bos, node, i_h, i_hv, o_v,
                 H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                 BP: tl.constexpr, MAX_ANC: tl.constexpr, IS_CHAIN: tl.constexpr):
    """What the rebuild of h_node needs besides h0, for the value rows o_v: the path's key-row offsets into k and
    mask, exp(c_node - c_j) u_j as [BP, BV] fp32, and exp(c_node). node = -1 (nothing accepted) gives an empty
    path and exp(c_node) = 1: the rebuild returns h0 unchanged."""
    slots = tl.arange(0, BP)
    nodes = tl.full([BP], -1, tl.int32)
    log_weight = tl.zeros([BP], dtype=tl.float32)
    running = tl.zeros([BP], dtype=tl.float32)
    for d in tl.static_range(MAX_ANC + 1):
        cur = _ancestor(ancestors, bos, node, d, MAX_ANC + 1, IS_CHAIN)
        nodes = tl.where(slots == d, cur, nodes)
        log_weight = tl.where(slots == d, running, log_weight)
        running += tl.load(g + (bos + cur) * HV + i_hv, mask=cur >= 0, other=0.0).to(tl.float32)
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
