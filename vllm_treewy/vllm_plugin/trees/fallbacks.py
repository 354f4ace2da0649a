"""Tree fallbacks as users see them: a counter in vLLM's metrics and a log line.

A tree fallback is a request step that ran without speculation because the request's whole draft tree did not fit
the step's token budget, or (with `draft_tree_max_batch_size`) whose chain drafts met tree rows in one step
(`trees.budget`). Each scheduler's fallbacks are kept by one `TreeFallbacks`, which the
scheduler hooks own (nothing is added to vLLM's scheduler). They reach the front end in the step's SchedulerStats,
in the field `plugin_counters` that `patches/vllm-0.32.0-plugin-counters.diff` adds to vLLM (msgspec carries only
SchedulerStats' declared fields from the engine-core process, and vLLM 0.32 has none for a plugin's counts); vLLM's
Prometheus logger exports it as the per-engine counter `vllm:treewy_tree_fallbacks` (labels model_name, engine) in
`vllm serve`'s /metrics and `LLM.get_metrics()`, in-process or not, from 0 at the first stats of a tree engine.
Without the patch the counter is not exported, which the first log line says. The scheduler also logs the
fallbacks, at most once per vLLM stats interval (`VLLM_LOG_STATS_INTERVAL`), in every mode.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time

import vllm.envs as envs

from vllm_treewy.vllm_plugin.patch_points import SCHEDULER_STATS

logger = logging.getLogger(f"vllm.{__name__}")  # under vLLM's logger: printed with its lines, as it configures them

FALLBACK_METRIC = "vllm:treewy_tree_fallbacks"
PLUGIN_COUNTERS = "plugin_counters"  # the SchedulerStats field the patch adds
PATCH = "patches/vllm-0.32.0-plugin-counters.diff"


def stats_carry_plugin_counters() -> bool:
    """Whether the installed vLLM has the patch's SchedulerStats.plugin_counters."""
    return any(field.name == PLUGIN_COUNTERS for field in dataclasses.fields(SCHEDULER_STATS.resolve()))


class TreeFallbacks:
    """One scheduler's fallbacks: those not yet in its stats, those not yet logged, and when it last logged."""

    def __init__(self, exported: bool | None = None):
        self.exported = stats_carry_plugin_counters() if exported is None else exported
        self.unreported = 0
        self.unlogged = 0
        self.logged_at = -math.inf

    def count(self, num_requests: int, now: float | None = None) -> bool:
        """Adds a step's fallbacks; logs the unlogged ones when vLLM's stats interval has passed since the last
        line. Returns whether it logged."""
        self.unreported += num_requests
        self.unlogged += num_requests
        now = time.monotonic() if now is None else now
        if now - self.logged_at < envs.VLLM_LOG_STATS_INTERVAL:
            return False
        where = FALLBACK_METRIC if self.exported else (
            f"{FALLBACK_METRIC} is not exported: the installed vLLM lacks {PATCH}; `python3 -m "
            "vllm_treewy.vllm_patches` applies it")
        logger.info(
            "Draft trees: %d request steps without speculation since the last report (a partial tree, or chain "
            "drafts in a step of trees; %s)", self.unlogged, where)
        self.unlogged, self.logged_at = 0, now
        return True

    def report(self, stats) -> None:
        """Moves the fallbacks not yet reported into a step's SchedulerStats (0 too: the counter shows from the
        first stats on). Nothing where vLLM makes no stats (None) or lacks the field: they wait, or stay unexported."""
        if self.exported and add_plugin_counters(stats, {FALLBACK_METRIC: self.unreported}):
            self.unreported = 0


def add_plugin_counters(stats, increments: dict[str, int]) -> bool:
    """Adds `increments` (by metric name) to a step's SchedulerStats.plugin_counters; False where there is nothing to
    add them to (vLLM made no stats this step, or its SchedulerStats lack the patch's field)."""
    counters = getattr(stats, PLUGIN_COUNTERS, None)
    if counters is None:
        return False
    for name, increment in increments.items():
        counters[name] = counters.get(name, 0) + increment
    return True
