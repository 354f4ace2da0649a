"""Per-request acceptance estimates (`spec_decode.acceptance_estimate`): expected lengths are the synthetic model's
(against `expected_accepted_nodes`, any widths and rates); the vectorised update is a plain per-row fp64 loop of the
documented rule; rates drawn by the synthetic sampler are recovered per row, siblings included, from lengths alone;
a row whose acceptance changes moves its batch's preference within `steps_to_move` of the documented break-even;
extreme counts stay finite and in [0, 1]. Fixed seeds, CPU, a few seconds."""

from __future__ import annotations

import functools
import math
from collections import defaultdict

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.spec_decode.acceptance_models import rates_of, simulate_accepted
from vllm_treewy.spec_decode.acceptance import UniformWalkTables
from vllm_treewy.spec_decode.acceptance_estimate import (
    CHAIN,
    NEUTRAL_RANK0_RATE,
    TREE,
    AcceptanceTable,
    continuations_of_rates,
    expected_lengths,
    implied_sibling_rate,
    steps_to_move,
)
from vllm_treewy.spec_decode.synthetic_acceptance import (
    NodeRateIndex,
    expected_accepted_nodes,
    synthetic_tree_acceptance,
)
from vllm_treewy.tree import DraftTree

probabilities = st.floats(0.0, 1.0, allow_nan=False)


@st.composite
def widths_and_rates(draw, max_depth: int = 5, max_width: int = 3):
    widths = draw(st.lists(st.integers(1, max_width), min_size=1, max_size=max_depth))
    rates = [draw(st.lists(probabilities, min_size=len(widths), max_size=len(widths))) for _ in range(2)]
    return widths, rates


@settings(max_examples=150, deadline=None)
@given(widths_and_rates())
def test_expected_lengths_are_the_synthetic_models(case):
    widths, rates = case
    depth = len(widths)
    tree_length, chain_length = expected_lengths(continuations_of_rates(np.array(rates), widths))
    tree = DraftTree.from_widths(widths).parents
    chain = DraftTree.from_widths([1] * depth).parents
    assert tree_length == pytest.approx(1 + expected_accepted_nodes(tree, rates), rel=1e-12, abs=1e-12)
    assert chain_length == pytest.approx(1 + expected_accepted_nodes(chain, rates), rel=1e-12, abs=1e-12)


@settings(max_examples=150, deadline=None)
@given(widths_and_rates())
def test_the_two_shapes_continuations_give_back_the_sibling_rate(case):
    widths, rates = case
    continuation = continuations_of_rates(np.array(rates), widths)
    fallback = np.full(len(widths), -1.0)
    sibling = implied_sibling_rate(continuation[TREE], continuation[CHAIN], widths, fallback=0.25)
    for d, width in enumerate(widths):
        rank0_misses, sibling_misses = 1 - rates[0][d], (1 - rates[1][d]) ** (width - 1)
        if width == 1 or rank0_misses < 1e-9:
            assert sibling[d] == 0.25  # nothing identifies it
        elif sibling_misses > 1e-6 and rank0_misses > 1e-6:  # a product far from 0: its root is well conditioned
            assert sibling[d] == pytest.approx(rates[1][d], abs=1e-6)
    assert (fallback == -1.0).all() and ((sibling >= 0) & (sibling <= 1)).all()


@settings(max_examples=40, deadline=None)
@given(widths_and_rates(), st.integers(0, 2**31 - 1))
def test_the_tables_lengths_are_the_synthetic_models_under_its_rates(case, seed):
    # whatever it has seen, a row's expected lengths are the synthetic model's under the rates the table reports
    widths, rates = case
    rng, depth = np.random.default_rng(seed), len(widths)
    table = AcceptanceTable(widths, 3, half_life=3, prior_weight=0.5)
    row_rates = np.stack([np.array(rates), rates_of(rng.uniform(0, 1, depth), rng.uniform(0, 1)), np.ones((2, depth))])
    for step in range(int(rng.integers(0, 12))):
        shape = int(rng.integers(2))
        drafts = np.full(3, depth) if shape == TREE else rng.integers(0, depth + 1, 3)
        table.observe(np.arange(3), shape, drafts, simulate_accepted(rng, widths, row_rates, shape == TREE, drafts))
    learned, lengths = table.rates(np.arange(3)), table.expected_length(np.arange(3))
    for parents, shape in ((DraftTree.from_widths(widths).parents, TREE),
                           (DraftTree.from_widths([1] * depth).parents, CHAIN)):
        exact = [1 + expected_accepted_nodes(parents, row.tolist()) for row in learned]
        assert lengths[:, shape] == pytest.approx(exact, rel=1e-9, abs=1e-9)


