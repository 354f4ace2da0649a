"""Greedy acceptance of packed draft trees, and the full-attention KV moves that compact the accepted path.

Conventions (topology as in ``vllm_treewy.tree``):

- A *node* is one draft token of a request's draft tree. Nodes are numbered locally per request in
  parent-before-child order; ``parents[n]`` is the local index of node n's parent, -1 when the parent is the root.
  A batch is packed end to end: request b owns packed nodes ``cu_nodes[b] <= n < cu_nodes[b+1]``.
- The *root* is the request's last accepted token (vLLM's bonus token of the previous step). It is not a node,
  but the target verifies it together with the nodes.
- The *verified block* of request b is its root followed by its N_b nodes in node order: block index 0 is the
  root, block index 1 + j is local node j. Blocks are packed end to end too, request b's block starting at
  ``cu_nodes[b] + b`` (``verified_block_offsets``). This is ``DraftTree.with_root()``'s numbering, the tokens the
  GDN layers verify: in it the node to commit is ``last_accepted_node + 1`` (0 = the root).
- The target's *argmax* at a verified token is its greedy prediction for the token that FOLLOWS it.
- The *bonus* token is the target's argmax at the last accepted node (at the root when nothing is accepted): the
  one token each request gains beyond its accepted drafts; it becomes the next step's root.

Everything on tensors here is free of host syncs and data-dependent shapes (a Python-int bound on the depth
replaces the walk's stopping test), so the adapter can run it inside a CUDA graph. The ``*_reference`` functions
are plain-Python twins for the tests.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch

from ..tree import node_requests


class TreeAcceptance(NamedTuple):
    """Per-request result of tree acceptance, greedy or sampled (all int64, B = number of requests)."""

    num_accepted: torch.Tensor  # [B] accepted draft nodes, 0..max_depth (the bonus token not counted)
    accepted_nodes: torch.Tensor  # [B, max_depth] local node indices root-to-leaf, -1 padding after num_accepted
    last_accepted_node: torch.Tensor  # [B] local index of the deepest accepted node, -1 = none (the root)
    bonus_tokens: torch.Tensor  # [B] the target's token after last_accepted_node (at the root when it is -1)


class KVMoves(NamedTuple):
    """KV copies that compact each request's accepted path (int64 positions, -1 = no copy)."""

    sources: torch.Tensor  # [B, max_depth]
    destinations: torch.Tensor  # [B, max_depth]


def verified_block_offsets(cu_nodes: torch.Tensor) -> torch.Tensor:
    """``[B+1]`` int64 offsets of the packed verified blocks (root + nodes): ``cu_nodes[b] + b``."""
    cu_nodes = cu_nodes.long()
    return cu_nodes + torch.arange(cu_nodes.numel(), device=cu_nodes.device)


def greedy_tree_acceptance(
    parents: torch.Tensor,
    cu_nodes: torch.Tensor,
    draft_tokens: torch.Tensor,
    target_argmax: torch.Tensor,
    max_depth: int,
) -> TreeAcceptance:
    """Accept the longest root-to-node path whose every token is the target's argmax at its parent.

    ``parents [N]``: local parent per packed node (-1 = child of the root); ``cu_nodes [B+1]``: node offsets;
    ``draft_tokens [N]``: each node's token; ``target_argmax [N+B]``: the target's argmax at every verified token,
    in verified-block order (per request: root, then its nodes; see the module docstring).
    ``max_depth``: a Python int >= every tree's depth (``PackedTrees.max_depth``); the walk takes exactly that
    many levels, and a smaller bound caps acceptance at ``max_depth`` nodes.

    Rule: from the root, move to the child whose draft token equals the target's argmax at the current node; stop
    at the first level where no child matches. Children of a node should carry distinct tokens; where several
    match, the first in node order (the smallest local index) is taken. A chain is the tree of single children.
    """
    num_nodes = parents.numel()
    num_requests = cu_nodes.numel() - 1
    if target_argmax.shape != (num_nodes + num_requests,):
        raise ValueError(
            f"target_argmax has shape {tuple(target_argmax.shape)}, expected ({num_nodes + num_requests},): "
            "the root and every node of each request"
        )
    block_start = verified_block_offsets(cu_nodes)[:-1]  # [B] packed verified index of each root

    def argmax_at(level: int, current: torch.Tensor) -> torch.Tensor:
        return target_argmax[block_start + 1 + current]  # block index 1 + local (the root: -1 -> 0)

    return walk_tree(parents, cu_nodes, draft_tokens, max_depth, argmax_at)


