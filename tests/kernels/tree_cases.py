"""Hypothesis strategies and random inputs shared by the kernel tests."""

from __future__ import annotations

import math

import torch
from hypothesis import strategies as st

from vllm_treewy.tree import DraftTree

# Ranges of -g (log-uniform): alpha = exp(g) near 1, near 0, and both mixed along one path.
GATE_RANGES = {"near_one": (1e-6, 1e-3), "near_zero": (5.0, 30.0), "mixed": (1e-6, 30.0)}


@st.composite
def random_trees(draw, max_nodes: int = 64, max_depth: int = 8, min_nodes: int = 1) -> tuple[int, ...]:
    """Any parent-before-child tree; "deep" mode hangs nodes below recent ones to reach the depth cap."""
    num_nodes = draw(st.integers(min_nodes, max_nodes))
    depth_cap = draw(st.integers(1, max_depth))
    deep = draw(st.booleans())
    parents: list[int] = []
    depths: list[int] = []
    for i in range(num_nodes):
        eligible = [-1] + [j for j in range(i) if depths[j] < depth_cap]
        parent = draw(st.sampled_from(eligible[-2:] if deep else eligible))
        parents.append(parent)
        depths.append(1 if parent < 0 else depths[parent] + 1)
    return tuple(parents)


def width_trees(max_nodes: int = 64) -> st.SearchStrategy[tuple[int, ...]]:
    widths = st.lists(st.integers(1, 4), min_size=1, max_size=8).filter(
        lambda w: sum(math.prod(w[: i + 1]) for i in range(len(w))) <= max_nodes
    )
    return widths.map(lambda w: DraftTree.from_widths(w).parents)


def chains(max_nodes: int = 64) -> st.SearchStrategy[tuple[int, ...]]:
    return st.integers(1, max_nodes).map(lambda n: DraftTree.from_widths([1] * n).parents)


def trees(max_nodes: int = 64, max_depth: int = 8) -> st.SearchStrategy[tuple[int, ...]]:
    return st.one_of(random_trees(max_nodes, max_depth), width_trees(max_nodes), chains(max_depth))


def log_decays(shape, gate: str, generator: torch.Generator) -> torch.Tensor:
    smallest, largest = GATE_RANGES[gate]
    log_magnitude = torch.empty(shape, dtype=torch.float64).uniform_(
        math.log(smallest), math.log(largest), generator=generator
    )
    return -torch.exp(log_magnitude)


def gdn_inputs(num_nodes, key_heads, ratio, key_dim, value_dim, gate, seed, dtype=torch.float64, num_slots=1):
    """q, k ``[T, H, K]`` (normalised, q scaled), v ``[T, HV, V]``, g, beta ``[T, HV]``, pool ``[S, HV, V, K]``."""
    generator = torch.Generator().manual_seed(seed)
    value_heads = key_heads * ratio

    def normal(*shape):
        return torch.randn(shape, dtype=torch.float64, generator=generator)

    q = torch.nn.functional.normalize(normal(num_nodes, key_heads, key_dim), dim=-1) * key_dim**-0.5
    k = torch.nn.functional.normalize(normal(num_nodes, key_heads, key_dim), dim=-1)
    v = normal(num_nodes, value_heads, value_dim)
    g = log_decays((num_nodes, value_heads), gate, generator)
    beta = torch.empty(num_nodes, value_heads, dtype=torch.float64).uniform_(0.01, 1.0, generator=generator)
    pool = normal(num_slots, value_heads, value_dim, key_dim)
    return tuple(t.to(dtype) for t in (q, k, v, g, beta, pool))


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """Max abs error over max abs value of the fp64 expectation."""
    expected = expected.double()
    scale = expected.abs().max().clamp_min(1e-300)
    return float((actual.double() - expected).abs().max() / scale)
