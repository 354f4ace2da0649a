"""Choosing a batch's draft shape (`spec_decode.shape_choice`): step costs per bucket (the bucket a batch pads to, the
decayed mean); the chooser maximises expected tokens per second, explores an unmeasured shape for settle + 1 steps
and then settles, refreshes a stale cost within its bound, and follows a batch whose mix of code-like and prose-like
requests changes. Fixed seeds, CPU, a few seconds."""

from __future__ import annotations

import math

import numpy as np
import pytest

from tests.spec_decode.acceptance_models import (
    CODE_LIKE_RANK0,
    PROSE_LIKE_RANK0,
    SIBLING,
    rates_of,
    simulate_accepted,
)
from vllm_treewy.spec_decode.acceptance_estimate import (
    CHAIN,
    TREE,
    AcceptanceTable,
    continuations_of_rates,
    expected_lengths,
)
from vllm_treewy.spec_decode.shape_choice import ShapeChooser, StepCosts

WIDTHS = [2, 2, 1]
BUCKETS = [1, 2, 4, 8, 16, 32, 64, 128]
CODE, PROSE = rates_of(CODE_LIKE_RANK0, SIBLING), rates_of(PROSE_LIKE_RANK0, SIBLING)


def test_a_batch_pads_to_the_smallest_bucket_holding_it():
    costs = StepCosts([8, 1, 4, 2], half_life=4)
    assert costs.buckets == (1, 2, 4, 8)
    assert [costs.bucket_of(b) for b in (1, 2, 3, 4, 5, 8, 9, 300)] == [1, 2, 4, 4, 8, 8, 8, 8]


def test_step_costs_are_a_decayed_mean_per_bucket_and_shape():
    half_life = 4
    costs = StepCosts(BUCKETS, half_life=half_life)
    assert costs.cost(5, TREE) is None and costs.measured_at(5, TREE) is None
    costs.record(5, TREE, 1.0, step=10)
    assert costs.cost(8, TREE) == 1.0 and costs.measured_at(7, TREE) == 10  # 5 and 7 share bucket 8
    assert costs.cost(8, CHAIN) is None and costs.cost(4, TREE) is None
    costs.record(8, TREE, 3.0, step=10 + half_life)  # half_life steps later the first record weighs half
    assert costs.cost(8, TREE) == pytest.approx((0.5 * 1.0 + 3.0) / 1.5)
    costs.record(8, TREE, 2.0, step=10 + 3 * half_life)
    assert costs.cost(8, TREE) == pytest.approx((0.125 * 1.0 + 0.25 * 3.0 + 2.0) / (0.125 + 0.25 + 1))
    assert costs.measured_at(8, TREE) == 10 + 3 * half_life


def trained_table(row_rates: np.ndarray, steps: int = 300, half_life: float = 50, seed: int = 0) -> AcceptanceTable:
    """A table whose rows drafted the tree and the chain in turns under the synthetic model with ``row_rates``."""
    table = AcceptanceTable(WIDTHS, len(row_rates), half_life=half_life)
    rng, rows = np.random.default_rng(seed), np.arange(len(row_rates))
    for step in range(steps):
        shape = step % 2
        table.observe(rows, shape, np.full(len(rows), len(WIDTHS)),
                      simulate_accepted(rng, WIDTHS, row_rates, shape == TREE))
    return table


def measured(costs: StepCosts, batch: int, tree_seconds: float, chain_seconds: float = 1.0) -> StepCosts:
    costs.record(batch, TREE, tree_seconds, step=0)
    costs.record(batch, CHAIN, chain_seconds, step=0)
    return costs


def true_lengths(rates: np.ndarray) -> np.ndarray:
    return expected_lengths(continuations_of_rates(rates, WIDTHS))


def test_at_equal_costs_the_shape_with_more_expected_tokens():
    table = trained_table(np.stack([PROSE] * 8))
    rows = np.arange(8)
    chooser = ShapeChooser(table, measured(StepCosts(BUCKETS, 8), 8, 1.0), settle=2, refresh_steps=100)
    assert chooser.choose(rows, step=1) == TREE and not chooser.exploring
    tree, chain = table.expected_length(rows).sum(axis=0)
    assert chooser.last_tokens_per_second == pytest.approx((tree, chain))
    # a tree of width 1 everywhere is the chain: the tie goes to the chain
    chain_only = AcceptanceTable([1, 1, 1], 8, half_life=8)
    chooser = ShapeChooser(chain_only, measured(StepCosts(BUCKETS, 8), 8, 1.0), settle=2, refresh_steps=100)
    assert chooser.choose(rows, step=1) == CHAIN


