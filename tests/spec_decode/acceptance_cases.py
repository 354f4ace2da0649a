"""Hypothesis strategies for the acceptance tests: small draft trees (tests/kernels/tree_cases.py),
batches of 1-6 requests with a small vocabulary so that draft tokens match the target's argmax often, and
batches with a planted continuation (the target's greedy path runs down a chosen node, any branch)."""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import strategies as st

from tests.kernels.tree_cases import chains, random_trees, width_trees


def trees(max_nodes: int = 12, max_depth: int = 5) -> st.SearchStrategy[tuple[int, ...]]:
    """The kernel tests' trees, small, and the empty tree too (a request that drafts nothing)."""
    return st.one_of(random_trees(max_nodes, max_depth, min_nodes=0), width_trees(max_nodes), chains(max_depth))


@dataclass(frozen=True)
class Request:
    parents: tuple[int, ...]
    draft_tokens: tuple[int, ...]  # one per node
    target_argmax: tuple[int, ...]  # verified block: root, then one per node

    def path_to(self, node: int) -> list[int]:
        """Local nodes from the root's child down to ``node`` (empty for the root, -1)."""
        path = []
        while node >= 0:
            path.append(node)
            node = self.parents[node]
        return path[::-1]


@st.composite
def random_requests(draw, vocab: int) -> Request:
    """Any tree, tokens and argmax drawn freely from ``vocab`` (siblings may repeat tokens)."""
    parents = draw(trees())
    tokens = st.integers(0, vocab - 1)
    draft = draw(st.lists(tokens, min_size=len(parents), max_size=len(parents)))
    argmax = draw(st.lists(tokens, min_size=len(parents) + 1, max_size=len(parents) + 1))
    return Request(parents, tuple(draft), tuple(argmax))


@st.composite
def random_batches(draw) -> list[Request]:
    vocab = draw(st.integers(1, 4))
    return draw(st.lists(random_requests(vocab), min_size=1, max_size=6))


@st.composite
def planted_requests(draw) -> tuple[Request, list[int]]:
    """A well-formed tree (siblings carry distinct tokens) and a planted end node (any node, or -1 = the root).

    The target's argmax at each node of the root-to-end path is the token of the path's next node, and at the end
    node a token that none of its children carries (the vocabulary always has one); every other argmax is random.
    Greedy acceptance must accept exactly that path. Returns the request and the planted path.
    """
    parents = draw(trees())
    num_nodes = len(parents)
    vocab = 1 + max((parents.count(p) for p in set(parents)), default=0)  # tight: siblings use most of it
    draft = [0] * num_nodes
    for parent in set(parents):
        children = [node for node, p in enumerate(parents) if p == parent]
        chosen = draw(st.permutations(range(vocab)))[: len(children)]
        for node, token in zip(children, chosen):
            draft[node] = token
    argmax = draw(st.lists(st.integers(0, vocab - 1), min_size=num_nodes + 1, max_size=num_nodes + 1))
    end = draw(st.integers(-1, num_nodes - 1))
    request = Request(parents, tuple(draft), ())
    path = request.path_to(end)
    previous = -1
    for node in path:
        argmax[previous + 1] = draft[node]
        previous = node
    children_tokens = {draft[node] for node, p in enumerate(parents) if p == end}
    argmax[end + 1] = draw(st.sampled_from([t for t in range(vocab) if t not in children_tokens]))
    return Request(parents, tuple(draft), tuple(argmax)), path


def planted_batches() -> st.SearchStrategy[list[tuple[Request, list[int]]]]:
    return st.lists(planted_requests(), min_size=1, max_size=6)
