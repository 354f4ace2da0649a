"""Choosing, every step, whether a batch drafts the configured tree or the chain of its depth.

What is chosen. One shape for the whole batch, per step: the tree (widths w_1 .. w_D) or the MTP chain of depth D,
whichever gives more expected accepted tokens per second, ``sum over rows of expected_length[row, shape] /
cost(batch, shape)``, with the expected lengths from an ``acceptance_estimate.AcceptanceTable`` and the step's cost
measured per batch bucket and shape (``StepCosts``). One shape per step because Model Runner V2 replays one FULL CUDA
graph per uniform decode shape and the GDN commit tables are per shape: per-request shapes would make mixed steps.
Costs are per bucket because V2 pads a decode batch to its captured sizes: every batch of one bucket costs the same.

Exploration, deterministic. A shape never measured at any bucket is run (the tree first) and held for ``settle + 1``
steps, so that the last of them follows ``settle`` steps of the same bucket and shape: an interval that is the shape's
own (``steady``), which the caller records (``StepCosts.record``) only then: ``2 (settle + 1)`` steps once per engine.
At a bucket where a shape has no measurement, its cost is estimated (``StepCosts.estimate``: the other shape's cost
there times the two shapes' ratio at the nearest bucket that has both, else the nearest bucket's cost), so a batch
that moves through buckets (a batch shrinking as its requests finish) does not explore at each. The shape not chosen
at the bucket is measured when its cost there is missing or older than ``refresh_steps`` steps, held the same way, at
most one such hold started per ``refresh_steps`` steps: at most a fraction ``(settle + 1) / refresh_steps`` of steps
run the shape that is not the best. A hold ends when the batch changes bucket. The shape being run is recorded on
each of its steady steps, so only the other one goes stale.

How fast the batch follows a request. A request whose acceptance changes moves its expected lengths of both shapes
(the shape not run follows through the one run: ``acceptance_estimate``) ``1 - 2 ** (-n / h)`` of the way from the
old ones to the new after n of its steps, h the table's ``half_life``, at depth 1
(``acceptance_estimate.steps_to_move``). The batch switches shape where the sum over its rows crosses the break-even:
if that lies a fraction phi of the way from the batch's old sums to its new ones, the switch comes after

    n = ceil(h * log2(1 / (1 - phi)))

steps (h at phi = 1/2, 2 h at 3/4, 3.3 h at 0.9); a request's change alone moves a batch of B requests by 1/B of it,
so it may not reach the break-even at all. Deeper depths, reached less often after a drop, follow in fewer trials per
step, and the prior (``prior_weight`` pseudo-trials at the engine's estimate) pulls towards the engine's history.
Which way a change moves the batch depends on the siblings too: with their rate unchanged, a lower rank-0 rate favours
the tree (its gain grows as the first candidate is more often wrong); the batch moves to the chain when its requests
become more predictable, or when their later candidates stop being accepted.
"""

from __future__ import annotations

import bisect
import collections
import math
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from .acceptance_estimate import CHAIN, TREE, AcceptanceTable

SHAPES = (TREE, CHAIN)  # the exploration order: the tree first
MAX_RECORD_LAG = 2  # steps by which the caller may ask ``steady`` about an earlier choice (async scheduling)


class StepCosts:
    """Measured seconds a step, per batch bucket and shape: a decayed mean of the recorded intervals, a record
    weighing half once ``half_life`` steps have passed since it was made. The decay counts steps, not records, so the
    shape not run, measured once a refresh, is measured anew by that one record rather than averaged with its past.

    ``buckets``: the batch sizes a decode step is padded to (V2's captured sizes), any order; ``bucket_of`` maps a
    batch to the smallest bucket >= it, the largest bucket for larger batches."""

    def __init__(self, buckets: Sequence[int], half_life: float):
        buckets = sorted({int(b) for b in buckets})
        if not buckets or buckets[0] < 1 or half_life <= 0:
            raise ValueError(f"buckets = {buckets}, half_life = {half_life}: expected positive buckets, half_life > 0")
        self.buckets = tuple(buckets)
        self.half_life = float(half_life)
        # per bucket, per shape: decayed weight and total of the records, the step of the last (-1: none); Python
        # lists, read a few times a step
        self._weight = [[0.0, 0.0] for _ in buckets]
        self._total = [[0.0, 0.0] for _ in buckets]
        self._measured_at = [[-1, -1] for _ in buckets]

    def bucket_of(self, batch: int) -> int:
        return self.buckets[self._index(batch)]

    def record(self, batch: int, shape: int, seconds: float, step: int) -> None:
        """A steady step of ``shape`` at ``batch`` (its bucket) took ``seconds``; ``step`` is the step's index (not
        below the entry's last)."""
        index = self._index(batch)
        last = self._measured_at[index][shape]
        decay = 2.0 ** (-(step - last) / self.half_life) if last >= 0 else 0.0
        self._weight[index][shape] = self._weight[index][shape] * decay + 1.0
        self._total[index][shape] = self._total[index][shape] * decay + float(seconds)
        self._measured_at[index][shape] = int(step)

    def cost(self, batch: int, shape: int) -> float | None:
        """Seconds a step of ``shape`` at ``batch``'s bucket, None where never measured."""
        return self._mean(self._index(batch), shape)

    def _mean(self, index: int, shape: int) -> float | None:
        weight = self._weight[index][shape]
        return self._total[index][shape] / weight if weight > 0 else None

    def estimate(self, batch: int, shape: int) -> float | None:
        """``cost`` where measured; else the other shape's cost at this bucket times the two shapes' ratio at the
        nearest bucket where both are measured; else ``shape``'s cost at the nearest bucket measured; None where
        ``shape`` was never measured."""
        measured = self.cost(batch, shape)
        if measured is not None:
            return measured
        index, other = self._index(batch), 1 - shape
        means = [(self._mean(i, shape), self._mean(i, other)) for i in range(len(self.buckets))]
        known = [i for i, (mine, _) in enumerate(means) if mine is not None]
        if not known:
            return None
        both = [i for i in known if means[i][1] is not None]
        if both and means[index][1] is not None:
            near = min(both, key=lambda i: abs(i - index))
            return means[index][1] * means[near][0] / means[near][1]
        return means[min(known, key=lambda i: abs(i - index))][0]

    def measured_at(self, batch: int, shape: int) -> int | None:
        """The step index of the last record of ``shape`` at ``batch``'s bucket, None where never measured."""
        step = self._measured_at[self._index(batch)][shape]
        return step if step >= 0 else None

    def _index(self, batch: int) -> int:
        return min(bisect.bisect_left(self.buckets, batch), len(self.buckets) - 1)


