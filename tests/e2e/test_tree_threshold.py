"""`draft_tree_max_batch_size`: MTP draft trees at small batches, the MTP chain of the tree's depth above, in vLLM's V1
runner on CPU (the fixture's blurred-head variant, as in `test_mtp_trees`).

Requests arrive and finish while the engine steps (driven through vLLM's engine, one `step` at a time), so the
batch crosses the threshold both ways: steps verify the [2, 2, 1] tree (N = 10 drafts per request) or chains of 3,
and a slot's commit crosses shapes at every transition. Greedy outputs must be tie-aware equivalent to no
speculation; the scheduler's outputs show which shape each step verified, and vLLM's spec-decode counters count
both. The same arrivals under `draft_tree_max_batch_size: "auto"` (the shape chosen per step from learned acceptance
and measured step times, `trees.adaptive_shape`): equivalent too, one shape per step, and its counters count the
steps of each shape it chose.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import pytest
from transformers import AutoTokenizer
from vllm import SamplingParams

from vllm_treewy.fixture import blurred_mtp_variant, fixture_prompts
from vllm_treewy.fixture.exact import ExactModel
from vllm_treewy.vllm_plugin.testing.equivalence import (
    attributes_added_to_vllm,
    compare_tie_aware,
    engine,
    read_acceptance,
)

pytestmark = pytest.mark.e2e

WIDTHS, NUM_NODES, DEPTH = [2, 2, 1], 10, 3
THRESHOLD = 2
MAX_NUM_SEQS = 4
SPEC = {"method": "mtp", "num_speculative_tokens": DEPTH, "draft_tree_widths": WIDTHS,
        "mamba_state_commit": "reconstruct", "draft_tree_max_batch_size": THRESHOLD}
AUTO_SPEC = {**SPEC, "draft_tree_max_batch_size": "auto"}
# (engine step at which the request arrives, prompt index, max_tokens): one request alone (trees), three more join
# (4 requests: chains), they finish down to one (trees), then pairs (trees) and a late arrival beside a long one.
ARRIVALS = [(0, 0, 40), (6, 1, 12), (6, 2, 14), (6, 3, 10), (20, 4, 12), (20, 5, 16), (40, 6, 10), (40, 7, 8),
            (44, 8, 14), (44, 9, 12)]


@dataclass
class Step:
    batch_size: int
    next_drafts: int  # vLLM's num_spec_tokens_to_schedule: what this step's propose drafts
    drafts: list[int]  # the scheduled draft counts of the step's requests that verify drafts


@contextlib.contextmanager
def recording_steps(steps: list[Step]):
    """Records every scheduler output's batch size, this step's draft count and the scheduled draft counts."""
    from vllm.v1.core.sched.scheduler import Scheduler

    original = Scheduler.schedule

    def schedule(self, *args, **kwargs):
        output = original(self, *args, **kwargs)
        steps.append(Step(len(output.num_scheduled_tokens), output.num_spec_tokens_to_schedule,
                          sorted(len(d) for d in output.scheduled_spec_decode_tokens.values() if d)))
        return output

    Scheduler.schedule = schedule
    try:
        yield
    finally:
        Scheduler.schedule = original


def greedy(index: int, max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def drive(llm, prompts, params=greedy, prefix: str = "") -> list[list[int]]:
    """Adds each request of ARRIVALS at its arrival step (id `prefix` + its prompt index, sampling parameters
    `params(prompt index, max_tokens)`), steps the engine until every request finished; outputs in prompt order."""
    core, pending, done, step = llm.llm_engine, list(ARRIVALS), {}, 0
    while pending or core.has_unfinished_requests():
        while pending and pending[0][0] <= step:
            _, index, max_tokens = pending.pop(0)
            core.add_request(f"{prefix}{index}", {"prompt_token_ids": prompts[index]}, params(index, max_tokens))
        for output in core.step():
            if output.finished:
                done[output.request_id] = list(output.outputs[0].token_ids)
        step += 1
    return [done[f"{prefix}{index}"] for _, index, _ in sorted(ARRIVALS, key=lambda a: a[1])]


def _run(model, prompts, speculative_config) -> dict:
    steps: list[Step] = []
    with recording_steps(steps), engine(model, max_num_seqs=MAX_NUM_SEQS,
                                        speculative_config=speculative_config) as llm:
        outputs = drive(llm, prompts)
        treewy = {m.name: m.value for m in llm.get_metrics() if "treewy_adaptive" in m.name}
        return dict(steps=steps, outputs=outputs, acceptance=read_acceptance(llm),
                    added=attributes_added_to_vllm(llm), treewy=treewy)


def _judge(model, prompts, runs: list[dict]) -> None:
    """The no-speculation engine (raw logits: the mode changes what logprobs return, not the greedy tokens) driven
    through the same arrivals gives the reference, then re-scores each run's divergences from it (its verdict)."""
    with engine(model, logprobs_mode="raw_logits", max_num_seqs=MAX_NUM_SEQS) as judge:
        reference = drive(judge, prompts)
        for run in runs:
            run["verdict"] = compare_tie_aware(judge, prompts, reference, run["outputs"],
                                               ExactModel(model).next_token_logits)


