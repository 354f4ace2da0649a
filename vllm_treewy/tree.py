"""Draft-tree topology.

A draft tree is a parent array over T draft nodes in parent-before-child order: ``parents[i]`` is the index of
node i's parent, or -1 when node i hangs directly below the committed state (the root, which is not a node).
A chain of k drafts is ``parents = [-1, 0, 1, ..., k-2]``.

Depth counts nodes on the root-to-node path, the node included: children of the committed state have depth 1.
With this count the tree's strict-ancestor matrix G is nilpotent of index ``max_depth`` (``G**max_depth == 0``).

A batch of trees is packed end to end: node n of the batch belongs to the request b with
``cu_nodes[b] <= n < cu_nodes[b+1]``, and ``parents[n]`` stays a LOCAL index within that request (-1 = child of
the request's committed state).
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch


def _validated_parents(parents: Sequence[int]) -> tuple[int, ...]:
    checked = []
    for i, parent in enumerate(parents):
        if isinstance(parent, bool):
            raise ValueError(f"parents[{i}] = {parent!r} is a bool, expected an integer index")
        try:
            parent = operator.index(parent)
        except TypeError:
            raise ValueError(f"parents[{i}] = {parent!r} is not an integer index") from None
        if not -1 <= parent < i:
            raise ValueError(
                f"parents[{i}] = {parent}: a parent must be -1 (the committed state) or an earlier node in [0, {i})"
            )
        checked.append(parent)
    return tuple(checked)


@dataclass(frozen=True)
class DraftTree:
    """Topology of one request's draft tree; ``DraftTree(parents)`` validates any parent array."""

    parents: tuple[int, ...]
    depth: tuple[int, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        parents = _validated_parents(self.parents)
        depth: list[int] = []
        for parent in parents:
            depth.append(1 if parent < 0 else depth[parent] + 1)
        object.__setattr__(self, "parents", parents)
        object.__setattr__(self, "depth", tuple(depth))

    @classmethod
    def from_widths(cls, widths: Sequence[int]) -> DraftTree:
        """Complete tree with ``widths[l]`` children per node at level l, numbered breadth first.

        ``[1] * k`` is a chain of k drafts; ``[2, 2, 1]`` has 2 + 4 + 4 = 10 draft nodes. Equal widths give the same
        (immutable) instance: the engine asks for its tree in every step.
        """
        widths = tuple(widths)
        for level_no, width in enumerate(widths):
            if isinstance(width, bool) or not isinstance(width, int) or width < 1:
                raise ValueError(f"draft_tree_widths[{level_no}] = {width!r}: widths must be positive integers")
        return _complete_tree(widths)

    @property
    def num_nodes(self) -> int:
        return len(self.parents)

    @property
    def max_depth(self) -> int:
        return max(self.depth, default=0)

    def ancestor_mask(self, device: torch.device | str | None = None) -> torch.Tensor:
        """Bool ``[T, T]``: ``mask[i, j]`` is True iff node j is a strict ancestor of node i."""
        mask = torch.zeros(self.num_nodes, self.num_nodes, dtype=torch.bool)
        for i, parent in enumerate(self.parents):
            if parent >= 0:
                mask[i] = mask[parent]
                mask[i, parent] = True
        return mask.to(device)

    def breadth_first_order(self) -> tuple[int, ...]:
        """Node indices sorted by depth (stable), a parent-before-child order level by level."""
        return tuple(sorted(range(self.num_nodes), key=self.depth.__getitem__))

    def with_root(self) -> DraftTree:
        """The verified tree: node 0 is the root (the last accepted token), the drafts follow shifted by one.

        vLLM verifies 1 + N tokens; the root's state is the committed state advanced by the last accepted token.
        """
        return DraftTree((-1,) + tuple(parent + 1 for parent in self.parents))


@dataclass(frozen=True)
class PackedTrees:
    """A batch of draft trees packed end to end on one device (see the module docstring)."""

    parents: torch.Tensor  # [N] int32, local parent index, -1 = child of the committed state
    cu_nodes: torch.Tensor  # [B+1] int32 node offsets per request
    depth: torch.Tensor  # [N] int32, >= 1
    ancestor_mask: torch.Tensor  # [N, max_nodes] bool, column j = local node j is a strict ancestor
    max_depth: int
    max_nodes: int

    @property
    def num_requests(self) -> int:
        return self.cu_nodes.numel() - 1

    @property
    def num_nodes(self) -> int:
        return self.parents.numel()


@functools.cache
def _complete_tree(widths: tuple[int, ...]) -> DraftTree:
    """`DraftTree.from_widths` for validated widths, built once per widths."""
    parents: list[int] = []
    level = [-1]
    for width in widths:
        next_level = []
        for parent in level:
            for _ in range(width):
                next_level.append(len(parents))
                parents.append(parent)
        level = next_level
    return DraftTree(tuple(parents))


def pack_trees(
    trees: Sequence[DraftTree | Sequence[int]], device: torch.device | str | None = None
) -> PackedTrees:
    """Pack per-request trees (``DraftTree`` or parent arrays; empty trees allowed) into one batch."""
    trees = [tree if isinstance(tree, DraftTree) else DraftTree(tuple(tree)) for tree in trees]
    max_nodes = max((tree.num_nodes for tree in trees), default=0)
    cu_nodes = [0]
    for tree in trees:
        cu_nodes.append(cu_nodes[-1] + tree.num_nodes)
    masks = [
        torch.nn.functional.pad(tree.ancestor_mask(), (0, max_nodes - tree.num_nodes)) for tree in trees
    ]

    def int32(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int32, device=device)

    return PackedTrees(
        parents=int32([p for tree in trees for p in tree.parents]),
        cu_nodes=int32(cu_nodes),
        depth=int32([d for tree in trees for d in tree.depth]),
        ancestor_mask=torch.cat(masks).to(device) if masks else torch.zeros(0, 0, dtype=torch.bool, device=device),
        max_depth=max((tree.max_depth for tree in trees), default=0),
        max_nodes=max_nodes,
    )


def node_requests(cu_nodes: torch.Tensor, num_nodes: int | None = None) -> torch.Tensor:
    """``[N]`` int64: the request each packed node belongs to.

    Given ``num_nodes`` (known from the caller's shapes) there is no host sync, so it can run in a CUDA graph; nodes
    past ``cu_nodes[-1]`` (a replayed graph's padding) count as the last request's.
    """
    cu_nodes = cu_nodes.long()
    num_nodes = int(cu_nodes[-1]) if num_nodes is None else num_nodes
    nodes = torch.arange(num_nodes, device=cu_nodes.device)
    return torch.searchsorted(cu_nodes[1:], nodes, right=True).clamp(max=max(cu_nodes.numel() - 2, 0))


def global_parents(parents: torch.Tensor, cu_nodes: torch.Tensor) -> torch.Tensor:
    """``[N]`` int64: each packed node's parent as an index into the batch, -1 for children of the committed state."""
    parents = parents.long()
    offsets = cu_nodes.long()[node_requests(cu_nodes)]
    return torch.where(parents >= 0, parents + offsets, parents)


def packed_depths(parents: torch.Tensor, cu_nodes: torch.Tensor) -> torch.Tensor:
    """``[N]`` int64 depth of every packed node, by walking parent pointers (one host sync per level)."""
    parent_of = global_parents(parents, cu_nodes)
    depth = torch.ones_like(parent_of)
    ancestor = parent_of
    while bool((ancestor >= 0).any()):
        on_path = ancestor >= 0
        depth += on_path
        ancestor = torch.where(on_path, parent_of[ancestor.clamp(min=0)], ancestor)
    return depth


def chain_parents(cu_nodes: torch.Tensor, num_nodes: int) -> torch.Tensor:
    """``[num_nodes]`` int32 local parents of packed chains (-1, 0, 1, ... within every request).

    No host sync (the node count comes from the caller's shapes), so it can run inside a CUDA graph.
    """
    nodes = torch.arange(num_nodes, device=cu_nodes.device)
    return (nodes - cu_nodes.long()[node_requests(cu_nodes, num_nodes)] - 1).to(torch.int32)
