"""Draft trees in vLLM's V1 runner on CPU (issue 12, part 1), with the deterministic continuation drafter.

Every engine of this module runs in one module-scoped fixture (engines in one process run one after another): the
no-speculation engine first computes the true continuations the drafter puts on one branch, the tree engines run,
then the no-speculation engine (raw logits) judges them tie-aware. Runs of one engine configuration share one tree
engine, one `generate` after another, each with its own drafts, planted bug and counters (no prefix caching: a run
finds nothing of the runs before it but freed blocks).

The fixture's one full-attention layer is weak: zeroing its tree rows' output leaves greedy tokens unchanged. So
the attention-side planted bugs (no depth positions, no KV compaction) run on a variant whose attention output is
`STRONG_ATTENTION`x larger, where they must fail the same check that the real wiring passes.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from dataclasses import dataclass, field

import prometheus_client
import pytest
import torch
from transformers import AutoConfig, AutoTokenizer

from tests.e2e.conftest import count_mixed_batches
from vllm_treewy.fixture import (PREEMPTION_MAX_TOKENS, PREEMPTION_NUM_BLOCKS, PREEMPTION_PROMPTS, fixture_prompts,
                                 prompts_before_a_block_boundary)
from vllm_treewy.fixture.exact import ExactModel
from vllm_treewy.tree import DraftTree
from vllm_treewy.vllm_plugin.v1 import runner as tree_runner
from vllm_treewy.vllm_plugin.v1 import sampler as tree_sampler
from vllm_treewy.vllm_plugin.testing.continuation_drafter import DRAFTS_ENV, serve_drafts, write_drafts_file
from vllm_treewy.vllm_plugin.testing.equivalence import compare_tie_aware, engine, generate_greedy, generate_run
from vllm_treewy.vllm_plugin.gdn.pseudo_value_buffer import BufferLayout
from vllm_treewy.vllm_plugin.trees.fallbacks import FALLBACK_METRIC

pytestmark = pytest.mark.e2e

WIDTHS = ([2, 1, 1], [2, 2, 1], [3, 2, 2], [4, 2])
DRAFTER = "vllm_treewy.vllm_plugin.testing.continuation_drafter.ContinuationTreeDrafter"
NUM_PROMPTS = 8
MAX_NUM_SEQS = 4  # prompts queue up and prefill beside speculative decodes
# The reference runs this many tokens past each request's max_tokens, so the drafter knows the true continuation
# for every step (a full depth of it even at the last step).
LOOKAHEAD = 4
TRUE_BRANCH = 1  # a non-first child where the width allows: acceptance must follow it
NUM_CORPUS_PROMPTS = 32  # the long prompts are cut from all of them, as in tests/e2e/conftest.py
STRONG_ATTENTION = 20.0
PLANTED_BUGS = ("no_depth_positions", "no_kv_compaction")
SIBLING_WIDTHS = [3, 2, 2]
BUDGET_TOKENS = 48
SIBLING_TRUE, SIBLING_PERTURBED = 0, 2


STORE_ALL_WIDTHS = ([2, 2, 1], [3, 2, 2])  # the baseline: a GDN state block per verified node


def tree_spec(widths: list[int], mamba_state_commit: str = "reconstruct") -> dict:
    return {"method": "custom_class", "model": DRAFTER, "num_speculative_tokens": len(widths),
            "draft_tree_widths": list(widths), "mamba_state_commit": mamba_state_commit}


def strong_attention_variant(model: str, out_dir) -> str:
    """The fixture with the full-attention layers' output projection scaled up (same architecture otherwise)."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(model, out_dir, dirs_exist_ok=True)
    weights = load_file(out_dir / "model.safetensors")
    for name in weights:
        if name.startswith("model.layers.") and name.endswith("self_attn.o_proj.weight"):
            weights[name] = (weights[name].float() * STRONG_ATTENTION).to(weights[name].dtype)
    save_file(weights, out_dir / "model.safetensors", metadata={"format": "pt"})
    return str(out_dir)


@contextlib.contextmanager
def drafts_at_start(path):
    """The drafts file that the drafter of an engine started within reads first."""
    previous = os.environ.get(DRAFTS_ENV)
    os.environ[DRAFTS_ENV] = str(path)
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(DRAFTS_ENV, None)
        else:
            os.environ[DRAFTS_ENV] = previous