def test_steps_to_move_is_the_half_life_formula():
    assert [steps_to_move(10, fraction) for fraction in (0.0, 0.5, 0.75, 0.875)] == [0, 10, 20, 30]
    assert steps_to_move(8, 0.6) == math.ceil(8 * math.log2(1 / 0.4))
    with pytest.raises(ValueError):
        steps_to_move(8, 1.0)


class ReferenceTable:
    """The documented rule, one observation and one depth at a time in Python floats, in continuations (the module
    works in misses, vectorised)."""

    def __init__(self, widths, half_life, prior_weight, engine_half_life, default_sibling_rate):
        self.widths, self.depth = list(widths), len(widths)
        self.row_decay, self.engine_decay = 2 ** (-1 / half_life), 2 ** (-1 / engine_half_life)
        self.p, self.default = prior_weight, default_sibling_rate
        new = lambda: {kind: [[0.0] * self.depth for _ in range(2)] for kind in ("trials", "continues")}  # noqa
        self.rows = defaultdict(new)
        self.pool = new()
        self.tree_misses = [0.0] * self.depth  # the sibling evidence: tree misses, and chain misses times keep
        self.chain_misses = [0.0] * self.depth

    def observe(self, rows, shape, num_drafts, num_accepted):
        steps = []
        for row, drafts, accepted in zip(rows, num_drafts, num_accepted):
            depth = self.depth if shape == TREE else int(drafts)
            if depth > 0:
                steps.append((int(row), depth, min(int(accepted), depth)))
        decay = self.engine_decay ** len(steps)
        for kind in self.pool.values():
            for shape_counts in kind:
                shape_counts[:] = [value * decay for value in shape_counts]
        self.tree_misses = [value * decay for value in self.tree_misses]
        self.chain_misses = [value * decay for value in self.chain_misses]
        other = 1 - shape
        for row, depth, accepted in steps:
            counts = self.rows[row]
            for d in range(self.depth):
                tried, continued = d < min(accepted + 1, depth), d < accepted
                # this step's miss against the row's record of the other shape, before the step
                n, k = counts["trials"][other][d], counts["continues"][other][d]
                step_miss, record_miss = (tried - continued) * n / (n + self.p), tried * (n - k) / (n + self.p)
                if shape == TREE:
                    self.tree_misses[d] += step_miss
                    self.chain_misses[d] += record_miss
                else:
                    self.tree_misses[d] += record_miss
                    self.chain_misses[d] += step_miss
            for kind in counts.values():
                for shape_counts in kind:
                    shape_counts[:] = [value * self.row_decay for value in shape_counts]
            for d in range(self.depth):
                shapes = (TREE, CHAIN) if self.widths[d] == 1 else (shape,)
                for counted in (counts, self.pool):
                    for s in shapes:
                        counted["trials"][s][d] += d < min(accepted + 1, depth)
                        counted["continues"][s][d] += d < accepted

    def reset(self, rows):
        for row in rows:
            self.rows.pop(int(row), None)

    def keep(self, d):
        width = self.widths[d]
        if width == 1:
            return 1.0
        default_keep = (1 - self.default) ** (width - 1)
        return min((self.tree_misses[d] + self.p * default_keep) / (self.chain_misses[d] + self.p), 1.0)

    def sibling(self, d):
        width = self.widths[d]
        return self.default if width == 1 else 1 - self.keep(d) ** (1 / (width - 1))

    def posterior(self, counts, d, prior_tree, prior_chain):
        p, width = self.p, self.widths[d]
        (n_tree, n_chain), (k_tree, k_chain) = ([counts[kind][s][d] for s in (TREE, CHAIN)]
                                                for kind in ("trials", "continues"))
        if width == 1:  # pooled counts: n_tree == n_chain
            chain = (k_chain + p * prior_chain) / (n_chain + p)
            return chain, chain
        keep = self.keep(d)
        own_tree = (k_tree + p * prior_tree) / (n_tree + p)
        own_chain = (k_chain + p * prior_chain) / (n_chain + p)
        tree_from_chain = 1 - (1 - own_chain) * keep
        chain_from_tree = max(1 - (1 - own_tree) / keep, 0.0)
        tree_prior = (n_chain * tree_from_chain + p * prior_tree) / (n_chain + p)
        chain_prior = (n_tree * chain_from_tree + p * prior_chain) / (n_tree + p)
        tree = (k_tree + p * tree_prior) / (n_tree + p)
        chain = (k_chain + p * chain_prior) / (n_chain + p)
        return max(tree, chain), chain

    def engine(self, d):
        keep = self.keep(d)
        neutral_tree = 1 - (1 - NEUTRAL_RANK0_RATE) * keep
        return self.posterior(self.pool, d, neutral_tree, NEUTRAL_RANK0_RATE)

    def continuation(self, rows):
        return np.array([[list(shape) for shape in zip(*(self.posterior(self.rows[int(row)], d, *self.engine(d))
                                                         for d in range(self.depth)))] for row in rows])


