"""Draft trees from the fixture's own MTP head (`method: "mtp"` with `draft_tree_widths`) in vLLM's V1 runner on CPU.

The fixture's blurred-head variant (`blurred_mtp_variant`: target unchanged, the head's top token right about half
the time) is the model here: with it the trees accept other branches than the first often, as real heads make them.

Every engine of the equivalence checks runs in one module-scoped fixture: the MTP chain and trees (reconstruct),
then a raw-logits no-speculation engine generates the references and judges every run tie-aware (a divergence counts
only beyond one bf16 step, or where the fp64 fixture does not prefer the reference's token). The logprobs, penalties
and seeded-sampling checks share two engines of their own (a [2, 2, 1] tree and no speculation).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from transformers import AutoTokenizer

from tests.e2e.conftest import count_mixed_batches
from vllm_treewy.fixture import PREEMPTION_MAX_TOKENS, PREEMPTION_NUM_BLOCKS, PREEMPTION_PROMPTS, fixture_prompts
from vllm_treewy.fixture import blurred_mtp_variant, prompts_before_a_block_boundary
from vllm_treewy.fixture.exact import ExactModel
from vllm_treewy.tree import DraftTree
from vllm_treewy.vllm_plugin.testing.equivalence import (
    compare_tie_aware,
    engine,
    generate_greedy,
    generate_sampled,
    mtp_tree_config,
    run_greedy,
)

pytestmark = pytest.mark.e2e

WIDTHS = ([2, 1, 1], [2, 2, 1], [3, 2, 2], [4, 2], [4])  # [4]: a depth-1 tree (no drafting level)
CHAIN = [1, 1, 1]
PREEMPTED_WIDTHS = ([2, 2, 1], [3, 2, 2])
NUM_PROMPTS = 8
NUM_CORPUS_PROMPTS = 32
MAX_NUM_SEQS = 4  # prompts queue up and prefill beside speculative decodes
# Two requests' blocks, none spare: MTP's lookahead slots make requests cross their attention block early, so with the
# test drafter's spare block (PREEMPTION_NUM_BLOCKS) one request finishes before the other needs it.
MTP_PREEMPTION_NUM_BLOCKS = PREEMPTION_NUM_BLOCKS - 1


# [2, 2, 1]'s deepest drafting level forwards 1 + 6 tokens per request: 3 requests (21) overflow this budget, which
# holds a tree's verify (11) beside a request's last prefill chunk and a decode, so the levels draft in request chunks.
SMALL_BUDGET, SMALL_BUDGET_RUN = 16, "tree-2x2x1-budget-16"


def _name(widths) -> str:
    return "x".join(map(str, widths))


@dataclass
class MtpTreeRuns:
    runs: dict = field(default_factory=dict)  # name -> GenerationRun
    verdicts: dict = field(default_factory=dict)
    mixed_batches: dict = field(default_factory=dict)
    reference: dict = field(default_factory=dict)  # workload -> outputs


@pytest.fixture(scope="module")
def blurred_model(fixture_model, tmp_path_factory) -> str:
    return str(blurred_mtp_variant(fixture_model, tmp_path_factory.mktemp("blurred-mtp")))


@pytest.fixture(scope="module")
def mtp_trees(blurred_model) -> MtpTreeRuns:
    fixture_model = blurred_model
    prompts = fixture_prompts(AutoTokenizer.from_pretrained(fixture_model), NUM_CORPUS_PROMPTS)
    tokens = [t for p in prompts for t in p]
    workloads = {"standard": (prompts[:NUM_PROMPTS], [16 + (i * 5) % 9 for i in range(NUM_PROMPTS)])}
    plan = {f"tree-{_name(w)}": ("standard", w, {}) for w in (CHAIN, *WIDTHS)}
    plan[SMALL_BUDGET_RUN] = ("standard", [2, 2, 1], {"max_num_batched_tokens": SMALL_BUDGET})
    results = MtpTreeRuns()
    for name, (workload, widths, kwargs) in plan.items():
        prompt_ids, max_tokens = workloads[workload]
        with count_mixed_batches(results.mixed_batches.setdefault(name, {})):
            results.runs[name] = run_greedy(fixture_model, prompt_ids, max_tokens,
                                            speculative_config=mtp_tree_config(widths), max_num_seqs=MAX_NUM_SEQS,
                                            **kwargs)
    # Preemption: prompts that cross an attention block while decoding (the block size vLLM chose for the width) in
    # a KV cache too small for all of them.
    for widths in PREEMPTED_WIDTHS:
        block_size = results.runs[f"tree-{_name(widths)}"].kv_cache.attention_block_size
        workload = f"long-{block_size}"
        workloads[workload] = (prompts_before_a_block_boundary(tokens, block_size),
                               [PREEMPTION_MAX_TOKENS] * PREEMPTION_PROMPTS)
        name = f"preempted-{_name(widths)}"
        plan[name] = (workload, widths, {})
        results.runs[name] = run_greedy(fixture_model, *workloads[workload],
                                        speculative_config=mtp_tree_config(widths), num_gpu_blocks_override=MTP_PREEMPTION_NUM_BLOCKS, max_num_seqs=PREEMPTION_PROMPTS)
    _judge(results, fixture_model, workloads, plan)
    return results


# Engines live in functions: a variable still holding a closed engine would keep its memory (weights, KV cache).
def _judge(results: MtpTreeRuns, model: str, workloads: dict, plan: dict) -> None:
    """One no-speculation engine (raw logits: the mode changes what logprobs return, not the greedy tokens)
    generates the references, then re-scores every run's divergences from them."""
    exact = ExactModel(model)
    with engine(model, logprobs_mode="raw_logits", max_num_seqs=MAX_NUM_SEQS) as reference:
        for workload, (prompt_ids, max_tokens) in workloads.items():
            results.reference[workload] = generate_greedy(reference, prompt_ids, max_tokens)
        for name, (workload, _, _) in plan.items():
            prompt_ids, _ = workloads[workload]
            results.verdicts[name] = compare_tie_aware(reference, prompt_ids, results.reference[workload],
                                                       results.runs[name].outputs, exact.next_token_logits)