@contextlib.contextmanager
def planted(bug: str | None):
    """A wiring bug: tree tokens keep vLLM's index positions, or the accepted path's K/V is not compacted."""
    if bug is None:
        yield
        return
    module, name, replacement = {
        "no_depth_positions": (tree_runner, "override_positions", lambda positions, step: None),
        "no_kv_compaction": (tree_sampler, "commit_accepted_path", lambda step, acceptance: None),
    }[bug]
    original = getattr(module, name)
    setattr(module, name, replacement)
    try:
        yield
    finally:
        setattr(module, name, original)


@contextlib.contextmanager
def recording_tree_logits(steps: list):
    """Each tree step's target logits at the tree rows' verified blocks, `[R, 1 + N, vocab]`."""
    original = tree_runner.sample_with_trees

    def recording(logits, spec_decode_metadata, step, *args):
        num_sampled = torch.tensor(spec_decode_metadata.num_draft_tokens) + 1
        ends = torch.cumsum(num_sampled, 0)[step.request_indices.cpu()]
        rows = (ends - step.block_len)[:, None] + torch.arange(step.block_len)
        steps.append(logits[rows].float().clone())
        return original(logits, spec_decode_metadata, step, *args)

    tree_runner.sample_with_trees = recording
    try:
        yield
    finally:
        tree_runner.sample_with_trees = original


@dataclass
class TreeRuns:
    runs: dict = field(default_factory=dict)  # name -> GenerationRun
    tree_fallbacks: dict = field(default_factory=dict)  # name -> requests that decoded without their tree
    verdicts: dict = field(default_factory=dict)  # name -> EquivalenceVerdict
    mixed_batches: dict = field(default_factory=dict)  # name -> GDN batch counts
    tree_logits: dict = field(default_factory=dict)  # name -> list of per-step logits
    reference: dict = field(default_factory=dict)  # (model, workload) -> reference outputs


def _name(widths) -> str:
    return "x".join(map(str, widths))


@pytest.fixture(scope="module")
def tree_e2e(fixture_model, tmp_path_factory) -> TreeRuns:
    tmp = tmp_path_factory.mktemp("tree-wiring")
    models = {"fixture": fixture_model, "strong": strong_attention_variant(fixture_model, tmp / "strong-attention")}
    prompts = fixture_prompts(AutoTokenizer.from_pretrained(fixture_model), NUM_CORPUS_PROMPTS)
    tokens = [t for p in prompts for t in p]
    workloads = {
        "standard": (prompts[:NUM_PROMPTS], [16 + (i * 5) % 9 for i in range(NUM_PROMPTS)]),
        "single": (prompts[3:4], [24]),
        # 3-token prompts that prefill in one step and then all decode together
        "short": ([prompts[i] for i in (0, 8, 16, 24)], [20, 18, 21, 19]),
    }
    # name -> (model, workload, widths, true branch, perturbed branch, planted bug, engine kwargs)
    plan = {f"tree-{_name(w)}": ("fixture", "standard", w, TRUE_BRANCH, None, None, {}) for w in WIDTHS}
    plan["strong-2x2x1"] = ("strong", "standard", [2, 2, 1], TRUE_BRANCH, None, None, {})
    plan.update({bug: ("strong", "standard", [2, 2, 1], TRUE_BRANCH, None, bug, {}) for bug in PLANTED_BUGS})
    for widths in ([3, 2, 2], [4, 2]):  # the true path on the last child of every level
        plan[f"last-branch-{_name(widths)}"] = ("fixture", "single", widths, max(widths), None, None, {})
    # A token budget that fits two whole [3, 2, 2] trees (22 tokens each) per step: the third request falls back.
    plan["budget-3x2x2"] = ("fixture", "short", [3, 2, 2], TRUE_BRANCH, None, None,
                            dict(max_num_batched_tokens=BUDGET_TOKENS))
    for widths in STORE_ALL_WIDTHS:
        plan[f"store_all-{_name(widths)}"] = ("fixture", "standard", widths, TRUE_BRANCH, None, None,
                                              dict(mamba_state_commit="store_all"))
    plan["store_all-last-branch-3x2x2"] = ("fixture", "single", [3, 2, 2], 3, None, None,
                                           dict(mamba_state_commit="store_all"))
    plan["siblings"] = ("fixture", "single", SIBLING_WIDTHS, SIBLING_TRUE, None, None, {})
    plan["siblings-perturbed"] = ("fixture", "single", SIBLING_WIDTHS, SIBLING_TRUE, SIBLING_PERTURBED, None, {})

    results = TreeRuns()
    _generate_references(results, "fixture", fixture_model, workloads)
    _generate_references(results, "strong", models["strong"], {"standard": workloads["standard"]})
    _run_trees(results, plan, models, workloads, tmp)

    # Preemption: the attention block size grows with the tree (the GDN page holds 1 + N buffer rows), so the long
    # prompts are cut for the block size vLLM chose for each width in the runs above.
    preemption_plan = {}
    for widths in WIDTHS:
        block_size = results.runs[f"tree-{_name(widths)}"].kv_cache.attention_block_size
        workload = f"long-{block_size}"
        workloads[workload] = (prompts_before_a_block_boundary(tokens, block_size),
                               [PREEMPTION_MAX_TOKENS] * PREEMPTION_PROMPTS)
        preemption_plan[f"preempted-{_name(widths)}"] = ("fixture", workload, widths, TRUE_BRANCH, None, None, dict(
            num_gpu_blocks_override=PREEMPTION_NUM_BLOCKS, max_num_seqs=PREEMPTION_PROMPTS))
    long_workloads = {w: workloads[w] for w in {run[1] for run in preemption_plan.values()}}
    _generate_references(results, "fixture", fixture_model, long_workloads)
    _run_trees(results, preemption_plan, models, workloads, tmp)
    plan.update(preemption_plan)

    for model in models:
        runs_of_model = {name: workloads[run[1]] for name, run in plan.items() if run[0] == model}
        _judge(results, model, models[model], runs_of_model, {name: run[1] for name, run in plan.items()})
    return results