@pytest.mark.parametrize("widths", [[2, 2, 1], [3, 1, 2, 2], [1, 1], [4]])
@pytest.mark.parametrize("seed", [0, 1])
def test_vectorised_update_is_the_per_row_reference(widths, seed):
    rng = np.random.default_rng(seed)
    depth, max_rows = len(widths), 12
    settings_ = dict(half_life=5.0, prior_weight=1.5, engine_half_life=40.0, default_sibling_rate=0.3)
    table, reference = AcceptanceTable(widths, max_rows, **settings_), ReferenceTable(widths, **settings_)
    rates = np.stack([rates_of(rng.uniform(0.2, 0.95, depth), rng.uniform(0.1, 0.6)) for _ in range(max_rows)])
    for step in range(60):
        rows = rng.choice(max_rows, size=rng.integers(1, max_rows + 1), replace=False)
        shape = int(rng.integers(2))
        drafts = np.full(len(rows), depth) if shape == TREE else rng.integers(0, depth + 1, len(rows))
        accepted = simulate_accepted(rng, widths, rates[rows], shape == TREE, drafts)
        table.observe(rows, shape, drafts, accepted)
        reference.observe(rows, shape, drafts, accepted)
        if step % 17 == 16:
            reused = rng.choice(max_rows, size=2, replace=False)
            table.reset(reused)
            reference.reset(reused)
        queried = rng.permutation(max_rows)
        np.testing.assert_allclose(table.continuation(queried), reference.continuation(queried), rtol=0, atol=1e-12)
        engine = [reference.engine(d) for d in range(depth)]
        np.testing.assert_allclose(table.engine_continuation(), np.array(engine).T, rtol=0, atol=1e-12)
    assert table.pooled_sibling_rate() == pytest.approx([reference.sibling(d) for d in range(depth)], abs=1e-12)
    lengths = table.expected_length(queried)
    np.testing.assert_allclose(lengths, expected_lengths(reference.continuation(queried)), rtol=1e-12)
    np.testing.assert_allclose(table.total_expected_length(queried), lengths.sum(axis=0), rtol=1e-12)


def test_a_reset_row_starts_at_the_engine_estimate():
    rng = np.random.default_rng(3)
    widths = [2, 2, 1]
    table = AcceptanceTable(widths, 4, half_life=8)
    rates = np.stack([rates_of([0.9, 0.8, 0.7], 0.3)] * 4)
    for step in range(50):
        shape = step % 2
        table.observe(np.arange(4), shape, np.full(4, 3), simulate_accepted(rng, widths, rates, shape == TREE))
    assert not np.allclose(table.continuation([1])[0], table.engine_continuation())
    table.reset([1])
    np.testing.assert_array_equal(table.continuation([1])[0], table.engine_continuation())