def walk_tree(
    parents: torch.Tensor,
    cu_nodes: torch.Tensor,
    draft_tokens: torch.Tensor,
    max_depth: int,
    token_at: Callable[[int, torch.Tensor], torch.Tensor],
) -> TreeAcceptance:
    """The tree walk that greedy and sampled acceptance share: from the root, at every level ask
    ``token_at(level, current)`` for the target's token after each request's current node (``current [B]`` local
    node, -1 = the root; returns ``[B]``), move to the child that carries it, and stop at the first level where no
    child does. The token asked at the last current node is the bonus. ``token_at`` is called exactly
    ``max_depth + 1`` times, in level order (a stopped request keeps its node, so later calls ask about it again and
    their answers are not used); it may draw fresh randomness on every call.

    Shapes as in ``greedy_tree_acceptance``. No host syncs, static shapes.
    """
    num_nodes = parents.numel()
    num_requests = cu_nodes.numel() - 1
    if draft_tokens.shape != (num_nodes,):
        raise ValueError(f"draft_tokens has shape {tuple(draft_tokens.shape)}, expected ({num_nodes},)")
    device = parents.device
    cu_nodes = cu_nodes.long()
    parents = parents.long()
    request_of_node = node_requests(cu_nodes, num_nodes)
    node_ids = torch.arange(num_nodes, device=device)
    local_of_node = node_ids - cu_nodes[request_of_node]
    no_match = torch.full((num_requests,), num_nodes, dtype=torch.long, device=device)

    # A request that found no match keeps its current node, so every later level repeats the same failed search:
    # the walk stays stopped without a flag.
    current = torch.full((num_requests,), -1, dtype=torch.long, device=device)  # local node, -1 = root
    stopped = torch.zeros(num_requests, dtype=torch.bool, device=device)
    bonus_tokens = torch.zeros(num_requests, dtype=torch.long, device=device)
    accepted_nodes = torch.full((num_requests, max_depth), -1, dtype=torch.long, device=device)
    for level in range(max_depth + 1):
        wanted = token_at(level, current).long()
        bonus_tokens = torch.where(stopped, bonus_tokens, wanted)
        if level == max_depth:
            break
        matches = (parents == current[request_of_node]) & (draft_tokens == wanted[request_of_node])
        first_match = no_match.scatter_reduce(
            0, request_of_node, torch.where(matches, node_ids, num_nodes), reduce="amin"
        )
        found = (first_match < num_nodes) & ~stopped
        local_match = local_of_node[first_match.clamp(max=max(num_nodes - 1, 0))] if num_nodes else current
        current = torch.where(found, local_match, current)
        accepted_nodes[:, level] = torch.where(found, current, -1)
        stopped = stopped | ~found

    num_accepted = (accepted_nodes >= 0).sum(dim=1)
    return TreeAcceptance(num_accepted, accepted_nodes, current, bonus_tokens)


class UniformWalkTables(NamedTuple):
    """One tree's static tables for ``uniform_tree_acceptance`` on a device (``UniformWalkTables.of``)."""

    parent_blocks: torch.Tensor  # [N] int64 verified-block index of each node's parent (the root: 0)
    earlier_siblings: torch.Tensor  # [N, N] bool: [m, n] where m is a sibling of n before it in node order
    not_ancestor: torch.Tensor  # [N, N] bool: [m, n] where m is neither n nor an ancestor of n
    node_at_depth: torch.Tensor  # [N, D] bool: [n, d] where node n has depth d + 1
    node_ids: torch.Tensor  # [N, 1] int64 local node index

    @classmethod
    def of(cls, parents: Sequence[int], device) -> UniformWalkTables:
        num_nodes = len(parents)
        depth: list[int] = []
        ancestors: list[set[int]] = []
        for node, parent in enumerate(parents):
            depth.append(1 if parent < 0 else depth[parent] + 1)
            ancestors.append({node} | (ancestors[parent] if parent >= 0 else set()))
        max_depth = max(depth, default=0)
        earlier = [[parents[m] == parents[n] and m < n for n in range(num_nodes)] for m in range(num_nodes)]
        not_ancestor = [[m not in ancestors[n] for n in range(num_nodes)] for m in range(num_nodes)]
        at_depth = [[depth[n] == d + 1 for d in range(max_depth)] for n in range(num_nodes)]
        return cls(torch.tensor(parents, dtype=torch.long, device=device).view(num_nodes) + 1,
                   torch.tensor(earlier, dtype=torch.bool, device=device).view(num_nodes, num_nodes),
                   torch.tensor(not_ancestor, dtype=torch.bool, device=device).view(num_nodes, num_nodes),
                   torch.tensor(at_depth, dtype=torch.bool, device=device).view(num_nodes, max_depth),
                   torch.arange(num_nodes, device=device).view(num_nodes, 1))


def uniform_tree_acceptance(tables: UniformWalkTables, draft_tokens: torch.Tensor, block_tokens: torch.Tensor
                            ) -> TreeAcceptance:
    """``walk_tree``'s result for a batch whose requests all draft the same tree, from the target's token at EVERY
    verified token given at once (greedy: the argmaxes; sampled: one draw per node, ``tree_sampling``), in a fixed
    number of tensor ops whatever the depth (the walk takes about ten per level).

    ``tables``: the tree's ``UniformWalkTables`` (N >= 1 nodes); ``draft_tokens [B, N]``: each request's nodes' tokens;
    ``block_tokens [B, 1 + N]``: the target's token after each verified-block token (root, then the nodes). The
    result is ``greedy_tree_acceptance``'s on the same tokens (``max_depth`` = the tree's depth), every field: a
    node is *chosen* when its token is the one at its parent and no earlier sibling's is (the walk's first match),
    and accepted when it and all its ancestors are chosen (the walk reaches it); the accepted nodes form one path
    from the root, one per depth, whose deepest has the largest index (node order is parent before child).
    No host syncs, static shapes.
    """
    parent_tokens = block_tokens[:, tables.parent_blocks]
    return walk_of_matches(tables, draft_tokens == parent_tokens, block_tokens)