@pytest.mark.parametrize("rates, tree_seconds, best", [
    (CODE, 1.15, CHAIN),  # code-like: the tree gains ~4% in length, less than its step costs
    (CODE, 1.01, TREE),
    (PROSE, 1.15, TREE),  # prose-like: it gains ~27%
    (PROSE, 1.40, CHAIN),
])
def test_the_tree_runs_where_its_gain_exceeds_its_cost(rates, tree_seconds, best):
    tree, chain = true_lengths(rates)
    assert (tree / tree_seconds > chain) == (best == TREE)  # the cases are what they say
    table = trained_table(np.stack([rates] * 16))
    chooser = ShapeChooser(table, measured(StepCosts(BUCKETS, 8), 16, tree_seconds), settle=2, refresh_steps=100)
    assert chooser.choose(np.arange(16), step=1) == best


class Engine:
    """A stand-in for the scheduler's loop: each step asks the chooser, runs the shape (a step costs
    ``seconds[shape]``), records the interval when the chooser says it is steady, and feeds the acceptance back."""

    def __init__(self, chooser: ShapeChooser, seconds: dict[int, float], rng=None, row_rates=None):
        self.chooser, self.seconds, self.rng, self.row_rates = chooser, dict(seconds), rng, row_rates
        self.step, self.shapes, self.steady = 0, [], []

    def run(self, rows: np.ndarray, steps: int = 1):
        for _ in range(steps):
            shape = self.chooser.choose(rows, self.step)
            steady = self.chooser.steady()
            if steady:
                self.chooser.costs.record(len(rows), shape, self.seconds[shape], self.step)
            if self.row_rates is not None:
                accepted = simulate_accepted(self.rng, WIDTHS, self.row_rates[rows], shape == TREE)
                self.chooser.table.observe(rows, shape, np.full(len(rows), len(WIDTHS)), accepted)
            self.shapes.append(shape)
            self.steady.append(steady)
            self.step += 1


def test_a_shape_never_measured_is_explored_tree_first_then_settles():
    settle = 2
    table = trained_table(np.stack([CODE] * 16))
    engine = Engine(ShapeChooser(table, StepCosts(BUCKETS, 8), settle=settle, refresh_steps=1000),
                    {TREE: 1.3, CHAIN: 1.0})
    engine.run(np.arange(8), steps=10)
    hold = settle + 1
    assert engine.shapes == [TREE] * hold + [CHAIN] * hold + [CHAIN] * 4
    assert engine.steady == [False, False, True, False, False, True, True, True, True, True]
    assert engine.chooser.steady(8) and not engine.chooser.steady(4)  # a caller one step late asks about its step
    # a new bucket is not explored by both shapes: its costs are estimated from bucket 8's; the shape that is not
    # the best there (the tree) is measured by a refresh hold, rate-limited, which the batch's move cuts short
    engine.run(np.arange(12), steps=1)  # bucket 16: estimated costs; the tree's refresh hold starts
    assert engine.chooser.costs.estimate(12, TREE) == 1.3 and engine.chooser.costs.cost(12, TREE) is None
    engine.run(np.arange(8), steps=1)  # back to 8, measured: the best
    engine.run(np.arange(12), steps=hold)  # bucket 16 again: no new hold within refresh_steps: the best, measured
    assert engine.shapes[10:] == [TREE, CHAIN] + [CHAIN] * hold
    assert engine.steady[10:] == [False, False] + [False] * settle + [True]
    assert engine.chooser.costs.cost(16, CHAIN) == 1.0 and engine.chooser.costs.cost(16, TREE) is None


def test_an_unmeasured_bucket_takes_the_other_shapes_cost_there_times_their_ratio_nearby():
    costs = StepCosts(BUCKETS, 8)
    assert costs.estimate(8, TREE) is None  # never measured anywhere
    costs.record(8, TREE, 1.2, 0)
    assert costs.estimate(64, TREE) == 1.2  # the nearest bucket's
    costs.record(8, CHAIN, 1.0, 0)
    costs.record(64, CHAIN, 3.0, 0)
    assert costs.estimate(64, TREE) == pytest.approx(3.6)  # the chain's cost there times 1.2 / 1.0


