"""A draft tree is verified whole or not at all: a request whose N nodes do not all fit this step runs without
speculation.

vLLM's scheduler cuts a request's drafts to what the step's token budget (or max_model_len) leaves, which for a
chain is a shorter chain. The tree runner verifies one static shape, so before the scheduler commits a step
(`_update_after_schedule`, which advances num_computed_tokens by what the step schedules), every request scheduled
with 0 < drafts < N keeps only its one decode token and no drafts. Each such fallback counts in the Prometheus
counter `vllm:treewy_tree_fallbacks`, since the engine started, as vLLM's own counters (vLLM unregisters every
"vllm:" collector when an engine starts). The counter lives in the scheduler's process: with the engine core in
process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`) `LLM.get_metrics()` lists it once it counted one; in vLLM's default
multiprocess mode it stays in the engine-core process, which neither `get_metrics()` nor `vllm serve`'s `/metrics`
reads (vLLM's own counters travel to the front end in its SchedulerStats, which have no field for it). So the
scheduler also logs the fallbacks, at most once per vLLM stats interval (`VLLM_LOG_STATS_INTERVAL`), in every mode.
"""

from __future__ import annotations

import functools
import math
import time

import vllm.envs as envs
from vllm.logger import init_logger

from vllm_treewy.vllm_plugin.config import draft_tree_of
from vllm_treewy.vllm_plugin.patch_points import SCHEDULER_UPDATE_AFTER_SCHEDULE

logger = init_logger(__name__)

FALLBACK_METRIC = "vllm:treewy_tree_fallbacks"
_fallback_counter = None  # the counter registered now (a registry holds one collector per name)


def count_fallbacks(num_requests: int) -> None:
    global _fallback_counter
    import prometheus_client

    if _fallback_counter is None or prometheus_client.REGISTRY.get_sample_value(f"{FALLBACK_METRIC}_total") is None:
        # None yet, or unregistered by an engine that started since: count this engine's from 0.
        _fallback_counter = prometheus_client.Counter(
            FALLBACK_METRIC, "Requests whose whole draft tree did not fit a step's token budget, so that they decoded "
            "without speculation that step")
    _fallback_counter.inc(num_requests)


def log_fallbacks(scheduler, num_requests: int, now: float | None = None) -> bool:
    """Adds to the scheduler's fallbacks not yet logged; logs them when vLLM's stats interval has passed since the
    last line (the scheduler object keeps both across steps). Returns whether it logged."""
    now = time.monotonic() if now is None else now
    pending = getattr(scheduler, "treewy_unlogged_tree_fallbacks", 0) + num_requests
    logged = now - getattr(scheduler, "treewy_tree_fallbacks_logged_at", -math.inf) >= envs.VLLM_LOG_STATS_INTERVAL
    if logged:
        logger.info(
            "Draft trees: %d request steps without speculation since the last report (the whole tree did not fit the "
            "step's token budget; %s)", pending, FALLBACK_METRIC)
        scheduler.treewy_tree_fallbacks_logged_at, pending = now, 0
    scheduler.treewy_unlogged_tree_fallbacks = pending
    return logged


def drop_partial_trees(scheduler_output, num_nodes: int) -> list[str]:
    """Requests scheduled with part of a tree keep their one decode token only; returns their ids."""
    partial = [req_id for req_id, drafts in scheduler_output.scheduled_spec_decode_tokens.items()
               if 0 < len(drafts) < num_nodes]
    for req_id in partial:
        num_drafts = len(scheduler_output.scheduled_spec_decode_tokens.pop(req_id))
        scheduler_output.num_scheduled_tokens[req_id] -= num_drafts
        scheduler_output.total_num_scheduled_tokens -= num_drafts
    return partial


def _whole_trees_only(original):
    @functools.wraps(original)
    def update_after_schedule(self, scheduler_output):
        tree = draft_tree_of(self.vllm_config.speculative_config)
        if tree is not None:
            fallbacks = drop_partial_trees(scheduler_output, tree.num_nodes)
            if fallbacks:
                count_fallbacks(len(fallbacks))
                log_fallbacks(self, len(fallbacks))
        return original(self, scheduler_output)

    return update_after_schedule


def install() -> None:
    SCHEDULER_UPDATE_AFTER_SCHEDULE.wrap(_whole_trees_only)
