"""A divergence at a small token budget, in store_all and reconstruct alike (README beside this).

    PATH=$VENV/bin:$PATH python bench/diagnostics/small_budget.py reconstruct 16 1

Eight fixture prompts (six short, two of 300 tokens that prefill in chunks), greedy, MTP with k drafts, at
`max_num_batched_tokens` = BUDGET, judged tie-aware against the no-speculation engine at vLLM's default budget.
Measured 2026-11-30 at budget 16: reconstruct k = 1 and 3 and store_all k = 1 diverge at prompt 2, token 11 by two
bf16 steps where the fp64 model prefers the reference's token by 0.076 (2.4 steps); store_all k = 3 at 16 and
reconstruct k = 3 at 24 pass.
"""

import os
import sys

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def main(strategy: str, budget: int, k: int) -> int:
    from transformers import AutoTokenizer

    from vllm_treewy.fixture import build_fixture, fixture_prompts
    from vllm_treewy.fixture.exact import ExactModel
    from vllm_treewy.vllm_plugin import register
    from vllm_treewy.vllm_plugin.testing.equivalence import compare_tie_aware, engine, generate_greedy

    register()
    model = str(build_fixture("/tmp/fixture-small-budget"))
    prompts = fixture_prompts(AutoTokenizer.from_pretrained(model), 32)
    tokens = [t for p in prompts for t in p]
    batch = prompts[:6] + [tokens[i * 50 : i * 50 + 300] for i in range(2)]
    max_tokens = [24] * 6 + [8, 8]
    spec = {"method": "mtp", "num_speculative_tokens": k, "mamba_state_commit": strategy}
    with engine(model, speculative_config=spec, max_num_seqs=8, max_num_batched_tokens=budget) as llm:
        outputs = generate_greedy(llm, batch, max_tokens)
    with engine(model, max_num_seqs=8, logprobs_mode="raw_logits") as reference:
        verdict = compare_tie_aware(reference, batch, generate_greedy(reference, batch, max_tokens), outputs,
                                    ExactModel(model).next_token_logits)
    print(f"{strategy} k={k} budget={budget}: {verdict.summary()}")
    return 0 if verdict.passed else 1


if __name__ == "__main__":
    strategy, budget, k = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]) if len(sys.argv) > 3 else 3
    raise SystemExit(main(strategy, budget, k))