def test_refreshes_are_bounded_and_catch_a_cost_change():
    settle, refresh_steps, steps = 2, 100, 3000
    table = trained_table(np.stack([CODE] * 8))
    chooser = ShapeChooser(table, StepCosts(BUCKETS, 4), settle=settle, refresh_steps=refresh_steps)
    engine = Engine(chooser, {TREE: 1.3, CHAIN: 1.0})
    rows, explored = np.arange(8), 2 * (settle + 1)
    engine.run(rows, steps=explored + steps)
    refreshes = [step for step, shape in enumerate(engine.shapes) if step >= explored and shape == TREE]
    assert len(refreshes) <= (settle + 1) * math.ceil(steps / refresh_steps)  # the bound
    # and refreshes do happen: a hold of settle + 1 steps, one past each refresh_steps from the last measurement
    assert len(refreshes) == (settle + 1) * len(refreshes[::settle + 1])
    starts = [0] + refreshes[::settle + 1]  # the tree's exploration, then its refreshes
    assert all(refresh_steps < later - earlier <= refresh_steps + settle + 2
               for earlier, later in zip(starts, starts[1:]))
    assert starts[-1] > explored + steps - refresh_steps - settle - 2
    # the tree gets cheaper: the next refresh finds it, and the batch moves to it
    engine.seconds[TREE] = 0.9
    engine.run(rows, steps=refresh_steps + 2 * (settle + 1))
    assert engine.shapes[-1] == TREE and chooser.costs.cost(8, TREE) < 1.0


def test_the_refresh_bound_holds_for_a_batch_moving_between_buckets():
    # the batch spends 60 steps in one bucket, then 60 in the other: each time it comes back, the tree's cost there
    # is older than refresh_steps, but refresh holds start at most once per refresh_steps
    settle, refresh_steps, blocks, block = 2, 100, 50, 60
    table = trained_table(np.stack([CODE] * 16))
    chooser = ShapeChooser(table, StepCosts(BUCKETS, 4), settle=settle, refresh_steps=refresh_steps)
    engine = Engine(chooser, {TREE: 1.3, CHAIN: 1.0})
    for number in range(blocks):
        engine.run(np.arange(8 if number % 2 else 16), steps=block)
    explorations = 2 * 2 * (settle + 1)  # both shapes, both buckets, once
    off_best = engine.shapes.count(TREE)
    assert off_best - explorations <= (settle + 1) * math.ceil(blocks * block / refresh_steps)
    assert off_best - explorations >= (settle + 1) * (blocks * block // (2 * refresh_steps))  # refreshes happen


def break_even_code_share(tree_seconds: float) -> float:
    """The share of code-like requests at which a batch's tree and chain give equal expected tokens/s."""
    gains = [tree / tree_seconds - chain for tree, chain in (true_lengths(CODE), true_lengths(PROSE))]
    return gains[1] / (gains[1] - gains[0])


def test_the_batch_choice_follows_its_mix_of_request_classes():
    tree_seconds, size = 1.15, 64
    share = break_even_code_share(tree_seconds)
    assert 0.25 < share < 0.55
    table = trained_table(np.stack([CODE] * size + [PROSE] * size))
    chooser = ShapeChooser(table, StepCosts(BUCKETS, 8), settle=2, refresh_steps=100)
    measured(chooser.costs, size, tree_seconds)
    for code_rows in range(0, size + 1, 4):
        rows = np.concatenate([np.arange(code_rows), size + np.arange(size - code_rows)])
        choice = chooser.choose(rows, step=1)
        if abs(code_rows / size - share) > 0.08:
            assert choice == (TREE if code_rows / size < share else CHAIN), code_rows


def test_a_batch_that_turns_code_like_moves_to_the_chain():
    # 32 requests, prose-like at first; every 16 steps one finishes and a code-like one takes its row (reset). The
    # chooser drives: the batch drafts the shape chosen, so only that shape is observed (the other follows through the
    # pooled sibling rate; refreshes observe it too). Its choice moves from the tree to the chain near the break-even
    # share of code-like requests.
    tree_seconds, size, every = 1.15, 32, 16
    share = break_even_code_share(tree_seconds)
    table = AcceptanceTable(WIDTHS, size, half_life=8)
    row_rates = np.stack([PROSE] * size)
    chooser = ShapeChooser(table, StepCosts(BUCKETS, 8), settle=1, refresh_steps=50)
    engine = Engine(chooser, {TREE: tree_seconds, CHAIN: 1.0}, np.random.default_rng(5), row_rates)
    rows = np.arange(size)
    choices = []  # (code share, the best shape's choice) per step that was not an exploration
    for code_rows in range(size + 1):
        if code_rows:
            row_rates[code_rows - 1] = CODE
            table.reset([code_rows - 1])
        for _ in range(every):
            engine.run(rows)
            if not chooser.exploring:
                choices.append((code_rows / size, engine.shapes[-1]))
    assert choices[-1][1] == CHAIN and all(shape == TREE for code, shape in choices if code < share - 0.15)
    assert all(shape == CHAIN for code, shape in choices if code > share + 0.15)