def test_a_chain_without_drafts_is_no_observation():
    table = AcceptanceTable([2, 2, 1], 2, half_life=4)
    table.observe([0, 1], CHAIN, [3, 3], [3, 1])
    before = table.continuation([0, 1])
    table.observe([0, 1], CHAIN, [0, 0], [0, 0])
    np.testing.assert_array_equal(table.continuation([0, 1]), before)


def test_estimates_stay_finite_and_in_range_at_the_extremes():
    widths = [3, 2, 1]
    table = AcceptanceTable(widths, 4, half_life=4, prior_weight=0.01)
    with np.errstate(all="raise"):
        for step in range(400):  # rows 0, 1 always accept everything, rows 2, 3 nothing, both shapes
            shape = step % 2
            table.observe(np.arange(4), shape, np.full(4, 3), np.array([3, 3, 0, 0]))
            if step % 100 == 99:  # and one shape only for a while
                for _ in range(50):
                    table.observe(np.arange(4), CHAIN, np.full(4, 3), np.array([3, 3, 0, 0]))
            for values in (table.continuation(np.arange(4)), table.rates(np.arange(4))):
                assert np.isfinite(values).all() and (values >= 0).all() and (values <= 1).all()
            assert np.isfinite(table.expected_length(np.arange(4))).all()
    lengths = table.expected_length(np.arange(4))
    assert lengths[:2] == pytest.approx(4.0, abs=0.05) and lengths[2:] == pytest.approx(1.0, abs=0.05)


@functools.cache
def sampler_tables(parents: tuple[int, ...]):
    return UniformWalkTables.of(parents, "cpu"), NodeRateIndex.of(parents, "cpu")


def synthetic_sampler_accepted(widths, rates: np.ndarray, tree: bool, seed: int) -> np.ndarray:
    """``[R]`` drafts accepted, drawn by the synthetic sampler itself (`synthetic_tree_acceptance`)."""
    parents = DraftTree.from_widths(widths if tree else [1] * len(widths)).parents
    gen = torch.Generator().manual_seed(seed)
    uniforms = torch.rand(rates.shape[0], len(parents), generator=gen, dtype=torch.float64)
    result = synthetic_tree_acceptance(*sampler_tables(parents), torch.from_numpy(rates), uniforms,
                                       torch.zeros(rates.shape[0], 1 + len(parents), dtype=torch.long))
    return result.num_accepted.numpy()


