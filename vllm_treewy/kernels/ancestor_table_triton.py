"""Tree ancestry as data for the Triton kernels: the ancestor table in one launch (`ancestor_table_triton`), built
once per step, and the jit lookup of a node's d-th ancestor (`_ancestor`). Torch twin:
`vllm_treewy.kernels.ancestor_table_torch`.

Node indices are LOCAL to their request (0 .. n-1). Trees come as an ancestor table `ancestors [N, D]` (int32,
D = max_depth): `ancestors[bos + i, d]` is the local index of i's d-th ancestor (d = 0: i itself), -1 past the
root. Every entry is one independent load, so no kernel waits on a chain of parent lookups. Chains need no table
(the d-th ancestor of i is i - d). Log decays between a node and an ancestor are running sums of g strictly below
the ancestor along the walk, never differences of two long path sums (which would lose small decays).
"""

import torch
import triton
import triton.language as tl

from .ancestor_table_torch import ancestor_table_torch


def ancestor_table(parents: torch.Tensor, cu_nodes: torch.Tensor, max_depth: int) -> torch.Tensor:
    """`ancestors [N, max_depth]` int32 from local `parents [N]` and `cu_nodes [B+1]`; no host sync (capturable).
    Build it once per step: every GDN layer shares the tree. CUDA: one launch; elsewhere (the interpreter's CPU
    tensors) the torch twin."""
    if parents.is_cuda:
        return ancestor_table_triton(parents, cu_nodes, max_depth)
    return ancestor_table_torch(parents, cu_nodes, max_depth)


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