def walk_of_matches(tables: UniformWalkTables, match: torch.Tensor, block_tokens: torch.Tensor) -> TreeAcceptance:
    """``uniform_tree_acceptance`` from which nodes *match* (``match [B, N]`` bool: the node carries the target's
    token at its parent) instead of from tokens: the walk moves to the first matching child of its current node
    and stops where none matches; ``block_tokens [B, 1 + N]`` gives the bonus (the token at the last accepted node).
    Real acceptance matches tokens; the synthetic acceptance (``synthetic_acceptance``) draws the matches.
    No host syncs, static shapes."""
    chosen = match & ~(match[:, :, None] & tables.earlier_siblings).any(dim=1)
    accepted = (chosen[:, :, None] | tables.not_ancestor).all(dim=1)  # [B, N]
    accepted_nodes = torch.where(accepted[:, :, None] & tables.node_at_depth, tables.node_ids, -1).amax(dim=1)
    last_accepted_node = accepted_nodes.amax(dim=1)
    bonus_tokens = block_tokens.gather(1, (last_accepted_node + 1)[:, None]).view(-1)
    return TreeAcceptance(accepted.sum(dim=1), accepted_nodes, last_accepted_node, bonus_tokens.long())


def accepted_kv_moves(accepted_nodes: torch.Tensor, root_positions: torch.Tensor) -> KVMoves:
    """Position pairs that move the accepted nodes' full-attention KV behind the root, in path order.

    ``root_positions [B]``: each request's root position L, i.e. its committed length (the tokens with KV before
    the root). The verified block is written at positions L + block index: the root at L, local node j at
    L + 1 + j. ``accepted_nodes [B, D]``: local node indices of the accepted path, root to leaf, -1 padding
    (``TreeAcceptance.accepted_nodes``).

    Column m - 1 moves the path's m-th node from L + 1 + node to L + m; afterwards positions L .. L + num_accepted
    hold root + accepted path and the request's committed length is L + 1 + num_accepted (the bonus token comes
    next, at that position). Positions beyond are stale, to be overwritten. -1 marks padding and nodes already in
    place (source == destination: every move of a chain). Apply all moves at once, all sources read before any
    write (``cache[dst] = cache[src]`` in torch does that), or one by one in column order: a column's source may
    be a later column's destination, never an earlier one's, so both are right; an unstaged parallel copy is not.
    Both ends lie in the verified block, so ``root_positions = 0`` gives block indices, to map through the step's
    slot mapping (row = where the request's verified block starts in the step's tokens + block index).
    """
    if accepted_nodes.dim() != 2 or root_positions.shape != accepted_nodes.shape[:1]:
        raise ValueError(
            f"accepted_nodes {tuple(accepted_nodes.shape)} and root_positions {tuple(root_positions.shape)}: "
            "expected [B, D] and [B]"
        )
    accepted_nodes = accepted_nodes.long()
    root = root_positions.long()[:, None]
    path_step = torch.arange(1, accepted_nodes.shape[1] + 1, device=accepted_nodes.device)
    sources = root + 1 + accepted_nodes
    destinations = root + path_step
    copy = (accepted_nodes >= 0) & (sources != destinations)
    return KVMoves(torch.where(copy, sources, -1), torch.where(copy, destinations, -1))


def greedy_tree_acceptance_reference(
    parents: Sequence[int], draft_tokens: Sequence[int], target_argmax: Sequence[int], max_depth: int | None = None
) -> tuple[list[int], int]:
    """One request, node by node: ``(accepted path as local node indices, bonus token)``.

    ``target_argmax`` is the request's verified block: ``[root] + nodes``. Same rule as ``greedy_tree_acceptance``.
    """
    path: list[int] = []
    current = -1
    while max_depth is None or len(path) < max_depth:
        wanted = target_argmax[current + 1]
        children = [node for node, parent in enumerate(parents) if parent == current]
        matching = [node for node in children if draft_tokens[node] == wanted]
        if not matching:
            break
        current = matching[0]
        path.append(current)
    return path, target_argmax[current + 1]


def accepted_kv_moves_reference(accepted_path: Sequence[int], root_position: int) -> list[tuple[int, int]]:
    """One request: the ``(source, destination)`` copies, in path order, that ``accepted_kv_moves`` returns."""
    moves = []
    for step, node in enumerate(accepted_path, start=1):
        source, destination = root_position + 1 + node, root_position + step
        if source != destination:
            moves.append((source, destination))
    return moves