def _run_trees(results: TreeRuns, plan: dict, models: dict, workloads: dict, tmp) -> None:
    """One engine per configuration (model, widths, engine kwargs), running its runs in the plan's order (a planted
    bug's after the real wiring's: nothing a bug leaves behind reaches a run that must pass)."""
    engines = {}
    for name, (model, _, widths, _, _, _, kwargs) in plan.items():
        engines.setdefault(json.dumps([model, widths, kwargs], sort_keys=True), []).append(name)
    for names in engines.values():
        _run_on_one_engine(results, {name: plan[name] for name in names}, models, workloads, tmp)


def _run_on_one_engine(results: TreeRuns, plan: dict, models: dict, workloads: dict, tmp) -> None:
    drafts = {}
    for name, (model, workload, _, branch, perturbed, _, _) in plan.items():
        sequences = [p + r for p, r in zip(workloads[workload][0], results.reference[model, workload])]
        drafts[name] = write_drafts_file(tmp / f"{name}.json", sequences, branch, perturbed)
    model, _, widths, _, _, _, kwargs = next(iter(plan.values()))
    kwargs = dict(kwargs)
    commit = kwargs.pop("mamba_state_commit", "reconstruct")
    with drafts_at_start(next(iter(drafts.values()))), engine(models[model], speculative_config=tree_spec(
            widths, commit), **{"max_num_seqs": MAX_NUM_SEQS, **kwargs}) as llm:
        for name, (_, workload, _, _, _, bug, _) in plan.items():
            serve_drafts(llm, drafts[name])
            logits, fallbacks = results.tree_logits.setdefault(name, []), _tree_fallbacks()
            with (planted(bug), count_mixed_batches(results.mixed_batches.setdefault(name, {})),
                  recording_tree_logits(logits)):
                results.runs[name] = generate_run(llm, *workloads[workload])
            results.tree_fallbacks[name] = _tree_fallbacks() - fallbacks


def _tree_fallbacks() -> float:
    """The counter of the engine running (an engine's start drops the previous engine's), over its labels."""
    return sum(sample.value for metric in prometheus_client.REGISTRY.collect() if metric.name == FALLBACK_METRIC
               for sample in metric.samples if sample.name == f"{FALLBACK_METRIC}_total")


