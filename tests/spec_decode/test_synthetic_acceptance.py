"""Synthetic tree acceptance (`spec_decode.synthetic_acceptance`): the walk over given uniforms is the plain node-by-
node rule; the acceptance frequencies per depth and rank match the configured conditional rates (Pearson chi-square,
fixed seed) and a wrong rate is caught (power); a chain drawn through it accepts as vLLM's synthetic chain with the
equivalent unconditional per-position rates (vLLM's own conversion). All on CPU, a second or two."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from vllm.v1.spec_decode.utils import unconditional_to_conditional_rates

from tests.chi_square import chi2_sf
from tests.kernels.tree_cases import random_trees
from vllm_treewy.spec_decode.acceptance import UniformWalkTables
from vllm_treewy.spec_decode.synthetic_acceptance import (
    NodeRateIndex,
    conditional_rates_reference,
    expected_accepted_nodes,
    node_rates,
    synthetic_tree_acceptance,
)
from vllm_treewy.tree import DraftTree

P_MIN = 1e-3  # exactness p-values must exceed it (fixed seeds: the verdict is fixed)
TRIALS = 40_000
TREE_322 = DraftTree.from_widths([3, 2, 2]).parents  # depth 3, ranks 0-2 at depth 1, 0-1 below
CODE_LIKE = [0.917, 0.837, 0.648, 0.538]  # per-position unconditional (vLLM's meaning)


def run(parents, rates: torch.Tensor, trials: int, seed: int):
    """`trials` requests drafting `parents`, each with `rates [2, D]` (or per request `[B, 2, D]`)."""
    gen = torch.Generator().manual_seed(seed)
    num_nodes = len(parents)
    rates = rates.expand(trials, *rates.shape[-2:])
    uniforms = torch.rand(trials, num_nodes, generator=gen, dtype=torch.float64)
    draws = torch.arange(trials * (1 + num_nodes)).view(trials, 1 + num_nodes)  # distinct tokens: bonus is traceable
    return synthetic_tree_acceptance(UniformWalkTables.of(parents, "cpu"), NodeRateIndex.of(parents, "cpu"), rates,
                                     uniforms, draws), draws, uniforms


def node_outcomes(parents, accepted_nodes: torch.Tensor):
    """Per node: `(looked_at [B, N], taken [B, N])`: the walk reached its parent and took no earlier sibling; it took
    the node."""
    num_nodes = len(parents)
    taken = torch.zeros(accepted_nodes.shape[0], num_nodes, dtype=torch.bool)
    rows = torch.arange(accepted_nodes.shape[0])[:, None].expand_as(accepted_nodes)
    taken[rows[accepted_nodes >= 0], accepted_nodes[accepted_nodes >= 0]] = True
    looked = torch.zeros_like(taken)
    for node, parent in enumerate(parents):
        reached = torch.ones_like(taken[:, 0]) if parent < 0 else taken[:, parent]
        earlier = [m for m in range(node) if parents[m] == parent]
        looked[:, node] = reached & ~(taken[:, earlier].any(dim=1) if earlier else torch.zeros_like(reached))
    return looked, taken


def depth_rank_classes(parents):
    depth, rank, seen = [], [], {}
    for parent in parents:
        depth.append(1 if parent < 0 else depth[parent] + 1)
        rank.append(seen.get(parent, 0))
        seen[parent] = rank[-1] + 1
    return sorted({(d, r) for d, r in zip(depth, rank)}), depth, rank


def frequency_test(parents, accepted_nodes, rates: list[list[float]]):
    """Pearson chi-square of the taken counts per (depth, rank) against the rates `rates [2][D]` (first child,
    later siblings), summed over the classes: `(statistic, dof, p-value, per-class frequencies)`."""
    looked, taken = node_outcomes(parents, accepted_nodes)
    classes, depth, rank = depth_rank_classes(parents)
    statistic, frequencies = 0.0, {}
    for d, r in classes:
        nodes = [n for n in range(len(parents)) if depth[n] == d and rank[n] == r]
        trials = int(looked[:, nodes].sum())
        hits = int((taken[:, nodes] & looked[:, nodes]).sum())
        p = rates[0 if r == 0 else 1][d - 1]
        statistic += (hits - trials * p) ** 2 / (trials * p * (1 - p))
        frequencies[(d, r)] = (hits / trials, p, trials)
    return statistic, len(classes), chi2_sf(statistic, len(classes)), frequencies


def test_rate_index_is_the_rule():
    for widths in ([2, 2, 1], [3, 2, 2], [3, 2, 2, 1], [1, 1, 1]):
        parents = DraftTree.from_widths(widths).parents
        rates = torch.rand(2, len(widths), generator=torch.Generator().manual_seed(len(parents)))
        got = node_rates(NodeRateIndex.of(parents, "cpu"), rates[None])[0]
        assert got.tolist() == pytest.approx(conditional_rates_reference(parents, rates.tolist()))


def walk_reference(parents, carries):
    """The walk node by node: from the root, the first child that carries, until none does."""
    path, current = [], -1
    while True:
        child = next((n for n, p in enumerate(parents) if p == current and carries[n]), None)
        if child is None:
            return path
        path.append(child)
        current = child


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(random_trees(max_nodes=12, max_depth=4), st.integers(0, 2**31 - 1))
def test_walk_over_given_uniforms_is_the_node_by_node_rule(parents, seed):
    depth = DraftTree(tuple(parents)).max_depth
    gen = torch.Generator().manual_seed(seed)
    rates = torch.rand(5, 2, depth, generator=gen)
    uniforms = torch.rand(5, len(parents), generator=gen, dtype=torch.float64)
    draws = torch.randint(0, 50, (5, 1 + len(parents)), generator=gen)
    result = synthetic_tree_acceptance(UniformWalkTables.of(parents, "cpu"), NodeRateIndex.of(parents, "cpu"), rates,
                                       uniforms, draws)
    for b in range(5):
        node_rate = conditional_rates_reference(parents, rates[b].tolist())
        carries = [float(uniforms[b, n]) < float(torch.tensor(node_rate[n], dtype=torch.float32)) for n in
                   range(len(parents))]
        path = walk_reference(parents, carries)
        assert result.accepted_nodes[b].tolist() == path + [-1] * (depth - len(path))
        assert int(result.num_accepted[b]) == len(path)
        assert int(result.bonus_tokens[b]) == int(draws[b, (path[-1] + 1) if path else 0])


@pytest.mark.parametrize("sibling", [0.2, 0.4])
def test_frequencies_per_depth_and_rank_match_the_rates(sibling):
    first = unconditional_to_conditional_rates(CODE_LIKE[:3])
    rates = [first, [sibling] * 3]
    result, _, _ = run(TREE_322, torch.tensor(rates), TRIALS, seed=11)
    statistic, dof, p_value, frequencies = frequency_test(TREE_322, result.accepted_nodes, rates)
    assert p_value > P_MIN, (statistic, dof, frequencies)
    assert {r for _, r in frequencies} == {0, 1, 2}  # every rank of [3, 2, 2] judged
    assert all(trials > 1000 for _, _, trials in frequencies.values())


@pytest.mark.parametrize("wrong", ["first-depth-2", "sibling-depth-1"])
def test_a_wrong_rate_is_caught(wrong):
    # power: the draw made with a rate off in one place (a rank-0 rate by 0.03; a sibling rate, seen ~10x less often,
    # by 0.1), judged against the configured ones
    configured = [unconditional_to_conditional_rates(CODE_LIKE[:3]), [0.4] * 3]
    drawn = [list(row) for row in configured]
    if wrong == "first-depth-2":
        drawn[0][1] -= 0.03
    else:
        drawn[1][0] += 0.1
    result, _, _ = run(TREE_322, torch.tensor(drawn), TRIALS, seed=12)
    _, _, p_value, _ = frequency_test(TREE_322, result.accepted_nodes, configured)
    assert p_value < 1e-6


def test_a_chain_accepts_as_vllms_synthetic_chain():
    # vLLM's synthetic chain with per-position unconditional rates p accepts its first m drafts with probability
    # p_m - p_{m+1} (its kernel: a uniform per position against c_i = p_i / p_{i-1}, stopping at the first rejection),
    # mean acceptance length 1 + sum(p). The chain [1, 1, 1, 1] through the tree sampler with rank-0 rates c, from
    # vLLM's own conversion:
    conditional = unconditional_to_conditional_rates(CODE_LIKE)
    chain = DraftTree.from_widths([1, 1, 1, 1]).parents
    result, _, _ = run(chain, torch.tensor([conditional, [0.0] * 4]), TRIALS, seed=13)
    counts = torch.bincount(result.num_accepted, minlength=5).double()
    p = [1.0, *CODE_LIKE, 0.0]
    expected = torch.tensor([p[m] - p[m + 1] for m in range(5)], dtype=torch.float64) * TRIALS
    statistic = float(((counts - expected) ** 2 / expected).sum())
    assert chi2_sf(statistic, 4) > P_MIN, (counts.tolist(), expected.tolist())
    mean_length = 1 + float(result.num_accepted.double().mean())
    standard_error = float(result.num_accepted.double().std()) / TRIALS ** 0.5
    assert abs(mean_length - (1 + sum(CODE_LIKE))) < 4 * standard_error


def test_requests_of_one_batch_keep_their_own_rates():
    code = [unconditional_to_conditional_rates(CODE_LIKE[:3]), [0.4] * 3]
    prose = [[0.55] * 3, [0.2] * 3]
    per_request = torch.tensor([code, prose]).repeat(TRIALS // 2, 1, 1)  # alternating classes in one batch
    result, _, _ = run(TREE_322, per_request, TRIALS, seed=14)
    for offset, rates in ((0, code), (1, prose)):
        _, _, p_value, frequencies = frequency_test(TREE_322, result.accepted_nodes[offset::2], rates)
        assert p_value > P_MIN, frequencies
    # and the classes differ: prose accepts fewer
    assert result.num_accepted[1::2].double().mean() < result.num_accepted[0::2].double().mean() - 0.5


def test_expected_accepted_nodes_is_the_walks_mean():
    rates = [unconditional_to_conditional_rates(CODE_LIKE[:3]), [0.4] * 3]
    result, _, _ = run(TREE_322, torch.tensor(rates), TRIALS, seed=15)
    accepted = result.num_accepted.double()
    standard_error = float(accepted.std()) / TRIALS ** 0.5
    assert abs(float(accepted.mean()) - expected_accepted_nodes(TREE_322, rates)) < 4 * standard_error
    chain = DraftTree.from_widths([1, 1, 1, 1]).parents
    assert expected_accepted_nodes(chain, [unconditional_to_conditional_rates(CODE_LIKE), [0.0] * 4]) == pytest.approx(
        sum(CODE_LIKE))  # vLLM's chain: 1 + sum(p) tokens a step
