"""A step verifies whole draft trees or chains, never part of a tree and never both shapes at once.

vLLM's scheduler cuts a request's drafts to what the step's token budget (or max_model_len) leaves, which for a
chain is a shorter chain. The tree runner verifies one static shape, so before the scheduler commits a step
(`_update_after_schedule`, which advances num_computed_tokens by what the step schedules), every request scheduled
with part of a tree (0 < drafts < N) keeps only its one decode token and no drafts.

With `draft_tree_max_batch_size` (vLLM's dynamic speculative decoding, `config.threshold_schedule`) a request's
drafts are the tree's N nodes or the MTP chain of depth D, whichever the propose of the last step it was scheduled
in was asked for (that step's `num_spec_tokens_to_schedule`). Drafts alone do not say which: a tree cut to d <= D
nodes has a chain's length. So the hook keeps, per request, the draft count of the last step it was scheduled in
(`TreeSchedulerState.drafted_with`, forgotten when the request finishes), and:

- tree-shaped drafts: kept whole, a partial tree dropped (as without a threshold);
- chain-shaped drafts: kept, cut or not (a shorter chain is a chain, as vLLM has it);
- a step holding both tree rows and chain rows (a request that skipped a step drafted at another batch size): the
  chain rows' drafts are dropped, so the runner sees tree rows (exactly N drafts) or chain rows (< N), never both.

With `draft_tree_max_batch_size: "auto"` the step's `num_spec_tokens_to_schedule` is chosen before this (by the
state's `AdaptiveShape`, `trees.adaptive_shape`), which then learns from each step's output (`update_from_output`).

Every dropped draft set counts as a tree fallback, reported in the scheduler's stats and logged by its
`TreeFallbacks` (`trees.fallbacks`). What the hooks keep per scheduler lives in one `TreeSchedulerState`, keyed
weakly by the scheduler, not on vLLM's object.
"""

from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass, field

from vllm_treewy.vllm_plugin.config import DraftShape, draft_shape_of
from vllm_treewy.vllm_plugin.patch_points import (
    SCHEDULER_MAKE_STATS,
    SCHEDULER_UPDATE_AFTER_SCHEDULE,
    SCHEDULER_UPDATE_FROM_OUTPUT,
)
from vllm_treewy.vllm_plugin.trees.adaptive_shape import AdaptiveShape
from vllm_treewy.vllm_plugin.trees.fallbacks import TreeFallbacks


@dataclass
class TreeSchedulerState:
    """One scheduler's tree bookkeeping: its config's draft shape (read once, when the scheduler's first step builds
    this state), its fallbacks, and each running request's draft count of the last step it was scheduled in (the
    shape of the drafts it holds next); with "auto", the shape choice."""

    shape: DraftShape
    fallbacks: TreeFallbacks = field(default_factory=TreeFallbacks)
    drafted_with: dict[str, int] = field(default_factory=dict)
    adaptive: AdaptiveShape | None = None


def _drop_drafts(scheduler_output, req_ids: list[str]) -> None:
    for req_id in req_ids:
        num_drafts = len(scheduler_output.scheduled_spec_decode_tokens.pop(req_id))
        scheduler_output.num_scheduled_tokens[req_id] -= num_drafts
        scheduler_output.total_num_scheduled_tokens -= num_drafts


def drop_partial_trees(scheduler_output, num_nodes: int) -> list[str]:
    """Requests scheduled with part of a tree keep their one decode token only; returns their ids."""
    partial = [req_id for req_id, drafts in scheduler_output.scheduled_spec_decode_tokens.items()
               if 0 < len(drafts) < num_nodes]
    _drop_drafts(scheduler_output, partial)
    return partial


def keep_one_draft_shape(scheduler_output, num_nodes: int, drafted_with: dict[str, int]) -> list[str]:
    """The step's drafts as whole trees or chains, not both (module docstring): drops partial trees, and chain rows
    in a step with tree rows; returns the ids whose drafts were dropped. A request without a record counts as
    tree-shaped. Then records this step's draft count for every scheduled request and forgets finished ones."""
    spec = scheduler_output.scheduled_spec_decode_tokens
    tree_shaped = {req_id: drafted_with.get(req_id, num_nodes) == num_nodes for req_id in spec}
    dropped = [req_id for req_id, drafts in spec.items() if tree_shaped[req_id] and 0 < len(drafts) < num_nodes]
    has_tree_rows = any(tree_shaped[req_id] and len(drafts) == num_nodes for req_id, drafts in spec.items())
    if has_tree_rows:
        dropped += [req_id for req_id, drafts in spec.items() if not tree_shaped[req_id] and drafts]
    _drop_drafts(scheduler_output, dropped)
    for req_id in getattr(scheduler_output, "finished_req_ids", ()):
        drafted_with.pop(req_id, None)
    for req_id in scheduler_output.num_scheduled_tokens:
        drafted_with[req_id] = scheduler_output.num_spec_tokens_to_schedule
    return dropped


def _of(registry: weakref.WeakKeyDictionary, scheduler) -> TreeSchedulerState:
    found = registry.get(scheduler)
    if found is None:
        speculative_config = scheduler.vllm_config.speculative_config
        shape = draft_shape_of(speculative_config)
        adaptive = (AdaptiveShape(speculative_config.draft_tree_widths,
                                  scheduler.vllm_config.scheduler_config.max_num_seqs) if shape.adaptive else None)
        found = registry[scheduler] = TreeSchedulerState(shape, adaptive=adaptive)
    return found


def _whole_trees_only(original, registry: weakref.WeakKeyDictionary):
    @functools.wraps(original)
    def update_after_schedule(self, scheduler_output):
        state = _of(registry, self)
        tree = state.shape.tree
        if tree is not None:
            if state.adaptive is not None:
                state.adaptive.forget(getattr(scheduler_output, "finished_req_ids", ()))
                state.adaptive.choose(scheduler_output)
            if not state.shape.has_chain_steps:
                dropped = drop_partial_trees(scheduler_output, tree.num_nodes)
            else:
                dropped = keep_one_draft_shape(scheduler_output, tree.num_nodes, state.drafted_with)
            if dropped:
                state.fallbacks.count(len(dropped))
        return original(self, scheduler_output)

    return update_after_schedule


def _learning_acceptance(original, registry: weakref.WeakKeyDictionary):
    @functools.wraps(original)
    def update_from_output(self, scheduler_output, model_runner_output):
        state = _of(registry, self)
        if state.adaptive is not None:
            state.adaptive.observe(scheduler_output, model_runner_output)
        return original(self, scheduler_output, model_runner_output)

    return update_from_output


def _with_fallbacks(original, registry: weakref.WeakKeyDictionary):
    @functools.wraps(original)
    def make_stats(self, *args, **kwargs):
        stats = original(self, *args, **kwargs)
        state = _of(registry, self)
        if state.shape.tree is not None:
            state.fallbacks.report(stats)
            if state.adaptive is not None:
                state.adaptive.report(stats)
        return stats

    return make_stats


def install() -> None:
    registry = weakref.WeakKeyDictionary()  # scheduler -> its TreeSchedulerState
    SCHEDULER_UPDATE_AFTER_SCHEDULE.wrap(_whole_trees_only, registry)
    SCHEDULER_MAKE_STATS.wrap(_with_fallbacks, registry)
    SCHEDULER_UPDATE_FROM_OUTPUT.wrap(_learning_acceptance, registry)