def mean_accepted(run) -> float:
    """Accepted drafts per speculative step (the bonus token not counted)."""
    return run.acceptance.num_accepted_tokens / run.acceptance.num_drafts


def test_no_state_is_kept_on_vllms_objects(mtp_trees):
    """The tree path's state across vLLM's calls is the drafter's `TreeRunState` and the GDN layers' own objects:
    nothing is added to vLLM's runner, metadata builders or scheduler in any tree engine, preempted ones included."""
    assert {name: run.added_attributes for name, run in mtp_trees.runs.items() if run.added_attributes} == {}


@pytest.mark.parametrize("widths", (CHAIN, *WIDTHS), ids=_name)
def test_mtp_tree_is_equivalent_to_no_speculation(mtp_trees, widths):
    name = f"tree-{_name(widths)}"
    verdict = mtp_trees.verdicts[name]
    assert verdict.passed, verdict.summary()
    acceptance = mtp_trees.runs[name].acceptance
    depth = len(widths)
    # vLLM counts N drafts per step; accepted ones sit at the first `depth` positions (the accepted path's length).
    assert acceptance.num_draft_tokens == acceptance.num_drafts * DraftTree.from_widths(widths).num_nodes
    assert acceptance.accepted_per_position[depth - 1] > 0
    assert not any(acceptance.accepted_per_position[depth:])
    assert mtp_trees.mixed_batches[name]["mixed_batches"] > 0, "no batch mixed prefills with tree verifies"
    assert set(mtp_trees.runs[name].kv_cache.gdn_blocks_per_request) == {1}


def test_tree_drafting_fits_a_small_token_budget(mtp_trees):
    """Requests that fall back to one token still draft their next tree: with more of them than the token budget's
    drafting levels hold, the levels draft in request chunks and the outputs stay no speculation's."""
    verdict = mtp_trees.verdicts[SMALL_BUDGET_RUN]
    assert verdict.passed, verdict.summary()
    assert mtp_trees.runs[SMALL_BUDGET_RUN].acceptance.num_drafts > 0


def test_token_budget_below_one_tree_is_refused_at_startup(blurred_model):
    """A budget that cannot hold one [2, 2, 1] verify (1 + 10 tokens) would never speculate: refused, with the reason."""
    with pytest.raises(Exception, match="cannot hold one tree's verify"):
        run_greedy(blurred_model, [[1, 2, 3]], 4, speculative_config=mtp_tree_config([2, 2, 1]),
                   max_num_batched_tokens=8, max_num_seqs=4)


def test_wider_trees_accept_more_at_equal_depth(mtp_trees):
    """The head's second and third choices are sometimes the target's: [1,1,1] < [2,1,1] < [2,2,1] in accepted drafts
    per step."""
    chain, two, wider = (mean_accepted(mtp_trees.runs[f"tree-{_name(w)}"]) for w in (CHAIN, [2, 1, 1], [2, 2, 1]))
    assert chain < two < wider, (chain, two, wider)


@pytest.mark.parametrize("widths", PREEMPTED_WIDTHS, ids=_name)
def test_mtp_tree_survives_preemption(mtp_trees, widths):
    name = f"preempted-{_name(widths)}"
    assert mtp_trees.runs[name].num_preemptions > 0, "the workload did not preempt any request"
    assert mtp_trees.verdicts[name].passed, mtp_trees.verdicts[name].summary()