# Engines live in functions: a variable still holding a closed engine would keep its memory (weights, KV cache).
def _generate_references(results: TreeRuns, model: str, path: str, workloads: dict) -> None:
    with engine(path, max_num_seqs=MAX_NUM_SEQS) as reference:
        for workload, (prompts, max_tokens) in workloads.items():
            results.reference[model, workload] = generate_greedy(reference, prompts,
                                                                 [n + LOOKAHEAD for n in max_tokens])


def _judge(results: TreeRuns, model: str, path: str, run_workloads: dict, workload_names: dict) -> None:
    exact = ExactModel(path)
    with engine(path, logprobs_mode="raw_logits", max_num_seqs=MAX_NUM_SEQS) as reference:
        for name, (prompts, max_tokens) in run_workloads.items():
            expected = [r[:n] for r, n in zip(results.reference[model, workload_names[name]], max_tokens)]
            results.verdicts[name] = compare_tie_aware(reference, prompts, expected, results.runs[name].outputs,
                                                       exact.next_token_logits)


def test_no_state_is_kept_on_vllms_objects(tree_e2e):
    """Every tree engine here (reconstruct and store_all trees, preempted, planted, over the token budget): nothing
    added to vLLM's runner, metadata builders or scheduler (`GenerationRun.added_attributes`)."""
    assert {name: run.added_attributes for name, run in tree_e2e.runs.items() if run.added_attributes} == {}


@pytest.mark.parametrize("widths", WIDTHS, ids=_name)
def test_tree_is_equivalent_to_no_speculation(tree_e2e, widths):
    name = f"tree-{_name(widths)}"
    verdict = tree_e2e.verdicts[name]
    assert verdict.passed, verdict.summary()
    acceptance = tree_e2e.runs[name].acceptance
    depth = len(widths)
    # vLLM counts N drafts per step; the accepted ones sit at the first `depth` positions (the path's length).
    assert acceptance.num_draft_tokens == acceptance.num_drafts * DraftTree.from_widths(widths).num_nodes
    assert acceptance.accepted_per_position[depth - 1] > 0
    assert not any(acceptance.accepted_per_position[depth:])
    assert tree_e2e.mixed_batches[name]["mixed_batches"] > 0, "no batch mixed prefills with tree verifies"


@pytest.mark.parametrize("widths", WIDTHS, ids=_name)
def test_tree_survives_preemption(tree_e2e, widths):
    name = f"preempted-{_name(widths)}"
    assert tree_e2e.runs[name].num_preemptions > 0, "the workload did not preempt any request"
    assert tree_e2e.verdicts[name].passed, tree_e2e.verdicts[name].summary()


def test_a_tree_that_does_not_fit_the_token_budget_decodes_without_speculation(tree_e2e):
    name = "budget-3x2x2"
    assert tree_e2e.tree_fallbacks[name] > 0, "no request was left without room for its whole tree"
    assert tree_e2e.verdicts[name].passed, tree_e2e.verdicts[name].summary()
    assert tree_e2e.runs[name].acceptance.accepted_per_position[2] > 0  # the others still verify whole trees
    assert all(tree_e2e.tree_fallbacks[f"tree-{_name(w)}"] == 0 for w in WIDTHS)


def test_planted_attention_bugs_fail_where_the_wiring_passes(tree_e2e):
    """On the strong-attention variant the real wiring passes and each attention-side bug diverges beyond ties:
    the equivalence check above can see these bugs where attention matters."""
    assert tree_e2e.verdicts["strong-2x2x1"].passed, tree_e2e.verdicts["strong-2x2x1"].summary()
    for bug in PLANTED_BUGS:
        assert not tree_e2e.verdicts[bug].passed, f"{bug}: {tree_e2e.verdicts[bug].summary()}"


@pytest.mark.parametrize("widths", ([3, 2, 2], [4, 2]), ids=_name)
def test_true_path_on_the_last_branch_is_accepted_whole(tree_e2e, widths):
    """The drafter knows every step's true continuation, on the last child at every level: every verify accepts
    the whole depth, and each step gains depth + 1 tokens."""
    name = f"last-branch-{_name(widths)}"
    run, depth = tree_e2e.runs[name], len(widths)
    assert tree_e2e.verdicts[name].passed and not tree_e2e.verdicts[name].divergences
    acceptance = run.acceptance
    assert acceptance.num_drafts > 0
    assert acceptance.accepted_per_position[:depth] == [acceptance.num_drafts] * depth
    assert acceptance.num_accepted_tokens == depth * acceptance.num_drafts


