"""Reconstruct chains on Model Runner V2, on vLLM's CPU backend (V2 forced on by `bench.host.v2_cpu`: every Triton
kernel interpreted): tie-aware against V2's own no-speculation engine. Run as a script in a process of its own (V2 is
chosen when vLLM is imported); prints one JSON line: per run the runner class, the verdict, the acceptance and the
batches that mixed prefills with speculative decodes.

    python -m tests.e2e.v2_chains_cpu MODEL_DIR

Runs: reconstruct k = 1 and k = 3 on the CPU path of the count update (its torch twin), k = 1 on its CUDA path (the
Triton kernel, interpreted). The workload (prompts of 3 to 150 tokens, a few running at once, different lengths) makes
later prompts prefill beside speculative decodes and take over the slots of finished requests.
"""

from __future__ import annotations

import json
import sys

from bench.host import v2_cpu

NUM_PROMPTS, MAX_NUM_SEQS = 10, 4
RUNS = {"reconstruct-k1": (1, False), "reconstruct-k3": (3, False), "reconstruct-k1-triton": (1, True)}


def main(model: str) -> dict:
    v2_cpu.force()
    from transformers import AutoTokenizer
    from vllm.v1.attention.backends.gdn_attn import GDNAttentionMetadataBuilder

    from vllm_treewy.fixture import fixture_prompts
    from vllm_treewy.fixture.exact import ExactModel
    from vllm_treewy.kernels.bookkeeping import dispatch
    from vllm_treewy.vllm_plugin.testing.equivalence import compare_tie_aware, engine, generate_greedy, run_greedy

    prompts = fixture_prompts(AutoTokenizer.from_pretrained(model), NUM_PROMPTS)
    max_tokens = [12 + (i * 5) % 11 for i in range(NUM_PROMPTS)]
    mixed = {}
    build = GDNAttentionMetadataBuilder.build

    def counting_build(self, *args, **kwargs):
        metadata = build(self, *args, **kwargs)
        if metadata.num_spec_decodes and metadata.num_prefills:
            mixed[current] = mixed.get(current, 0) + 1
        return metadata

    GDNAttentionMetadataBuilder.build = counting_build  # inside the adapter's wrapper: vLLM's own metadata
    import vllm_treewy.vllm_plugin as plugin

    plugin.register()
    v2_cpu.install_hooks()
    runs, launches_triton = {}, dispatch.launches_triton
    for current, (k, triton) in RUNS.items():
        dispatch.launches_triton = (lambda counts: True) if triton else launches_triton
        spec = {"method": "mtp", "num_speculative_tokens": k, "mamba_state_commit": "reconstruct"}
        runs[current] = run_greedy(model, prompts, max_tokens, speculative_config=spec, max_num_seqs=MAX_NUM_SEQS)
    dispatch.launches_triton = launches_triton
    exact = ExactModel(model)
    with engine(model, logprobs_mode="raw_logits", max_num_seqs=MAX_NUM_SEQS) as reference:
        v2 = reference.llm_engine.vllm_config.use_v2_model_runner
        outputs = generate_greedy(reference, prompts, max_tokens)
        verdicts = {name: compare_tie_aware(reference, prompts, outputs, run.outputs, exact.next_token_logits)
                    for name, run in runs.items()}
    return {"v2": v2, "runs": {name: {"passed": verdicts[name].passed, "summary": verdicts[name].summary(),
                                      "accepted": runs[name].acceptance.num_accepted_tokens,
                                      "mixed_batches": mixed.get(name, 0)} for name in runs}}


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1])))
