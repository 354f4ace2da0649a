"""`make demo`: builds the fixture model and runs vLLM on it with and without MTP speculation.

Prints a few greedy continuations side by side, vLLM's acceptance per draft position, and the verdict of the
tie-aware comparison against the no-speculation engine over all demo prompts.
"""

from __future__ import annotations

import argparse
import tempfile
import time

from vllm_treewy.fixture import build_fixture, fixture_prompts
from vllm_treewy.vllm_plugin.equivalence import (
    GenerationRun,
    compare_tie_aware,
    engine,
    generate_greedy,
    read_acceptance,
)


def _timed_run(model: str, prompts, max_tokens, **engine_kwargs) -> tuple[GenerationRun, float]:
    with engine(model, **engine_kwargs) as llm:
        generate_greedy(llm, prompts[:1], [4])  # warm-up outside the timing
        start = time.perf_counter()
        outputs = generate_greedy(llm, prompts, max_tokens)
        tokens_per_s = sum(map(len, outputs)) / (time.perf_counter() - start)
        return GenerationRun(outputs, read_acceptance(llm)), tokens_per_s


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model-dir", help="where to build the fixture (default: a temporary folder)")
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--num-speculative-tokens", type=int, default=3)
    args = parser.parse_args(argv)

    model = str(build_fixture(args.model_dir or tempfile.mkdtemp(prefix="vllm-treewy-fixture-")))
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    prompts = fixture_prompts(tokenizer, args.num_prompts)
    max_tokens = [args.max_tokens] * len(prompts)
    k = args.num_speculative_tokens

    spec, spec_tps = _timed_run(
        model, prompts, max_tokens, speculative_config={"method": "mtp", "num_speculative_tokens": k}
    )
    with engine(model, logprobs_mode="raw_logits") as reference_llm:
        generate_greedy(reference_llm, prompts[:1], [4])
        start = time.perf_counter()
        reference = generate_greedy(reference_llm, prompts, max_tokens)
        reference_tps = sum(map(len, reference)) / (time.perf_counter() - start)
        verdict = compare_tie_aware(reference_llm, prompts, reference, spec.outputs)

    print(f"\nfixture model: {model}")
    for i in range(3):
        print(f"\nprompt {i}: {tokenizer.decode(prompts[i])!r}")
        print(f"  no speculation : {tokenizer.decode(reference[i])!r}")
        print(f"  MTP k={k}        : {tokenizer.decode(spec.outputs[i])!r}")
    acc = spec.acceptance
    print(f"\nMTP k={k}: {acc.num_accepted_tokens}/{acc.num_draft_tokens} drafted tokens accepted "
          f"({acc.acceptance_rate:.1%}) over {acc.num_drafts} drafts")
    print("acceptance per draft position: " + ", ".join(
        f"pos {p + 1}: {r:.1%}" for p, r in enumerate(acc.per_position_rate)))
    print(f"tokens/s (2-core CPU, eager): no speculation {reference_tps:.0f}, MTP k={k} {spec_tps:.0f}")
    print(f"tie-aware comparison over {len(prompts)} prompts: {verdict.summary()}")
    return 0 if verdict.passed else 1


if __name__ == "__main__":
    raise SystemExit(main())
