"""Draft trees from a model's own MTP head: the topology of each drafting level and the accepted path as a chain.

The MTP head drafts a static tree (`DraftTree.from_widths`, breadth-first node order) level by level:

- level 1: the top-w1 tokens of the head's distribution after the request's last accepted token (vLLM's first
  MTP pass, over the step's verified tokens, gives it; `kernels.top_children_torch` states the order);
- level l + 1: for every node of level l, the top-w_{l+1} tokens of the head's distribution at that node.

The head's forward for level l + 1 runs once for the whole batch over each request's *level block*: the root (the
bonus token, at the position P0 of the last accepted token) and every node of depth <= l, i.e. the verified block
of the prefix tree `from_widths(widths[:l])` (breadth-first order makes its nodes the first ones of the full
tree). Block token b sits at KV position P0 + b and RoPE position P0 + depth, and attends to the committed
context and to its ancestors and itself, exactly as the target's verify does. The nodes of depth < l are
forwarded again with the inputs they had (their K/V are rewritten with the values they had): one launch per level
whose query is a request's whole block, which vLLM's attention with a tree bias computes, instead of a gather of
scattered ancestors. The deepest level is never forwarded.

After verification the accepted path is handed to vLLM's first MTP pass as if it were a chain
(`accepted_path_sources`): block row i takes the inputs of the i-th token of the path (root = 0), so that the
head's K/V for the committed tokens land where vLLM's chain puts them (positions L .. L + accepted) and vLLM's
own rejected-token padding covers the rest.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..tree import DraftTree


def level_trees(widths: Sequence[int]) -> list[DraftTree]:
    """The prefix trees whose blocks the head forwards: `from_widths(widths[:l])` for l = 1 .. depth - 1."""
    return [DraftTree.from_widths(list(widths[:level])) for level in range(1, len(widths))]


def nodes_below_depth(widths: Sequence[int]) -> list[int]:
    """`[depth + 1]` node counts of the prefix trees: entry l = nodes of depth <= l (entry 0 = 0)."""
    counts, level = [0], 1
    for width in widths:
        level *= width
        counts.append(counts[-1] + level)
    return counts


def accepted_path_sources(accepted_nodes: torch.Tensor, block_len: int) -> torch.Tensor:
    """`[R, block_len]` int64: for each row i of a request's verified block laid out as a chain, the block index whose
    inputs it takes: 0 (the root) for row 0, 1 + the i-th accepted node for rows 1 .. accepted, and i itself for the
    rows past the path (vLLM's padding of rejected tokens: their outputs are never read, and their K/V positions
    lie past the committed length).

    `accepted_nodes [R, D]`: local node indices root to leaf, -1 padding (`TreeAcceptance.accepted_nodes`)."""
    num_requests, depth = accepted_nodes.shape
    rows = torch.arange(block_len, device=accepted_nodes.device).expand(num_requests, block_len).clone()
    path = accepted_nodes.long()
    rows[:, 1 : depth + 1] = torch.where(path >= 0, path + 1, rows[:, 1 : depth + 1])
    return rows
