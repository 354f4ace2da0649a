"""A request scheduled with part of its draft tree keeps its one decode token only, and counts as a fallback: in the
step's SchedulerStats, which carry it to the front end, and in a log line per stats interval."""

from types import SimpleNamespace
import weakref

from vllm.v1.engine import EngineCoreOutputs
from vllm.v1.metrics.stats import SchedulerStats
from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

from vllm_treewy.vllm_plugin.trees.budget import (
    _whole_trees_only,
    _with_fallbacks,
    drop_partial_trees,
    keep_one_draft_shape,
)
from vllm_treewy.vllm_plugin.trees.fallbacks import FALLBACK_METRIC, TreeFallbacks, stats_carry_plugin_counters


def test_partial_trees_keep_only_their_decode_token():
    output = SimpleNamespace(
        scheduled_spec_decode_tokens={"whole": [1] * 6, "cut": [1, 2], "prefill-neighbour-free": []},
        num_scheduled_tokens={"whole": 7, "cut": 3, "prefill": 40, "prefill-neighbour-free": 1},
        total_num_scheduled_tokens=51,
    )
    assert drop_partial_trees(output, num_nodes=6) == ["cut"]
    assert output.num_scheduled_tokens == {"whole": 7, "cut": 1, "prefill": 40, "prefill-neighbour-free": 1}
    assert output.total_num_scheduled_tokens == 49
    assert "cut" not in output.scheduled_spec_decode_tokens and len(output.scheduled_spec_decode_tokens["whole"]) == 6


def test_fallbacks_are_logged_once_per_stats_interval(monkeypatch):
    import vllm.envs as envs

    monkeypatch.setattr(envs, "VLLM_LOG_STATS_INTERVAL", 10.0, raising=False)
    fallbacks = TreeFallbacks()
    assert fallbacks.count(2, now=100.0)  # the first one logs at once
    assert not fallbacks.count(3, now=105.0) and fallbacks.unlogged == 3
    assert fallbacks.count(1, now=110.0) and fallbacks.unlogged == 0 and fallbacks.unreported == 6


def test_fallbacks_cross_the_process_boundary_in_the_scheduler_stats():
    """What the engine core sends (msgspec, as vLLM encodes EngineCoreOutputs) holds the count, 0 included."""
    assert stats_carry_plugin_counters(), "patches/vllm-0.32.0-plugin-counters.diff is not applied to vLLM"
    encoder, decoder = MsgpackEncoder(), MsgpackDecoder(EngineCoreOutputs)
    fallbacks = TreeFallbacks()
    sent = []
    for step_fallbacks in (0, 3, 2):
        if step_fallbacks:
            fallbacks.count(step_fallbacks)
        stats = SchedulerStats()
        fallbacks.report(stats)
        received = decoder.decode(encoder.encode(EngineCoreOutputs(scheduler_stats=stats)))
        sent.append(received.scheduler_stats.plugin_counters)
    assert sent == [{FALLBACK_METRIC: 0}, {FALLBACK_METRIC: 3}, {FALLBACK_METRIC: 2}]
    fallbacks.report(None)  # vLLM makes no stats (log_stats off): nothing is lost
    assert fallbacks.unreported == 0


def test_without_the_patch_nothing_is_reported():
    fallbacks = TreeFallbacks(exported=False)
    fallbacks.count(4)
    stats = SimpleNamespace()
    fallbacks.report(stats)
    assert vars(stats) == {}


class _Scheduler:
    """What the hooks read of vLLM's scheduler."""

    def __init__(self, num_nodes: int | None):
        tree = SimpleNamespace(num_nodes=num_nodes)
        self.vllm_config = SimpleNamespace(
            speculative_config=SimpleNamespace(is_draft_tree=num_nodes is not None, draft_tree=tree))


def test_the_hooks_keep_each_schedulers_fallbacks_off_the_scheduler():
    registry = weakref.WeakKeyDictionary()
    update = _whole_trees_only(lambda self, output: "committed", registry)
    make_stats = _with_fallbacks(lambda self: SchedulerStats(), registry)
    first, second, chain = _Scheduler(6), _Scheduler(6), _Scheduler(None)
    attributes = {id(s): dict(vars(s)) for s in (first, second, chain)}

    def step(scheduler, drafts: dict[str, int]):
        output = SimpleNamespace(scheduled_spec_decode_tokens={r: [0] * n for r, n in drafts.items()},
                                 num_scheduled_tokens={r: 1 + n for r, n in drafts.items()},
                                 total_num_scheduled_tokens=sum(1 + n for n in drafts.values()))
        assert update(scheduler, output) == "committed"
        return make_stats(scheduler).plugin_counters

    assert step(first, {"a": 6, "b": 2, "c": 1}) == {FALLBACK_METRIC: 2}
    assert step(second, {"a": 6}) == {FALLBACK_METRIC: 0}
    assert step(first, {"a": 6}) == {FALLBACK_METRIC: 0}
    assert step(chain, {"a": 2}) == {}  # chains are cut by vLLM as it does, and report nothing
    assert all(vars(s) == attributes[id(s)] for s in (first, second, chain))
    del first
    assert len(registry) == 2  # a scheduler's fallbacks go with it (the chain scheduler's state: its shape only)


