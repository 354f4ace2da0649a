"""Small packed batches for the Triton kernel tests (CPU: TRITON_INTERPRET=1, set in tests/conftest.py)."""

from __future__ import annotations

import pytest
import torch

from vllm_treewy.tree import DraftTree, pack_trees

from .tree_cases import gdn_inputs

pytest.importorskip("triton")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# complete trees (the verified tree: root token first), a ragged deep tree, a single node
TREE_BATCH = [
    DraftTree.from_widths([2, 2, 1]).with_root().parents,
    (-1, 0, 1, 1, 3, -1, 5, 4, 2),
    (-1,),
    DraftTree.from_widths([3, 1]).parents,
]


def packed_gdn(batch, *, dtype=torch.float32, key_heads=2, ratio=2, key_dim=32, value_dim=32, gate="mixed",
               seed=0, spare_slots=2):
    """Inputs of several requests packed end to end, each request's h0 in a shuffled slot of a pool."""
    packed = pack_trees(batch)
    requests = [gdn_inputs(len(p), key_heads, ratio, key_dim, value_dim, gate, seed + b) for b, p in enumerate(batch)]
    q, k, v, g, beta = (torch.cat([r[i] for r in requests]).to(dtype) for i in range(5))
    num_slots = len(batch) + spare_slots
    generator = torch.Generator().manual_seed(seed)
    slots = torch.randperm(num_slots, generator=generator)[: len(batch)].to(torch.int32)
    pool = torch.randn(num_slots, key_heads * ratio, value_dim, key_dim, dtype=torch.float64, generator=generator)
    return packed, (q, k, v, g, beta), pool, slots


def rows(packed, b):
    return slice(int(packed.cu_nodes[b]), int(packed.cu_nodes[b + 1]))


def to_device(*tensors):
    return tuple(t.to(DEVICE) for t in tensors)
