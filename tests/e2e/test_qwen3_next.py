"""Qwen3-Next (`Qwen3NextForCausalLM`, its MTP head `Qwen3NextMTP`) on vLLM's CPU backend: reconstruct MTP chains
(k = 1 and 3) and an MTP tree ([2, 2, 1]) are tie-aware equivalent to no speculation on the project's Qwen3-Next
fixture, and its GDN layers (vLLM's `QwenGatedDeltaNetAttention` in Qwen3-Next's interleaved q/k/v/z and b/a
layout) verify through reconstruct, one GDN block per request.

The chains run on the fixture, the tree on its blurred-MTP variant (target unchanged, the head's top token right
about half the time), so that the tree accepts other branches than the first. Every engine keeps the GDN state in
fp32 (`mamba_ssm_cache_dtype`; Qwen3-Next configs have no `mamba_ssm_dtype`, see `vllm_treewy.fixture.qwen3_next`).
The engines run one after another in one module-scoped fixture; a raw-logits no-speculation engine generates the
references last and judges every run (a divergence counts only beyond one bf16 step, or where the fp64 fixture
does not prefer the reference's token).
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field

import pytest
from transformers import AutoConfig, AutoTokenizer

from vllm_treewy.fixture import blurred_mtp_variant, build_fixture, fixture_prompts
from vllm_treewy.fixture.exact import ExactModel
from vllm_treewy.tree import DraftTree
from vllm_treewy.vllm_plugin.gdn.layer import ReconstructGatedDeltaNetAttention
from vllm_treewy.vllm_plugin.gdn.pseudo_value_buffer import BufferLayout
from vllm_treewy.vllm_plugin.testing.equivalence import (
    bf16_step,
    compare_tie_aware,
    engine,
    generate_greedy,
    run_greedy,
)

pytestmark = pytest.mark.e2e

NUM_PROMPTS = 8
MAX_TOKENS = [16 + (i * 5) % 9 for i in range(NUM_PROMPTS)]  # requests finish at different steps
ENGINE = dict(max_num_seqs=4, mamba_ssm_cache_dtype="float32")  # prompts queue up and prefill beside decodes
RUNS = {  # name -> (model, speculative config)
    "chain-k1": ("fixture", {"method": "mtp", "num_speculative_tokens": 1, "mamba_state_commit": "reconstruct"}),
    "chain-k3": ("fixture", {"method": "mtp", "num_speculative_tokens": 3, "mamba_state_commit": "reconstruct"}),
    "tree-2x2x1": ("blurred", {"method": "mtp", "num_speculative_tokens": 3, "draft_tree_widths": [2, 2, 1],
                               "mamba_state_commit": "reconstruct"}),
}


# How far (in bf16 steps of its top logit) the fp64 model's best token may beat the no-speculation engine's greedy
# token: bf16 rounding (the fixture's worst position is 1.5 steps), not a model read differently. Checked on the
# first prompts (lengths 3 to 114) only: a forward of the fp64 model costs seconds on a CPU.
EXACT_TOLERANCE_BF16_STEPS, EXACT_PROMPTS = 2, 4


@dataclass
class Qwen3NextRuns:
    models: dict
    exact: ExactModel
    prompt_ids: list = field(default_factory=list)
    reference: list = field(default_factory=list)  # the no-speculation engine's greedy tokens
    runs: dict = field(default_factory=dict)  # name -> GenerationRun
    verdicts: dict = field(default_factory=dict)
    # name -> {(GDN layer name, its class, its interleaved layout flag): speculative steps it verified}
    gdn_steps: dict = field(default_factory=dict)


@pytest.fixture(scope="module")
def qwen3_next(tmp_path_factory) -> Qwen3NextRuns:
    model = build_fixture(tmp_path_factory.mktemp("qwen3-next-tiny"), architecture="qwen3_next")
    models = {"fixture": str(model), "blurred": str(blurred_mtp_variant(model, tmp_path_factory.mktemp("blurred")))}
    prompt_ids = fixture_prompts(AutoTokenizer.from_pretrained(models["fixture"]), NUM_PROMPTS)
    results = Qwen3NextRuns(models, ExactModel(models["fixture"]), prompt_ids)
    for name, (model_name, spec) in RUNS.items():
        steps = results.gdn_steps.setdefault(name, collections.Counter())
        with pytest.MonkeyPatch.context() as patch:
            original = ReconstructGatedDeltaNetAttention.speculative_step

            def counted(layer, metadata, *args, _steps=steps, _original=original):
                _steps[(layer.prefix, type(layer).__name__, layer.gqa_interleaved_layout)] += 1
                return _original(layer, metadata, *args)

            patch.setattr(ReconstructGatedDeltaNetAttention, "speculative_step", counted)
            results.runs[name] = run_greedy(models[model_name], prompt_ids, MAX_TOKENS, speculative_config=spec,
                                            **ENGINE)
    _judge(results)
    return results


# Engines live in functions: a variable still holding a closed engine would keep its memory (weights, KV cache).
def _judge(results: Qwen3NextRuns) -> None:
    model, prompt_ids = results.models["fixture"], results.prompt_ids
    with engine(model, logprobs_mode="raw_logits", **ENGINE) as reference:
        results.reference = generate_greedy(reference, prompt_ids, MAX_TOKENS)
        for name, run in results.runs.items():
            results.verdicts[name] = compare_tie_aware(reference, prompt_ids, results.reference, run.outputs,
                                                       results.exact.next_token_logits)


def _num_nodes(spec: dict) -> int:
    widths = spec.get("draft_tree_widths")
    return DraftTree.from_widths(widths).num_nodes if widths else spec["num_speculative_tokens"]


@pytest.mark.parametrize("name", RUNS)
def test_reconstruct_on_qwen3_next_is_equivalent_to_no_speculation(qwen3_next, name):
    verdict = qwen3_next.verdicts[name]
    assert verdict.passed, verdict.summary()
    spec = RUNS[name][1]
    acceptance = qwen3_next.runs[name].acceptance
    depth = spec["num_speculative_tokens"]
    assert acceptance.num_draft_tokens == acceptance.num_drafts * _num_nodes(spec)
    assert acceptance.accepted_per_position[depth - 1] > 0, "no step accepted a whole path"
    assert not any(acceptance.accepted_per_position[depth:])


@pytest.mark.parametrize("name", RUNS)
def test_qwen3_next_gdn_layers_verify_through_reconstruct(qwen3_next, name):
    """Every GDN layer of the model is the plugin's layer in Qwen3-Next's interleaved layout and verified drafts
    through reconstruct; vLLM's KV report holds one GDN block per request, with the pseudo-value buffer."""
    config = AutoConfig.from_pretrained(qwen3_next.models["fixture"])
    gdn_layers = {f"model.layers.{i}.linear_attn" for i, t in enumerate(config.layer_types) if t == "linear_attention"}
    steps = qwen3_next.gdn_steps[name]
    assert {prefix for prefix, _, _ in steps} == gdn_layers
    assert {(cls, interleaved) for _, cls, interleaved in steps} == {(ReconstructGatedDeltaNetAttention.__name__, True)}
    assert len(set(steps.values())) == 1, f"the GDN layers verified different numbers of steps: {steps}"

    report = qwen3_next.runs[name].kv_cache
    assert set(report.gdn_blocks_per_request) == {1}
    layout = BufferLayout.of_model(1, config.linear_num_key_heads, config.linear_num_value_heads,
                                   config.linear_key_head_dim, config.linear_value_head_dim, _num_nodes(RUNS[name][1]))
    per_layer = layout.num_nodes * (layout.factor_width * 4 + layout.conv_dim * 2) + 4  # fp32, bf16, count
    assert report.gdn_buffer_bytes_per_request == len(gdn_layers) * per_layer


def test_vllm_reads_the_fixture_as_transformers_does(qwen3_next):
    """vLLM's Qwen3-Next without speculation emits the fp64 transformers model's best token at every position (up to
    bf16 rounding): the fixture's config and checkpoint mean one model to both, so the exact model can judge."""
    strayed = []
    for i, (prompt, tokens) in enumerate(zip(qwen3_next.prompt_ids[:EXACT_PROMPTS], qwen3_next.reference)):
        logits = qwen3_next.exact.logits(prompt + tokens)[len(prompt) - 1 : -1]
        top = logits.max(dim=-1).values
        for t, token in enumerate(tokens):
            gap = float(top[t] - logits[t, token])
            if gap > EXACT_TOLERANCE_BF16_STEPS * bf16_step(float(top[t])):
                strayed.append((i, t, token, int(logits[t].argmax()), gap))
    assert not strayed, f"(prompt, token, vLLM's, fp64's best, gap): {strayed}"
