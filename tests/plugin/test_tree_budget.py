"""A request scheduled with part of its draft tree keeps its one decode token only, and counts as a fallback."""

from types import SimpleNamespace

import prometheus_client

from vllm_treewy.vllm_plugin.tree_budget import FALLBACK_METRIC, count_fallbacks, drop_partial_trees, log_fallbacks


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


def test_fallbacks_are_counted_in_the_registry():
    before = prometheus_client.REGISTRY.get_sample_value(f"{FALLBACK_METRIC}_total") or 0.0
    count_fallbacks(2)
    assert prometheus_client.REGISTRY.get_sample_value(f"{FALLBACK_METRIC}_total") == before + 2


def test_fallbacks_are_logged_once_per_stats_interval(monkeypatch):
    import vllm.envs as envs

    monkeypatch.setattr(envs, "VLLM_LOG_STATS_INTERVAL", 10.0, raising=False)
    scheduler = SimpleNamespace()
    assert log_fallbacks(scheduler, 2, now=100.0)  # the first one logs at once
    assert not log_fallbacks(scheduler, 3, now=105.0) and scheduler.treewy_unlogged_tree_fallbacks == 3
    assert log_fallbacks(scheduler, 1, now=110.0) and scheduler.treewy_unlogged_tree_fallbacks == 0
