"""Synthetic acceptance of draft trees: a BENCHMARK tool, not for real outputs. It decides which path of a draft tree
is accepted by drawing, per node, whether it "carries the target's token" with configured probabilities, whatever the
tokens are, so that a model with dummy weights (whose drafts the target never accepts) runs the step a real model
would at a chosen acceptance. Only the accept decision is synthetic: the emitted tokens are the accepted path's draft
tokens followed by the target's own draw at the last accepted node (the bonus), and what follows the decision (output
rows, K/V compaction of the accepted path, the GDN commit of the accepted leaf) is the real acceptance's, so a
benchmark's step costs what a real step costs. vLLM's synthetic chain sampler (`rejection_sample_method: "synthetic"`)
is the same tool for chains; with one child per node this is it (below).

Rates, per request: ``rates [B, 2, D]`` (D = the tree's depth), conditional probabilities:

- ``rates[:, 0, d]``: that a node's FIRST child (rank 0, the drafter's top candidate) at depth d + 1 carries the
  target's token, given the walk reached the node (its parent was accepted);
- ``rates[:, 1, d]``: that a LATER child (rank r >= 1) at depth d + 1 carries it, given the walk reached its parent and
  none of the ranks < r did. One sibling rate per depth, for every rank >= 1: the published figures for MTP and
  EAGLE heads give a second candidate's rate at most, not one per rank, and a tree's later ranks are few.

Draw. Every node n gets an independent uniform ``u_n`` in [0, 1) and *carries* iff ``u_n < rate(n)``; the walk
(``acceptance.walk_of_matches``) moves to the first carrying child and stops where none carries. Given the walk
reached a node, its rank-0 child is taken with probability ``rates[0, d]``, and its rank-r child with probability
``rates[1, d]`` given ranks < r did not carry (the u's are independent): the configured conditionals. Children that are
never looked at (off the walk) have draws that are never read, as in the real one-call walk. The uniforms come from the
caller (``torch.rand`` on the step's device: the default generator's Philox stream, which CUDA graphs capture with a
fresh offset per replay), so the draw is one comparison, no host syncs and static shapes: graph-capturable.

A chain (one child per node) accepts exactly m drafts with probability ``c_1 .. c_m (1 - c_{m+1})`` for the rank-0
rates c: vLLM's synthetic chain with the per-position unconditional rates ``p_i = c_1 .. c_i``
(`vllm.v1.spec_decode.utils.unconditional_to_conditional_rates` is the inverse map), whose acceptance it draws the
same way (a uniform per position against ``c_i``, stopping at the first rejection).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from .acceptance import TreeAcceptance, UniformWalkTables, walk_of_matches

FIRST_CHILD, LATER_SIBLING = 0, 1  # rows of the rates' dim 1


class NodeRateIndex(NamedTuple):
    """Per node of one tree, where its rate sits in a request's flattened ``rates [2 * D]``: ``rank_row * D +
    depth - 1`` (rank_row 0 for a first child, 1 for a later sibling)."""

    index: torch.Tensor  # [N] int64

    @classmethod
    def of(cls, parents: Sequence[int], device) -> NodeRateIndex:
        depth: list[int] = []
        seen_parents: set[int] = set()
        index: list[int] = []
        max_depth = 0
        for parent in parents:
            depth.append(1 if parent < 0 else depth[parent] + 1)
            max_depth = max(max_depth, depth[-1])
        for node, parent in enumerate(parents):
            row = LATER_SIBLING if parent in seen_parents else FIRST_CHILD
            seen_parents.add(parent)
            index.append((row, depth[node] - 1))
        return cls(torch.tensor([row * max_depth + d for row, d in index], dtype=torch.long, device=device))


def node_rates(rate_index: NodeRateIndex, rates: torch.Tensor) -> torch.Tensor:
    """``[B, N]`` each node's conditional rate from the requests' ``rates [B, 2, D]``."""
    return rates.reshape(rates.shape[0], -1)[:, rate_index.index]


def synthetic_tree_acceptance(tables: UniformWalkTables, rate_index: NodeRateIndex, rates: torch.Tensor,
                              uniforms: torch.Tensor, block_draws: torch.Tensor) -> TreeAcceptance:
    """The accepted paths of a batch whose requests all draft one tree, decided synthetically (module docstring).

    ``tables``, ``rate_index``: the tree's (``UniformWalkTables.of``, ``NodeRateIndex.of``); ``rates [B, 2, D]``:
    each request's conditional rates; ``uniforms [B, N]``: independent uniforms in [0, 1), one per node;
    ``block_draws [B, 1 + N]``: the target's draw at each verified-block token (root, then nodes), read only at the
    last accepted node (the bonus). Result as ``uniform_tree_acceptance``'s. No host syncs, static shapes.
    """
    carries = uniforms < node_rates(rate_index, rates).to(uniforms.dtype)
    return walk_of_matches(tables, carries, block_draws)


def conditional_rates_reference(parents: Sequence[int], rates: Sequence[Sequence[float]]) -> list[float]:
    """One tree, node by node: each node's conditional rate from ``rates [2][D]`` (the rule of the module docstring,
    written plainly for the tests)."""
    depth: list[int] = []
    out: list[float] = []
    for node, parent in enumerate(parents):
        depth.append(1 if parent < 0 else depth[parent] + 1)
        first = all(parents[m] != parent for m in range(node))
        out.append(rates[FIRST_CHILD if first else LATER_SIBLING][depth[node] - 1])
    return out


def expected_accepted_nodes(parents: Sequence[int], rates: Sequence[Sequence[float]]) -> float:
    """The mean number of drafts the synthetic walk accepts on one tree with ``rates [2][D]`` (the mean acceptance
    length is one more: the bonus): the sum over nodes of P(the walk takes the node) = P(it takes the parent) x the
    probability that no earlier sibling carries and this one does."""
    node_rate = conditional_rates_reference(parents, rates)
    taken: list[float] = []
    none_earlier: dict[int, float] = {}  # per parent: P(no child so far carried)
    for node, parent in enumerate(parents):
        reach = 1.0 if parent < 0 else taken[parent]
        missed = none_earlier.get(parent, 1.0)
        taken.append(reach * missed * node_rate[node])
        none_earlier[parent] = missed * (1.0 - node_rate[node])
    return sum(taken)
