"""Tensor parallelism on vLLM's CPU backend (TP = 2, one worker process per rank, threads bound to cores 0 and 1):
reconstruct MTP chains (k = 1 and 3) and an MTP tree are tie-aware equivalent to no speculation at TP = 2, with one
GDN block per request and each rank's pseudo-value buffer sized for its half of the GDN heads.

The engines run one after another in one module-scoped fixture; the no-speculation engine (raw logits) generates
the references last and judges every run. Worker processes end with their engine (`engine()` shuts it down).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from transformers import AutoConfig, AutoTokenizer

from vllm_treewy.fixture import fixture_prompts
from vllm_treewy.fixture.exact import ExactModel
from vllm_treewy.tree import DraftTree
from vllm_treewy.vllm_plugin.gdn.pseudo_value_buffer import BufferLayout
from vllm_treewy.vllm_plugin.testing.equivalence import compare_tie_aware, engine, generate_greedy, run_greedy

pytestmark = pytest.mark.e2e

TP = 2
NUM_PROMPTS, MAX_TOKENS = 6, 16
RUNS = {
    "chain-k1": {"method": "mtp", "num_speculative_tokens": 1, "mamba_state_commit": "reconstruct"},
    "chain-k3": {"method": "mtp", "num_speculative_tokens": 3, "mamba_state_commit": "reconstruct"},
    "tree-2x2x1": {"method": "mtp", "num_speculative_tokens": 3, "draft_tree_widths": [2, 2, 1],
                   "mamba_state_commit": "reconstruct"},
}
TP_ENGINE = dict(tensor_parallel_size=TP, distributed_executor_backend="mp", max_num_seqs=4)


@dataclass
class TensorParallelRuns:
    runs: dict = field(default_factory=dict)
    verdicts: dict = field(default_factory=dict)


@pytest.fixture(scope="module")
def tp_runs(fixture_model, tmp_path_factory) -> TensorParallelRuns:
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")  # one core per rank (vLLM refuses TP = 2 on one NUMA node)
        prompt_ids = fixture_prompts(AutoTokenizer.from_pretrained(fixture_model), NUM_PROMPTS)
        results = TensorParallelRuns()
        for name, spec in RUNS.items():
            results.runs[name] = run_greedy(fixture_model, prompt_ids, [MAX_TOKENS] * NUM_PROMPTS,
                                            speculative_config=spec, **TP_ENGINE)
        _judge(results, fixture_model, prompt_ids)
    return results


# Engines live in functions: a variable still holding a closed engine would keep its memory (weights, KV cache).
def _judge(results: TensorParallelRuns, model: str, prompt_ids) -> None:
    exact = ExactModel(model)
    with engine(model, logprobs_mode="raw_logits", **TP_ENGINE) as reference:
        expected = generate_greedy(reference, prompt_ids, [MAX_TOKENS] * NUM_PROMPTS)
        for name, run in results.runs.items():
            results.verdicts[name] = compare_tie_aware(reference, prompt_ids, expected, run.outputs,
                                                       exact.next_token_logits)


@pytest.mark.parametrize("name", RUNS)
def test_reconstruct_at_tp2_is_equivalent_to_no_speculation(tp_runs, name):
    verdict = tp_runs.verdicts[name]
    assert verdict.passed, verdict.summary()
    assert tp_runs.runs[name].acceptance.num_accepted_tokens > 0


@pytest.mark.parametrize("name", RUNS)
def test_each_rank_holds_one_gdn_block_and_a_buffer_for_its_heads(tp_runs, fixture_model, name):
    report = tp_runs.runs[name].kv_cache
    assert set(report.gdn_blocks_per_request) == {1}
    config = AutoConfig.from_pretrained(fixture_model)
    config = getattr(config, "text_config", config)
    spec = RUNS[name]
    widths = spec.get("draft_tree_widths")
    num_nodes = DraftTree.from_widths(widths).num_nodes if widths else spec["num_speculative_tokens"]
    layout = BufferLayout.of_model(TP, config.linear_num_key_heads, config.linear_num_value_heads,
                                   config.linear_key_head_dim, config.linear_value_head_dim, num_nodes)
    per_layer = layout.num_nodes * (layout.factor_width * 4 + layout.conv_dim * 2) + 4  # fp32, bf16, count
    assert report.gdn_buffer_bytes_per_request == config.layer_types.count("linear_attention") * per_layer
