"""A draft tree is verified whole or not at all: a request whose N nodes do not all fit this step runs without
speculation.

vLLM's scheduler cuts a request's drafts to what the step's token budget (or max_model_len) leaves, which for a
chain is a shorter chain. The tree runner verifies one static shape, so before the scheduler commits a step
(`_update_after_schedule`, which advances num_computed_tokens by what the step schedules), every request scheduled
with 0 < drafts < N keeps only its one decode token and no drafts. Such fallbacks are counted, reported in the
scheduler's stats and logged by the scheduler's `TreeFallbacks` (`tree_fallbacks`), which the two scheduler hooks
here share: one per scheduler, kept by the hooks (keyed weakly by the scheduler), not on vLLM's object.
"""

from __future__ import annotations

import functools
import weakref

from vllm_treewy.vllm_plugin.config import draft_tree_of
from vllm_treewy.vllm_plugin.patch_points import SCHEDULER_MAKE_STATS, SCHEDULER_UPDATE_AFTER_SCHEDULE
from vllm_treewy.vllm_plugin.tree_fallbacks import TreeFallbacks


def drop_partial_trees(scheduler_output, num_nodes: int) -> list[str]:
    """Requests scheduled with part of a tree keep their one decode token only; returns their ids."""
    partial = [req_id for req_id, drafts in scheduler_output.scheduled_spec_decode_tokens.items()
               if 0 < len(drafts) < num_nodes]
    for req_id in partial:
        num_drafts = len(scheduler_output.scheduled_spec_decode_tokens.pop(req_id))
        scheduler_output.num_scheduled_tokens[req_id] -= num_drafts
        scheduler_output.total_num_scheduled_tokens -= num_drafts
    return partial


def _of(fallbacks: weakref.WeakKeyDictionary, scheduler) -> TreeFallbacks:
    found = fallbacks.get(scheduler)
    if found is None:
        found = fallbacks[scheduler] = TreeFallbacks()
    return found


def _whole_trees_only(original, fallbacks: weakref.WeakKeyDictionary):
    @functools.wraps(original)
    def update_after_schedule(self, scheduler_output):
        tree = draft_tree_of(self.vllm_config.speculative_config)
        if tree is not None:
            dropped = drop_partial_trees(scheduler_output, tree.num_nodes)
            if dropped:
                _of(fallbacks, self).count(len(dropped))
        return original(self, scheduler_output)

    return update_after_schedule


def _with_fallbacks(original, fallbacks: weakref.WeakKeyDictionary):
    @functools.wraps(original)
    def make_stats(self, *args, **kwargs):
        stats = original(self, *args, **kwargs)
        if draft_tree_of(self.vllm_config.speculative_config) is not None:
            _of(fallbacks, self).report(stats)
        return stats

    return make_stats


def install() -> None:
    fallbacks = weakref.WeakKeyDictionary()  # scheduler -> its TreeFallbacks
    SCHEDULER_UPDATE_AFTER_SCHEDULE.wrap(_whole_trees_only, fallbacks)
    SCHEDULER_MAKE_STATS.wrap(_with_fallbacks, fallbacks)