PENALTIES = dict(repetition_penalty=1.3, presence_penalty=0.4, frequency_penalty=0.2)
NUM_LOGPROBS = 3
SEEDED_TOKENS = 24


def _outputs(llm, prompt_ids, **params):
    from vllm import SamplingParams

    outputs = llm.generate([{"prompt_token_ids": p} for p in prompt_ids],
                           SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, **params), use_tqdm=False)
    return [o.outputs[0] for o in outputs]


# Engines live in functions: a variable still holding a closed engine would keep its memory (weights, KV cache).
def _requests_of_one_engine(model: str, speculative_config, prompt_ids, seeded_prompt_ids) -> dict:
    """On one engine, one `generate` after another (each request's tokens depend on its own parameters and seed
    only): greedy with logprobs, greedy with penalties, and seeded sampling."""
    kwargs = {} if speculative_config is None else {"speculative_config": speculative_config}
    with engine(model, max_num_seqs=MAX_NUM_SEQS, **kwargs) as llm:
        return {"logprobs": _outputs(llm, prompt_ids, logprobs=NUM_LOGPROBS),
                "penalties": _outputs(llm, prompt_ids, **PENALTIES),
                "seeded": generate_sampled(llm, seeded_prompt_ids, [SEEDED_TOKENS] * len(seeded_prompt_ids), 0.8,
                                           top_p=0.95, first_seed=100)}


@pytest.fixture(scope="module")
def tree_and_plain_requests(blurred_model) -> dict:
    """(kind, engine) -> outputs: the [2, 2, 1] tree's and the no-speculation engine's greedy requests with logprobs
    and with penalties (4 prompts), and their seeded sampled requests (NUM_PROMPTS prompts)."""
    prompt_ids = fixture_prompts(AutoTokenizer.from_pretrained(blurred_model), NUM_PROMPTS)
    runs = {}
    for name, spec in (("tree", mtp_tree_config([2, 2, 1])), ("no-spec", None)):
        for kind, outputs in _requests_of_one_engine(blurred_model, spec, prompt_ids[:4], prompt_ids).items():
            runs[kind, name] = outputs
    return runs


def test_tree_logprobs_are_the_targets_at_each_emitted_token(tree_and_plain_requests):
    """Logprobs come back for every emitted token, as vLLM returns them for chains: each emitted token's logprob and
    the top ones equal the no-speculation engine's at the same context (bf16 logits computed in other batch shapes:
    within two bf16 steps of the fixture's logits, which stay below 16 in magnitude)."""
    for tree, plain in zip(tree_and_plain_requests["logprobs", "tree"],
                           tree_and_plain_requests["logprobs", "no-spec"]):
        assert len(tree.logprobs) == len(tree.token_ids)
        for position, (got, want, token) in enumerate(zip(tree.logprobs, plain.logprobs, tree.token_ids)):
            if list(tree.token_ids[:position + 1]) != list(plain.token_ids[:position + 1]):
                break  # a bf16 tie flipped: later contexts differ
            assert token in got and len(got) >= NUM_LOGPROBS
            assert got[token].logprob == pytest.approx(want[token].logprob, abs=0.125), (position, got, want)


def test_tree_applies_penalties_along_each_path(tree_and_plain_requests):
    """Repetition, presence and frequency penalties see the committed output plus the path walked so far: the tree's
    greedy tokens are the no-speculation engine's with the same penalties."""
    tree = [list(o.token_ids) for o in tree_and_plain_requests["penalties", "tree"]]
    plain = [list(o.token_ids) for o in tree_and_plain_requests["penalties", "no-spec"]]
    unpenalized = [list(o.token_ids) for o in tree_and_plain_requests["logprobs", "no-spec"]]
    assert plain != unpenalized, "the penalties change nothing here: the check cannot see them"
    assert tree == plain


def test_seeded_requests_draw_as_without_speculation(tree_and_plain_requests):
    """A seeded request's generator advances once per emitted token, as without speculation (a request that does
    not walk a level gets its generator's state back), so seeded outputs follow the no-speculation engine's until
    bf16 logits of other batch shapes tip a near-equal draw: long common prefixes (drawing at every level instead
    leaves a few tokens)."""
    tree, plain = tree_and_plain_requests["seeded", "tree"], tree_and_plain_requests["seeded", "no-spec"]
    common = [next((i for i, (a, b) in enumerate(zip(t, p)) if a != b), SEEDED_TOKENS) for t, p in zip(tree, plain)]
    assert sum(common) / len(common) >= 16, common