@pytest.mark.parametrize("widths", [[3, 2, 2], [2, 2, 1]])
def test_rates_drawn_by_the_synthetic_sampler_are_recovered_per_row(widths):
    # Two classes of rows with different rank-0 AND sibling rates, drafting the tree and the chain (a chain cut short
    # by a budget a quarter of the time) in turns. Only lengths are observed; each row's siblings come out of its two
    # shapes. A row holds ~1.44 x half_life steps of trials at depth 1, half of them per shape: its rank-0 rates
    # scatter by 0.03 - 0.07 across the rows of a class, its siblings (identified through a ratio of misses) by
    # 0.05 - 0.19. Over a class's 64 rows: standard errors up to ~0.01 and ~0.025; tolerances ~3 of them.
    depth, half_life, steps = len(widths), 150, 600
    classes = [rates_of([0.85, 0.75, 0.65], [0.45, 0.3, 0.5]), rates_of([0.5, 0.6, 0.7], [0.15, 0.35, 0.2])]
    rates = np.concatenate([np.repeat(c[None], 64, axis=0) for c in classes])
    rows = np.arange(len(rates))
    table = AcceptanceTable(widths, len(rows), half_life=half_life, engine_half_life=1e6)
    rng = np.random.default_rng(7)
    draws = {shape: synthetic_sampler_accepted(widths, np.tile(rates, (steps // 2, 1, 1)), shape == TREE, seed=shape)
             .reshape(steps // 2, len(rows)) for shape in (TREE, CHAIN)}  # one sampler call per shape
    for step in range(steps):
        shape = step % 2
        drafts = np.full(len(rows), depth)
        if shape == CHAIN and step % 8 == 1:
            drafts = rng.integers(1, depth + 1, len(rows))
        table.observe(rows, shape, drafts, np.minimum(draws[shape][step // 2], drafts))  # a chain cut after k
    learned, lengths = table.rates(rows), table.expected_length(rows)
    tree, chain = DraftTree.from_widths(widths).parents, DraftTree.from_widths([1] * depth).parents
    for number, true in enumerate(classes):
        members = slice(64 * number, 64 * (number + 1))
        mean = learned[members].mean(axis=0)
        assert mean[0] == pytest.approx(true[0], abs=0.025)
        identified = [d for d in range(depth) if widths[d] > 1]
        assert mean[1, identified] == pytest.approx(true[1, identified], abs=0.08)
        true_lengths = [1 + expected_accepted_nodes(parents, true.tolist()) for parents in (tree, chain)]
        assert lengths[members].mean(axis=0) == pytest.approx(true_lengths, rel=0.02)
    # the estimate's own rates give back its continuations exactly: expected_length is the synthetic model's
    # length under table.rates
    for row in (0, 100):
        exact = [1 + expected_accepted_nodes(parents, learned[row].tolist()) for parents in (tree, chain)]
        assert lengths[row] == pytest.approx(exact, rel=1e-9)


def batch_preference(table, rows, cost_ratio) -> float:
    """The batch's tree tokens/s over its chain tokens/s, minus 1, for a tree step ``cost_ratio`` x the chain's."""
    tree, chain = table.expected_length(rows).sum(axis=0)
    return tree / cost_ratio / chain - 1


@pytest.mark.parametrize("change, run", [("drop", CHAIN), ("rise", TREE)])
def test_a_batch_follows_an_acceptance_change_within_steps_to_move(change, run):
    # 512 requests change their depth-1 rank-0 rate at once (0.9 <-> 0.2; deeper ones stay 0.9, sibling 0.3, the
    # default prior), while the batch runs one shape (the one it prefers before the change). The expected length of
    # either shape is 1 + c_1 * (what follows), linear in c_1, and c_1 of both shapes moves 1 - 2 ** (-n / h) of the
    # way after n steps: the preference flips where the break-even lies, a fraction phi of the way from the old
    # lengths to the new, after steps_to_move(h, phi) steps. The engine pool forgets at the rows' pace (its
    # half-life in observations is 512 h), so the prior moves with them.
    widths, half_life, num_rows, cost_ratio = [2, 2, 1], 8, 512, 1.2
    high, low = rates_of([0.9, 0.9, 0.9], 0.3), rates_of([0.2, 0.9, 0.9], 0.3)
    old, new = (high, low) if change == "drop" else (low, high)
    gains = []
    for rates in (old, new):
        tree_length, chain_length = expected_lengths(continuations_of_rates(rates, widths))
        gains.append(tree_length / cost_ratio - chain_length)
    phi = gains[0] / (gains[0] - gains[1])  # where the interpolated gain crosses 0
    expected_flip = steps_to_move(half_life, phi)
    assert 0.2 < phi < 0.9 and (gains[0] > 0) == (run == TREE)  # the batch runs what it prefers before
    table = AcceptanceTable(widths, num_rows, half_life=half_life, engine_half_life=num_rows * half_life)
    rows, rng = np.arange(num_rows), np.random.default_rng(11)
    drafts = np.full(num_rows, len(widths))

    def step(rates):
        table.observe(rows, run, drafts, simulate_accepted(rng, widths, np.repeat(rates[None], num_rows, 0),
                                                           run == TREE))

    for _ in range(20 * half_life):
        step(old)
    prefers_tree = batch_preference(table, rows, cost_ratio) > 0
    assert prefers_tree == (run == TREE)
    flip = None
    for n in range(1, 10 * half_life):
        step(new)
        if (batch_preference(table, rows, cost_ratio) > 0) != prefers_tree:
            flip = n
            break
    assert flip is not None and abs(flip - expected_flip) <= 1, (flip, expected_flip, phi)