# draft_tree_max_batch_size: a [2, 2, 1] tree (N = 10 nodes, depth D = 3) below the threshold, the chain above it.
N, D = 10, 3


def _output(drafts: dict[str, int], k: int, prefills=(), finished=()):
    """A scheduler output: decodes with their draft counts, prompt chunks, this step's K and the finished ids."""
    scheduled = {r: 1 + n for r, n in drafts.items()} | {r: 40 for r in prefills}
    return SimpleNamespace(scheduled_spec_decode_tokens={r: [7] * n for r, n in drafts.items() if n},
                           num_scheduled_tokens=scheduled, total_num_scheduled_tokens=sum(scheduled.values()),
                           num_spec_tokens_to_schedule=k, finished_req_ids=set(finished))


def _drafts(output) -> dict[str, int]:
    return {r: len(d) for r, d in output.scheduled_spec_decode_tokens.items()}


def test_threshold_keeps_whole_trees_and_chains_cut_or_not():
    drafted_with = {"tree": N, "cut-tree": N, "chain": D, "cut-chain": D}
    output = _output({"tree": N, "cut-tree": 2}, k=N)
    assert keep_one_draft_shape(output, N, drafted_with) == ["cut-tree"]  # a tree cut to a chain's length: dropped
    assert _drafts(output) == {"tree": N} and output.num_scheduled_tokens["cut-tree"] == 1
    assert output.total_num_scheduled_tokens == 1 + N + 1
    output = _output({"chain": D, "cut-chain": 1}, k=D)
    assert keep_one_draft_shape(output, N, drafted_with) == []  # chain rows, one cut by the budget: kept
    assert _drafts(output) == {"chain": D, "cut-chain": 1} and output.total_num_scheduled_tokens == 1 + D + 2
    # a tree cut to a chain's length beside chains only: still a partial tree, never verified as a chain
    drafted_with = {"cut-tree": N, "chain": D}
    output = _output({"cut-tree": D, "chain": D}, k=D)
    assert keep_one_draft_shape(output, N, drafted_with) == ["cut-tree"]
    assert _drafts(output) == {"chain": D}


def test_threshold_drops_chain_rows_in_a_step_of_trees():
    """A request that skipped a step holds drafts of another batch size's shape: the step keeps the trees."""
    drafted_with = {"tree": N, "late-chain": D}
    output = _output({"tree": N, "late-chain": D}, k=N)
    assert keep_one_draft_shape(output, N, drafted_with) == ["late-chain"]
    assert _drafts(output) == {"tree": N} and output.num_scheduled_tokens["late-chain"] == 1
    # without tree rows the chain rows stay, beside a dropped partial tree
    drafted_with = {"cut-tree": N, "late-chain": D}
    output = _output({"cut-tree": 4, "late-chain": D}, k=D)
    assert keep_one_draft_shape(output, N, drafted_with) == ["cut-tree"]
    assert _drafts(output) == {"late-chain": D}


def test_threshold_records_each_requests_last_draft_count_and_forgets_finished_ones():
    drafted_with = {}
    # a prompt and two decodes at a tree's batch size: everything scheduled drafts the tree next
    keep_one_draft_shape(_output({"a": 0, "b": 0}, k=N, prefills=["p"]), N, drafted_with)
    assert drafted_with == {"a": N, "b": N, "p": N}
    # a larger batch drafts chains; "b" is not scheduled in it and keeps its tree record
    keep_one_draft_shape(_output({"a": N}, k=D, prefills=["q", "r"]), N, drafted_with)
    assert drafted_with == {"a": D, "b": N, "p": N, "q": D, "r": D}
    # "b" comes back with its tree beside "a"'s chain: the chain goes; "p" finished and is forgotten
    output = _output({"a": D, "b": N}, k=N, finished=["p"])
    assert keep_one_draft_shape(output, N, drafted_with) == ["a"]
    assert drafted_with == {"a": N, "b": N, "q": D, "r": D}


def test_threshold_hook_counts_dropped_drafts_as_fallbacks():
    registry = weakref.WeakKeyDictionary()
    update = _whole_trees_only(lambda self, output: "committed", registry)
    make_stats = _with_fallbacks(lambda self: SchedulerStats(), registry)
    scheduler = _Scheduler(N)
    scheduler.vllm_config.speculative_config.draft_tree_max_batch_size = 1
    assert update(scheduler, _output({"a": 0, "b": 0}, k=D)) == "committed"
    assert make_stats(scheduler).plugin_counters == {FALLBACK_METRIC: 0}
    update(scheduler, _output({"a": 2, "b": D}, k=D))  # chains, one cut: nothing dropped
    assert make_stats(scheduler).plugin_counters == {FALLBACK_METRIC: 0}
    registry[scheduler].drafted_with["b"] = N
    update(scheduler, _output({"a": D, "b": N}, k=N))  # "a"'s chain beside "b"'s tree
    assert make_stats(scheduler).plugin_counters == {FALLBACK_METRIC: 1}
    assert vars(scheduler).keys() == {"vllm_config"}