@pytest.fixture(scope="module")
def runs(fixture_model, tmp_path_factory):
    """The threshold's run and "auto"'s, judged by one no-speculation engine."""
    model = str(blurred_mtp_variant(fixture_model, tmp_path_factory.mktemp("blurred-mtp")))
    prompts = fixture_prompts(AutoTokenizer.from_pretrained(model), len(ARRIVALS))
    threshold, auto = _run(model, prompts, SPEC), _run(model, prompts, AUTO_SPEC)
    _judge(model, prompts, [threshold, auto])
    return dict(threshold=threshold, auto=auto)


@pytest.fixture(scope="module")
def threshold_run(runs):
    return runs["threshold"]


@pytest.fixture(scope="module")
def auto_run(runs):
    return runs["auto"]


def _verified_shapes(steps: list[Step]) -> list[str]:
    """The shape each step with drafts verified, checking one shape per step and that the drafts are what the
    previous step's propose drafted (without a fallback)."""
    shapes = []
    for previous, step in zip(steps, steps[1:]):
        if not step.drafts:
            continue
        tree = NUM_NODES in step.drafts
        assert set(step.drafts) == {NUM_NODES} if tree else max(step.drafts) <= DEPTH  # never both in a step
        assert set(step.drafts) == {previous.next_drafts} or not tree and previous.next_drafts == DEPTH
        shapes.append("tree" if tree else "chain")
    return shapes


def test_trees_and_chains_by_batch_size_are_equivalent_to_no_speculation(threshold_run):
    verdict = threshold_run["verdict"]
    assert verdict.passed, verdict.summary()
    assert threshold_run["added"] == []  # nothing kept on vLLM's scheduler, runner or builders


def test_each_step_verifies_one_shape_chosen_by_the_batch_size_before_it(threshold_run):
    steps: list[Step] = threshold_run["steps"]
    assert all(step.next_drafts == (NUM_NODES if step.batch_size <= THRESHOLD else DEPTH)
               for step in steps if step.batch_size)
    shapes = _verified_shapes(steps)
    transitions = {(a, b) for a, b in zip(shapes, shapes[1:]) if a != b}
    assert transitions == {("tree", "chain"), ("chain", "tree")}
    assert shapes.count("tree") >= 10 and shapes.count("chain") >= 3


def test_vllms_counters_count_both_shapes(threshold_run):
    steps, acceptance = threshold_run["steps"], threshold_run["acceptance"]
    verified = [d for step in steps for d in step.drafts]
    assert acceptance.num_drafts == len(verified) and acceptance.num_draft_tokens == sum(verified)
    assert NUM_NODES in verified and DEPTH in verified
    # accepted drafts sit at the first DEPTH positions (a tree's accepted path, a chain's prefix)
    assert acceptance.accepted_per_position[DEPTH - 1] > 0 and not any(acceptance.accepted_per_position[DEPTH:])


def test_auto_is_equivalent_to_no_speculation(auto_run):
    verdict = auto_run["verdict"]
    assert verdict.passed, verdict.summary()
    assert auto_run["added"] == []  # the choice's state lives in the scheduler's TreeSchedulerState


def test_auto_drafts_one_shape_a_step_and_counts_the_steps_of_each(auto_run):
    """Every scheduled step drafts the tree or the chain (the schedule's other entries never reach the drafter),
    each verified step holds one shape, and the counters count the steps that drafted each. Which shape a step
    takes depends on measured times here (CPU), so the test checks the invariants, and that both shapes ran: the
    choice explores each shape at a batch size before it has measured it."""
    steps = auto_run["steps"]
    chosen = [step.next_drafts for step in steps if step.batch_size]
    assert set(chosen) == {NUM_NODES, DEPTH}
    shapes = _verified_shapes(steps)
    assert "tree" in shapes and "chain" in shapes
    counters = auto_run["treewy"]
    assert counters["vllm:treewy_adaptive_tree_steps"] == chosen.count(NUM_NODES)
    assert counters["vllm:treewy_adaptive_chain_steps"] == chosen.count(DEPTH)
    # the observation counters: a trial at depth 1 for every request step that verified drafts of that shape
    verified = [d for step in steps for d in step.drafts]
    assert counters["vllm:treewy_adaptive_tree_trials_depth_1"] == verified.count(NUM_NODES)
    assert counters["vllm:treewy_adaptive_chain_trials_depth_1"] == sum(1 for d in verified if d < NUM_NODES)
