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
after i moves carries exactly the context (c, y_1, .., y_i), and its target row computes p(. | c, y_1, .., y_i): the
next draw is y_{i+1}. (The context is also a position: the node after i moves is i tokens past the committed output,
so whatever the sampling parameters make of the output length, such as a minimum length masking stop tokens, must be
made of committed + i at it, not of the root's length nor of the node's index in node order.) The walk therefore
emits y_1, .., y_{m+1}, a prefix of the plain sample, whose length m + 1 is a stopping time of the draws (it depends
only on y_1 .. y_{m+1} and the fixed drafts). The next step starts from y_{m+1} with fresh draws, so by induction
over steps the whole output is the plain sample. No draft probability enters: the rule is exact for any
deterministic candidates (children with equal tokens only waste nodes; the first in node order is taken).
Equivalently, one can try v's children in order and accept child c with probability p_v(c) / (1 - sum of the p_v of
children already rejected), emitting a draw from p_v restricted to the tokens of no child when all are rejected:
both give P(move to c) = p_v(c) and P(stop with x) = p_v(x) for x carried by no child. Greedy decoding is the limit
where p_v is a point mass at the argmax: the walk is `greedy_tree_acceptance`.

One draw per node, all at once. The walk may equally be given a draw at EVERY verified token up front (the root
and all N nodes, each from its own node's distribution, independently: one sampler call over all the rows) and read
only the draws at the nodes it visits. Still exact: the node visited at level i is a function of the draws read at
levels < i, and the draw at it is independent of those (the draws are mutually independent, and the walk never
read its own before), so given the walk so far it is a fresh sample from that node's distribution, whose context is
the emitted prefix (c, y_1, .., y_i): the coupling above holds draw by draw. The draws at nodes the walk does not
visit are never read. Greedy is again the point-mass limit (argmax at every node), and the walk over the given
draws is `greedy_tree_acceptance`'s on them (`uniform_tree_acceptance` when every request drafts the same tree).

The draws come from the caller, so every sampling parameter and logits processor of the serving engine applies
unchanged: `sampled_tree_acceptance` asks `token_at` for one draw per request and level (fresh randomness each
time, e.g. vLLM's own sampler over the current nodes' logits; `walk_tree` calls it max_depth + 1 times per step),
which a draw that depends on the path (penalties, a per-request seeded stream) needs;
`sampled_tree_acceptance_of_draws` takes the draws at every node at once.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from .acceptance import TreeAcceptance, UniformWalkTables, uniform_tree_acceptance, verified_block_offsets, walk_tree


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


def sampled_tree_acceptance_of_draws(tables: UniformWalkTables, draft_tokens: torch.Tensor, node_draws: torch.Tensor
                                     ) -> TreeAcceptance:
    """The rule of the module docstring with one draw at every verified token, all requests drafting one tree.

    ``tables``: the tree's ``UniformWalkTables``; ``draft_tokens [B, N]``; ``node_draws [B, 1 + N]``: per request, a
    draw from the target's distribution at its root and at each node (block order), independent of each other and
    of everything before. Only the draws at the visited nodes are read. No host syncs, a fixed number of ops.
    """
    return uniform_tree_acceptance(tables, draft_tokens, node_draws)


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
