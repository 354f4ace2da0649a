"""Tree ancestry as data for the kernels: the ancestor table, built once per step, and the jit lookup of a node's
d-th ancestor.

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
    # if / else, not an early return: the compiler types every return it reaches, and a chain's `ancestors` may be
    # any placeholder pointer (the dead load's type would clash with the chain's int32).
    if IS_CHAIN:
        return tl.where((node >= 0) & (node - d >= 0), node - d, -1)
    else:
        return tl.load(ancestors + (bos + node) * D + d, mask=node >= 0, other=-1)