def test_sibling_isolation(tree_e2e):
    """Other tokens on one branch of the tree change that branch's logits only: every other node's (and the root's)
    logits stay as they were, in every step."""
    tree = DraftTree.from_widths(SIBLING_WIDTHS)
    subtree = {SIBLING_PERTURBED}
    for node, parent in enumerate(tree.parents):
        if parent in subtree:
            subtree.add(node)
    block_rows = torch.tensor([False] + [node in subtree for node in range(tree.num_nodes)])  # root, then nodes
    plain, perturbed = tree_e2e.tree_logits["siblings"], tree_e2e.tree_logits["siblings-perturbed"]
    assert tree_e2e.runs["siblings"].outputs == tree_e2e.runs["siblings-perturbed"].outputs
    assert len(plain) == len(perturbed) > 0
    branch_changed = False
    for step, (a, b) in enumerate(zip(plain, perturbed)):
        assert torch.equal(a[:, ~block_rows], b[:, ~block_rows]), f"step {step}: a branch's tokens leaked elsewhere"
        branch_changed |= not torch.equal(a[:, block_rows], b[:, block_rows])
    assert branch_changed, "the perturbed branch's own logits never changed: the check cannot see leaks"


@pytest.mark.parametrize("widths", WIDTHS, ids=_name)
def test_gdn_state_is_one_block_per_request(tree_e2e, fixture_model, widths):
    """vLLM's own KV-cache report: one GDN state block per request for every tree; its pseudo-value buffer holds
    1 + N rows (every verified node's factors)."""
    report = tree_e2e.runs[f"tree-{_name(widths)}"].kv_cache
    assert set(report.gdn_blocks_per_request) == {1}
    config = AutoConfig.from_pretrained(fixture_model)
    config = getattr(config, "text_config", config)
    num_nodes = DraftTree.from_widths(widths).num_nodes
    layout = BufferLayout.of_model(1, config.linear_num_key_heads, config.linear_num_value_heads,
                                   config.linear_key_head_dim, config.linear_value_head_dim, num_nodes)
    assert layout.num_nodes == 1 + num_nodes
    per_layer = layout.num_nodes * (layout.factor_width * 4 + layout.conv_dim * 2) + 4  # fp32, bf16, count
    assert report.gdn_buffer_bytes_per_request == config.layer_types.count("linear_attention") * per_layer


@pytest.mark.parametrize("widths", STORE_ALL_WIDTHS, ids=_name)
def test_store_all_tree_keeps_a_state_block_per_node(tree_e2e, widths):
    """The baseline: each verified node's GDN state from its parent's, in its own block (1 + N per request in vLLM's
    report, against reconstruct's 1), the next step starting from the accepted node's; equivalent all the same."""
    name, num_nodes = f"store_all-{_name(widths)}", DraftTree.from_widths(widths).num_nodes
    verdict = tree_e2e.verdicts[name]
    assert verdict.passed, verdict.summary()
    store_all, reconstruct = tree_e2e.runs[name], tree_e2e.runs[f"tree-{_name(widths)}"]
    assert set(store_all.kv_cache.gdn_blocks_per_request) == {1 + num_nodes}
    assert set(reconstruct.kv_cache.gdn_blocks_per_request) == {1}
    assert store_all.kv_cache.max_concurrency < reconstruct.kv_cache.max_concurrency
    assert store_all.acceptance.accepted_per_position[len(widths) - 1] > 0


def test_store_all_tree_starts_from_the_accepted_branch(tree_e2e):
    """The true continuation on the last child of every level: only a step that starts from the accepted node's
    block (not vLLM's accepted count, which says how deep, not which branch) stays equivalent and accepts it all."""
    name, depth = "store_all-last-branch-3x2x2", 3
    assert tree_e2e.verdicts[name].passed and not tree_e2e.verdicts[name].divergences
    acceptance = tree_e2e.runs[name].acceptance
    assert acceptance.num_drafts > 0
    assert acceptance.accepted_per_position[:depth] == [acceptance.num_drafts] * depth
