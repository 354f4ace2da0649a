"""Sampled acceptance of draft trees whose candidates are deterministic (the MTP head's top-w tokens): the emitted
tokens follow the target's own sampling distribution exactly.

Rule. Walk from the root (the request's last emitted token). At the current node v draw x from the target's
distribution p_v at v's verified token (what the request's sampling parameters make of the target's logits there,
given the context: committed tokens plus the path to v). If a child of v carries x, move to it and continue;
otherwise stop and emit x as the bonus token. At a leaf the draw is the bonus. The emitted tokens are the
accepted path's tokens followed by the bonus.

Proof that the emitted tokens are distributed as plain sampling would emit them. Let y_1, y_2, ... be what plain
autoregressive sampling would produce: y_1 ~ p(. | c), y_2 ~ p(. | c, y_1), ... Couple the walk with it: the draw at
the root is y_1; the walk moves to a child only when that child's token equals the draw, so the node it reaches
after i moves carries exactly the context (c, y_1, .., y_i), and its target row computes p(. | c, y_1, .., y_i):
the next draw is y_{i+1}. The walk therefore emits y_1, .., y_{m+1}, a prefix of the plain sample, whose length
m + 1 is a stopping time of the draws (it depends only on y_1 .. y_{m+1} and the fixed drafts). The next step
starts from y_{m+1} with fresh draws, so by induction over steps the whole output is the plain sample. No draft
probability enters: the rule is exact for any deterministic candidates (children with equal tokens only waste
nodes; the first in node order is taken). Equivalently, one can try v's children in order and accept child c with
probability p_v(c) / (1 - sum of the p_v of children already rejected), emitting a draw from p_v restricted to the
tokens of no child when all are rejected: both give P(move to c) = p_v(c) and P(stop with x) = p_v(x) for x carried
by no child. Greedy decoding is the limit where p_v is a point mass at the argmax: the walk is
`greedy_tree_acceptance`.

The draws come from the caller (`token_at`: one draw per request and level, fresh randomness each time, e.g.
vLLM's own sampler over the current nodes' logits), so every sampling parameter, seed and logits processor of
the serving engine applies unchanged. `walk_tree` calls it max_depth + 1 times per step.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from .acceptance import TreeAcceptance, verified_block_offsets, walk_tree


def sampled_tree_acceptance(
    parents: torch.Tensor,
    cu_nodes: torch.Tensor,
    draft_tokens: torch.Tensor,
    max_depth: int,
    sample_rows: Callable[[int, torch.Tensor], torch.Tensor],
) -> TreeAcceptance:
    """The rule of the module docstring on packed trees (shapes as in ``greedy_tree_acceptance``).

    ``sample_rows(level, rows)``: ``rows [B]`` int64, each request's current verified token (its index in the packed
    verified blocks: root = the block's start); returns ``[B]`` tokens, each a fresh draw from the target's
    distribution at that row. No host syncs of its own.
    """
    block_start = verified_block_offsets(cu_nodes)[:-1]

    def draw_at(level: int, current: torch.Tensor) -> torch.Tensor:
        return sample_rows(level, block_start + 1 + current)

    return walk_tree(parents, cu_nodes, draft_tokens, max_depth, draw_at)


def sampled_tree_acceptance_reference(
    parents: Sequence[int],
    draft_tokens: Sequence[int],
    distribution_at: Callable[[Sequence[int]], Sequence[float]],
    generator: torch.Generator,
    max_depth: int | None = None,
) -> tuple[list[int], int]:
    """One request, node by node: ``(accepted path as local node indices, bonus token)``.

    ``distribution_at(path)``: the target's probabilities after the root and the given accepted nodes' tokens.
    Draws with ``torch.multinomial`` from ``generator``."""
    path: list[int] = []
    current = -1
    while True:
        probabilities = torch.as_tensor(distribution_at([draft_tokens[n] for n in path]), dtype=torch.float64)
        drawn = int(torch.multinomial(probabilities, 1, generator=generator))
        if max_depth is not None and len(path) >= max_depth:
            return path, drawn
        children = [node for node, parent in enumerate(parents) if parent == current and draft_tokens[node] == drawn]
        if not children:
            return path, drawn
        current = children[0]
        path.append(current)
