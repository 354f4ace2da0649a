"""`draft_tree_max_batch_size: "auto"`: each step drafts the shape, the tree or the MTP chain of its depth, that the
scheduler expects to accept more tokens a second with, for the whole batch.

Why per batch: a step verifies tree rows or chain rows, never both (`trees.budget`), because Model Runner V2 replays
one FULL decode graph per uniform decode shape and the GDN commit follows one shape's tables; a step of one shape is
what the fixed threshold (`draft_tree_max_batch_size: T`) already runs. "auto" replaces the threshold's rule, the
batch size, by a measured one.

Where: in the scheduler, which decides what the next drafts are (`SchedulerOutput.num_spec_tokens_to_schedule`: the
propose of the step being scheduled drafts that many, and the next step verifies them). Nothing crosses to the
workers: the scheduler already sees what it needs, at no extra sync.

- Acceptance: after each step (`Scheduler.update_from_output`), per request, the shape its drafts had (N scheduled
  drafts: the tree; fewer: a chain, possibly cut by the token budget) and how many were accepted (the tokens the
  step emitted for it, less the bonus). `spec_decode.acceptance_estimate.AcceptanceTable` learns from these, per
  request (a row of its table, taken when the request is first scheduled and freed when it finishes) and for the
  engine (every new request's prior).
- Cost: the host time between two consecutive scheduled steps, which in a steady stream of decode steps is one
  step's time (GPU or host, whichever bounds it, async scheduling included). An interval counts only where the
  steps before it were pure decode steps of the same batch size bucket and shape (`ShapeChooser.steady`), and is
  recorded into `spec_decode.shape_choice.StepCosts` for that bucket and shape.
- Choice: `ShapeChooser.choose` over the step's scheduled requests (their rows' expected acceptance lengths under each
  shape, over the bucket's measured step time of each shape), exploring a shape whose cost at the bucket is unknown
  or stale for a few steps.

Exactness: the tree and the chain samplers each emit the target's distribution given everything before the step,
for a shape fixed before the step. The choice is fixed before it: it reads the batch, measured times and acceptance
of steps already emitted, never the target's probabilities at the step it drafts for. So every step's output has the
target's distribution given the past, whichever shape ran, and the outputs are those of no speculation.

Reported: per-engine counters in vLLM's stats (`plugin_counters`, as `trees.fallbacks` reports its own): the steps
that drafted each shape, and per shape and depth the observed trials and continues (their ratio is the continuation
rate; the learned rank-0 and sibling rates are logged, at most once per vLLM stats interval).
"""

from __future__ import annotations

import logging
import math
import time

import numpy as np
import vllm.envs as envs

from vllm_treewy.spec_decode.acceptance_estimate import CHAIN, TREE, AcceptanceTable
from vllm_treewy.spec_decode.shape_choice import ShapeChooser, StepCosts
from vllm_treewy.tree import DraftTree
from vllm_treewy.vllm_plugin.trees.fallbacks import add_plugin_counters

logger = logging.getLogger(f"vllm.{__name__}")  # under vLLM's logger: printed with its lines

SHAPE_NAMES = {TREE: "tree", CHAIN: "chain"}
STEPS_METRIC = "vllm:treewy_adaptive_{shape}_steps"
TRIALS_METRIC = "vllm:treewy_adaptive_{shape}_trials_depth_{depth}"
CONTINUES_METRIC = "vllm:treewy_adaptive_{shape}_continues_depth_{depth}"

# A request's acceptance is followed within a few of its steps (a request whose acceptance drops moves the batch's
# choice within the steps `AcceptanceTable` derives from this); the engine's pool, every new request's prior, over
# many requests' steps.
HALF_LIFE_STEPS = 8.0
ENGINE_HALF_LIFE_STEPS = 512.0
# Pseudo-trials of the engine's estimate in a request's: enough that one request's few steps do not swing a batch of
# one (`bench/e2e/shape_choice_sim.py` chose it over the measured 27B step times), few enough that its own steps
# soon outweigh them.
PRIOR_WEIGHT = 4.0
# Step times: an estimate follows a drifting cost over a few samples; a shape not run at a bucket for REFRESH_STEPS
# steps is re-measured, holding it SETTLE + 1 steps (at most (SETTLE + 1) / REFRESH_STEPS of steps explore).
COST_HALF_LIFE_SAMPLES = 4.0
SETTLE_STEPS = 2
REFRESH_STEPS = 256


