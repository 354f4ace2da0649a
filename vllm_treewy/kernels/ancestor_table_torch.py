"""The ancestor table of packed draft trees, in torch (the CPU path and the twin of
`vllm_treewy.kernels.ancestor_table_triton`).

Node indices are LOCAL to their request (0 .. n-1): `ancestors [N, D]` (int32) from local `parents [N]` and
`cu_nodes [B+1]`, `ancestors[bos + i, d]` the local index of i's d-th ancestor (d = 0: i itself), -1 past the root.
No host sync.
"""

import torch


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