class _Hold(NamedTuple):
    shape: int
    bucket: int
    last_step: int  # the hold's last step: the one whose interval is steady


class ShapeChooser:
    """The shape of each step's drafts for a batch of rows (module docstring).

    ``table``: the rows' acceptance estimates; ``costs``: the measured step costs, which the caller records on steady
    steps; ``settle``: steps after a change of bucket or shape whose intervals are not the new shape's own;
    ``refresh_steps``: the age in steps past which a cost is measured again.

    After each ``choose``: ``last_tokens_per_second`` (per shape, from estimated costs; NaN where a shape was never
    measured), ``exploring`` (the choice was an exploration or refresh hold, not the best shape's)."""

    def __init__(self, table: AcceptanceTable, costs: StepCosts, settle: int, refresh_steps: int):
        if settle < 0 or refresh_steps < settle + 1:
            raise ValueError(f"settle = {settle}, refresh_steps = {refresh_steps}: expected 0 <= settle, "
                             "settle < refresh_steps")
        self.table = table
        self.costs = costs
        self.settle = settle
        self.refresh_steps = refresh_steps
        self.last_tokens_per_second = (math.nan, math.nan)
        self.exploring = False
        self._hold: _Hold | None = None
        self._last_refresh = -refresh_steps  # the step the last refresh hold started
        self._history: collections.deque[tuple[int, int, int]] = collections.deque(maxlen=settle + 1 + MAX_RECORD_LAG)

    def choose(self, rows: np.ndarray, step: int) -> int:
        """The shape (``TREE`` or ``CHAIN``) that the batch of ``rows`` drafts at step ``step`` (increasing)."""
        batch = len(rows)
        bucket = self.costs.bucket_of(batch)
        lengths = self.table.total_expected_length(rows).tolist()
        costs = [self.costs.estimate(batch, shape) for shape in SHAPES]
        self.last_tokens_per_second = tuple(math.nan if cost is None else lengths[shape] / cost
                                            for shape, cost in zip(SHAPES, costs))
        tree, chain = self.last_tokens_per_second
        best = TREE if tree > chain else CHAIN  # a tie goes to the chain: fewer tokens verified
        hold = self._hold
        if hold is None or hold.bucket != bucket or step > hold.last_step:
            hold = self._hold = self._new_hold(batch, bucket, step, costs, best)
        shape = best if hold is None else hold.shape
        self.exploring = hold is not None
        self._history.append((step, bucket, shape))
        return shape

    def steady(self, step: int | None = None) -> bool:
        """Whether the interval of the step ``step`` chose (default: the latest choice) is attributable to its bucket
        and shape: steps ``step - settle`` .. ``step`` were all chosen, with the same bucket and shape."""
        history = list(self._history)
        if not history:
            return False
        step = history[-1][0] if step is None else step
        run = [entry for entry in history if step - self.settle <= entry[0] <= step]
        return (len(run) == self.settle + 1 and [entry[0] for entry in run] == list(range(step - self.settle, step + 1))
                and len({entry[1:] for entry in run}) == 1)

    def _new_hold(self, batch: int, bucket: int, step: int, costs: list[float | None], best: int) -> _Hold | None:
        for shape, cost in zip(SHAPES, costs):
            if cost is None:  # never measured anywhere
                return _Hold(shape, bucket, step + self.settle)
        if step - self._last_refresh < self.refresh_steps:
            return None
        other = 1 - best
        measured_at = self.costs.measured_at(batch, other)
        if measured_at is not None and step - measured_at <= self.refresh_steps:
            return None
        self._last_refresh = step
        return _Hold(other, bucket, step + self.settle)