def batch_buckets(max_num_seqs: int) -> list[int]:
    """Batch sizes whose step times are kept apart: every size to 8, then steps of about 1.5x up to max_num_seqs (a
    decode batch pads to V2's captured sizes, so cost moves in steps; nearby sizes share a measurement)."""
    buckets, size = [], 1
    while size < max_num_seqs:
        buckets.append(size)
        size = size + 1 if size < 8 else int(math.ceil(size * 1.5))
    return buckets + [max_num_seqs]


class AdaptiveShape:
    """One scheduler's "auto" shape choice (module docstring): its acceptance table, step costs, chooser, the row of
    each request, and the clock of the last scheduled step. Owned by the scheduler's `TreeSchedulerState`."""

    def __init__(self, widths: list[int], max_num_seqs: int, clock=time.perf_counter):
        self.tree, self.depth = DraftTree.from_widths(widths), len(widths)
        # rows for the running requests and as many preempted ones (which keep theirs until they finish)
        num_rows = 2 * max_num_seqs
        self.table = AcceptanceTable(widths, num_rows, HALF_LIFE_STEPS, prior_weight=PRIOR_WEIGHT,
                                     engine_half_life=ENGINE_HALF_LIFE_STEPS)
        self.costs = StepCosts(batch_buckets(max_num_seqs), COST_HALF_LIFE_SAMPLES)
        self.chooser = ShapeChooser(self.table, self.costs, SETTLE_STEPS, REFRESH_STEPS)
        self.clock = clock
        self.rows: dict[str, int] = {}  # request id -> row, in the order they were last scheduled
        self.free_rows = list(range(num_rows - 1, -1, -1))
        self.step = 0  # choices made
        self.scheduled_at: float | None = None  # when the previous step was scheduled (None: after an idle step)
        self.previous_batch, self.previous_shape = 0, TREE
        self.decode_run = 0  # consecutive decode steps up to this one
        self.unreported: dict[str, int] = {}
        self.logged_at = -math.inf

    def num_drafts(self, shape: int) -> int:
        return self.tree.num_nodes if shape == TREE else self.depth

    # -- per scheduled step -----------------------------------------------------------------------------------

    def choose(self, scheduler_output) -> None:
        """Sets the step's `num_spec_tokens_to_schedule` to the chosen shape's draft count, after recording the
        interval since the previous scheduled step where it is a steady step of one shape (`ShapeChooser.steady`:
        the last `SETTLE_STEPS` + 1 choices alike) and those steps were decode steps."""
        now = self.clock()
        batch = len(scheduler_output.num_scheduled_tokens)
        if batch == 0:  # an idle step: the next interval would span the idle time
            self.scheduled_at, self.decode_run = None, 0
            return
        self.decode_run = self.decode_run + 1 if _is_decode_step(scheduler_output) else 0
        if self.scheduled_at is not None and self.step and self.decode_run > SETTLE_STEPS + 1:
            if self.chooser.steady(self.step - 1):
                self.costs.record(self.previous_batch, self.previous_shape, now - self.scheduled_at, self.step - 1)
        rows = np.fromiter((self._row(req_id) for req_id in scheduler_output.num_scheduled_tokens), np.int64, batch)
        shape = self.chooser.choose(rows, self.step)
        scheduler_output.num_spec_tokens_to_schedule = self.num_drafts(shape)
        name = STEPS_METRIC.format(shape=SHAPE_NAMES[shape])
        self.unreported[name] = self.unreported.get(name, 0) + 1
        self.scheduled_at, self.previous_batch, self.previous_shape = now, batch, shape
        self.step += 1
        self._maybe_log(now)

    def observe(self, scheduler_output, model_runner_output) -> None:
        """Learns from a finished step: per request that verified drafts, their shape and how many were accepted."""
        spec = scheduler_output.scheduled_spec_decode_tokens
        sampled = model_runner_output.sampled_token_ids
        if not spec or not sampled:
            return
        index_of = model_runner_output.req_id_to_index
        seen = [(self.rows[req_id], len(drafts), len(sampled[index_of[req_id]]) - 1)
                for req_id, drafts in spec.items()
                if drafts and req_id in self.rows and req_id in index_of and sampled[index_of[req_id]]]
        if not seen:
            return
        rows, num_drafts, accepted = (np.asarray(column, np.int64) for column in zip(*seen))
        tree = num_drafts == self.tree.num_nodes
        accepted = np.minimum(accepted, np.where(tree, self.depth, num_drafts))  # a path is at most D deep
        for shape, mask in ((TREE, tree), (CHAIN, ~tree)):
            if mask.any():
                trials, misses = self.table.observe(rows[mask], shape, num_drafts[mask], accepted[mask])
                self._count_observed(shape, trials, trials - misses)

    def forget(self, finished_req_ids) -> None:
        """Frees the rows of finished requests (a reused row starts from the engine's prior)."""
        for req_id in finished_req_ids:
            row = self.rows.pop(req_id, None)
            if row is not None:
                self.free_rows.append(row)

    def report(self, stats) -> None:
        """Moves the counters not yet reported into a step's SchedulerStats (`trees.fallbacks.add_plugin_counters`;
        they wait where vLLM makes no stats or lacks the field)."""
        if add_plugin_counters(stats, self.unreported):
            self.unreported = {}

    # -- internals ------------------------------------------------------------------------------------------------

    def _row(self, req_id: str) -> int:
        """The request's row, moved to the end of `rows` (most recently scheduled). A new request takes a free row;
        with none free (more preempted requests than max_num_seqs), the least recently scheduled request's, which
        a step of at most max_num_seqs requests never holds (its estimate restarts from the engine's if it returns)."""
        row = self.rows.pop(req_id, None)
        if row is None:
            if not self.free_rows:
                self.free_rows.append(self.rows.pop(next(iter(self.rows))))
            row = self.free_rows.pop()
            self.table.reset(np.array([row]))
        self.rows[req_id] = row
        return row

    def _count_observed(self, shape: int, trials: np.ndarray, continues: np.ndarray) -> None:
        """Adds a step's trials and continues per depth (`AcceptanceTable.observe`'s counts) to vLLM's counters."""
        name = SHAPE_NAMES[shape]
        for depth, (num_trials, num_continues) in enumerate(zip(trials.tolist(), continues.tolist()), start=1):
            if num_trials:
                for metric, value in ((TRIALS_METRIC, num_trials), (CONTINUES_METRIC, num_continues)):
                    key = metric.format(shape=name, depth=depth)
                    self.unreported[key] = self.unreported.get(key, 0) + round(value)

    def _maybe_log(self, now: float) -> None:
        if now - self.logged_at < envs.VLLM_LOG_STATS_INTERVAL:
            return
        self.logged_at = now
        costs = {bucket: [None if c is None else round(c * 1e3, 2) for c in
                          (self.costs.cost(bucket, TREE), self.costs.cost(bucket, CHAIN))]
                 for bucket in self.costs.buckets if self.costs.measured_at(bucket, TREE) is not None
                 or self.costs.measured_at(bucket, CHAIN) is not None}
        logger.info("Adaptive draft tree: learned rank-0 rates per depth %s, sibling %s; step ms (tree, chain) per "
                    "batch bucket %s", _rounded(self.table.engine_continuation()[CHAIN]),
                    _rounded(self.table.pooled_sibling_rate()), costs)


def _is_decode_step(scheduler_output) -> bool:
    """Every scheduled request decodes: its one token plus its drafts, no prompt chunk, no new request."""
    if scheduler_output.scheduled_new_reqs:
        return False
    spec = scheduler_output.scheduled_spec_decode_tokens
    return all(count == 1 + len(spec.get(req_id, ())) for req_id, count in
               scheduler_output.num_scheduled_tokens.items())


def _rounded(values) -> list[float]:
    return [round(float(v), 3) for v in values]
