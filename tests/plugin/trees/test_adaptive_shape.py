"""`trees.adaptive_shape`: the scheduler side of `draft_tree_max_batch_size: "auto"`, on stand-in scheduler and
model-runner outputs with a controlled clock: which intervals become step costs, what the acceptance table learns
from a step's emitted tokens, and that the choice follows measured costs and learned acceptance."""

from types import SimpleNamespace

import numpy as np

from vllm_treewy.spec_decode.acceptance_estimate import CHAIN, TREE
from vllm_treewy.vllm_plugin.trees.adaptive_shape import SETTLE_STEPS, AdaptiveShape, batch_buckets

WIDTHS, N, D = [2, 2, 1], 10, 3


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def _decode_output(drafts: dict[str, int]):
    return SimpleNamespace(num_scheduled_tokens={r: 1 + k for r, k in drafts.items()},
                           scheduled_spec_decode_tokens={r: [-1] * k for r, k in drafts.items() if k},
                           scheduled_new_reqs=[], num_spec_tokens_to_schedule=N, finished_req_ids=set())


def _runner_output(accepted: dict[str, int]):
    ids = list(accepted)
    return SimpleNamespace(req_id_to_index={r: i for i, r in enumerate(ids)},
                           sampled_token_ids=[[7] * (1 + accepted[r]) for r in ids])


def _run(adaptive: AdaptiveShape, clock: Clock, steps: int, batch: int, seconds: dict[int, float],
         accepted: dict[int, int]) -> list[int]:
    """Steps of `batch` decoding requests: each step's interval is the time of the shape it verifies (the previous
    choice), and each request accepts `accepted[shape]` drafts. Returns the chosen draft counts."""
    req_ids = [f"r{i}" for i in range(batch)]
    chosen, drafts = [], N
    for _ in range(steps):
        output = _decode_output(dict.fromkeys(req_ids, drafts))
        adaptive.choose(output)
        shape = TREE if output.num_spec_tokens_to_schedule == N else CHAIN
        chosen.append(output.num_spec_tokens_to_schedule)
        clock.now += seconds[shape]
        verified = TREE if drafts == N else CHAIN
        adaptive.observe(output, _runner_output(dict.fromkeys(req_ids, accepted[verified])))
        drafts = output.num_spec_tokens_to_schedule
    return chosen


def test_buckets_cover_every_batch():
    assert batch_buckets(256)[:8] == list(range(1, 9)) and batch_buckets(256)[-1] == 256
    assert batch_buckets(1) == [1]


def test_a_tree_that_costs_more_than_it_gains_gives_way_to_the_chain():
    clock = Clock()
    adaptive = AdaptiveShape(WIDTHS, 8, clock)
    # the tree accepts 3 of 3 depths, the chain 1: the tree wins at equal cost, loses at 3x the chain's
    chosen = _run(adaptive, clock, 40, 4, {TREE: 3.0, CHAIN: 1.0}, {TREE: 3, CHAIN: 1})
    assert chosen[-10:] == [D] * 10
    assert adaptive.costs.cost(4, TREE) == 3.0 and adaptive.costs.cost(4, CHAIN) == 1.0

    clock, adaptive = Clock(), AdaptiveShape(WIDTHS, 8, Clock())
    adaptive.clock = clock
    chosen = _run(adaptive, clock, 40, 4, {TREE: 1.1, CHAIN: 1.0}, {TREE: 3, CHAIN: 1})
    assert chosen[-10:] == [N] * 10


def test_only_steady_decode_intervals_become_costs():
    clock = Clock()
    adaptive = AdaptiveShape(WIDTHS, 8, clock)
    output = _decode_output({"a": 0})
    output.scheduled_new_reqs = ["a"]  # a step with a new request is no decode step
    adaptive.choose(output)
    clock.now += 100.0
    _run(adaptive, clock, SETTLE_STEPS + 1, 1, {TREE: 1.0, CHAIN: 1.0}, {TREE: 0, CHAIN: 0})
    assert adaptive.costs.cost(1, TREE) is None  # the 100 s after the prefill step never counts
    _run(adaptive, clock, 2, 1, {TREE: 1.0, CHAIN: 1.0}, {TREE: 0, CHAIN: 0})
    assert adaptive.costs.cost(1, TREE) == 1.0


def test_observations_follow_each_requests_emitted_tokens_and_rows_are_freed():
    clock = Clock()
    adaptive = AdaptiveShape(WIDTHS, 2, clock)
    output = _decode_output({"a": N, "b": N})
    adaptive.choose(output)
    adaptive.observe(output, _runner_output({"a": 3, "b": 0}))
    counters = adaptive.unreported
    assert counters["vllm:treewy_adaptive_tree_trials_depth_1"] == 2
    assert counters["vllm:treewy_adaptive_tree_continues_depth_1"] == 1
    assert counters["vllm:treewy_adaptive_tree_trials_depth_3"] == 1
    rates = adaptive.table.continuation(np.array([adaptive.rows["a"], adaptive.rows["b"]]))
    assert rates[0, TREE, 0] > rates[1, TREE, 0]
    adaptive.forget({"a", "b"})
    assert adaptive.rows == {} and sorted(adaptive.free_rows) == [0, 1, 2, 3]  # 2 x max_num_seqs rows
    stats = SimpleNamespace(plugin_counters={})
    adaptive.report(stats)
    assert stats.plugin_counters["vllm:treewy_adaptive_tree_steps"] == 1 and adaptive.unreported == {}


def test_preempted_requests_keep_rows_until_rows_run_out_then_the_least_recent_gives_its_row():
    adaptive = AdaptiveShape(WIDTHS, 2, Clock())
    for step in (["a", "b"], ["c", "d"], ["a", "e"]):  # a and b preempted, then a back; e takes b's row
        adaptive.choose(_decode_output(dict.fromkeys(step, 0)))
    assert list(adaptive.rows) == ["c", "d", "a", "e"] and len(set(adaptive.rows.values())) == 4
