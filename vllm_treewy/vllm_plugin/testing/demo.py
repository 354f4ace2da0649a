"""`make demo`: builds the fixture model and runs vLLM on it without speculation and with MTP speculation.

1. MTP chains (k = 3) under both GDN state commit strategies, store_all (vLLM's) and reconstruct (ours): a few
   greedy continuations side by side and, per strategy, vLLM's acceptance per draft position, the GDN state bytes
   per request and the maximum concurrency from vLLM's KV-cache report, tokens/s, and the verdict of the tie-aware
   comparison against the no-speculation engine over all demo prompts.
2. The README's MTP draft tree (widths [2, 2, 1], reconstruct) beside the MTP chain of the same depth, on the
   fixture's blurred-head variant (its MTP head's top token is right about half the time, so second candidates
   matter): each one's mean acceptance length, its accepted drafts per verify at each depth, and its tie-aware
   verdict against the no-speculation engine of that model.
"""

from __future__ import annotations

import argparse
import tempfile
import time

from vllm_treewy.fixture import blurred_mtp_variant, build_fixture, fixture_prompts
from vllm_treewy.fixture.exact import ExactModel
from vllm_treewy.tree import DraftTree
from vllm_treewy.vllm_plugin.testing.equivalence import (
    GenerationRun,
    compare_tie_aware,
    engine,
    generate_greedy,
    kv_cache_report,
    mtp_tree_config,
    read_acceptance,
    run_greedy,
)

STRATEGIES = ("store_all", "reconstruct")
TREE_WIDTHS = [2, 2, 1]  # the README's tree command
FIXTURE_NOTE = (
    "The fixture's weights are constructed, not trained: its next token is a fixed permutation of the vocabulary,\n"
    "flipped at some positions by the GDN layers, so its continuations are not language. They are shown as token\n"
    "ids; what counts is whether each speculative run reproduces the run without speculation."
)
SHOWN_TOKENS = 12


def _token_ids(ids: list[int]) -> str:
    more = f" ... ({len(ids)} tokens)" if len(ids) > SHOWN_TOKENS else ""
    return " ".join(map(str, ids[:SHOWN_TOKENS])) + more


def _agreement(reference: list[int], ids: list[int]) -> str:
    diff = next((t for t, (a, b) in enumerate(zip(reference, ids)) if a != b), None)
    if diff is None and len(ids) == len(reference):
        return f"the same {len(ids)} tokens"
    if diff is None:
        return f"the same first {min(len(ids), len(reference))} tokens, then {len(ids)} vs {len(reference)} in all"
    return f"the same first {diff} tokens, then {_token_ids(ids[diff:])} (see the tie-aware comparison below)"


def _timed_run(model: str, prompts, max_tokens, **engine_kwargs) -> tuple[GenerationRun, float]:
    with engine(model, **engine_kwargs) as llm:
        generate_greedy(llm, prompts[:1], [4])  # warm-up outside the timing
        start = time.perf_counter()
        outputs = generate_greedy(llm, prompts, max_tokens)
        tokens_per_s = sum(map(len, outputs)) / (time.perf_counter() - start)
        return GenerationRun(outputs, read_acceptance(llm), kv_cache_report(llm)), tokens_per_s


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

    runs = {
        strategy: _timed_run(model, prompts, max_tokens, speculative_config={
            "method": "mtp", "num_speculative_tokens": k, "mamba_state_commit": strategy})
        for strategy in STRATEGIES
    }
    with engine(model, logprobs_mode="raw_logits") as reference_llm:
        generate_greedy(reference_llm, prompts[:1], [4])
        start = time.perf_counter()
        reference = generate_greedy(reference_llm, prompts, max_tokens)
        reference_tps = sum(map(len, reference)) / (time.perf_counter() - start)
        exact = ExactModel(model).next_token_logits
        verdicts = {
            s: compare_tie_aware(reference_llm, prompts, reference, runs[s][0].outputs, exact) for s in STRATEGIES
        }

    print(f"\nfixture model: {model}")
    print(FIXTURE_NOTE)
    for i in range(3):
        print(f"\nprompt {i} ({len(prompts[i])} tokens): {tokenizer.decode(prompts[i])!r}")
        print(f"  {'no speculation':<16}: {_token_ids(reference[i])}")
        for strategy in STRATEGIES:
            print(f"  {strategy + f' k={k}':<16}: {_agreement(reference[i], runs[strategy][0].outputs[i])}")
    print(f"\nno speculation: {reference_tps:.0f} tokens/s")
    for strategy in STRATEGIES:
        run, tps = runs[strategy]
        acc, kv = run.acceptance, run.kv_cache
        print(f"\nMTP k={k}, mamba_state_commit={strategy}:")
        print(f"  accepted {acc.num_accepted_tokens}/{acc.num_draft_tokens} drafted tokens "
              f"({acc.acceptance_rate:.1%}) over {acc.num_drafts} drafts; per draft position: "
              + ", ".join(f"{r:.1%}" for r in acc.per_position_rate))
        print(f"  GDN state per request: {kv.gdn_state_bytes_per_request / 2**10:.0f} KiB "
              f"({kv.gdn_blocks_per_request[0]} block(s) per GDN layer, of which "
              f"{kv.gdn_buffer_bytes_per_request / 2**10:.0f} KiB pseudo-value buffer)")
        print(f"  max concurrency (vLLM's KV-cache report, {kv.num_blocks} blocks): {kv.max_concurrency:.1f}x")
        print(f"  {tps:.0f} tokens/s (2-core CPU, eager; not a speed benchmark)")
        print(f"  tie-aware comparison over {len(prompts)} prompts: {verdicts[strategy].summary()}")
    tree_verdicts = _trees(model, prompts, max_tokens, len(TREE_WIDTHS))
    return 0 if all(v.passed for v in [*verdicts.values(), *tree_verdicts]) else 1


def _trees(model: str, prompts, max_tokens, depth: int) -> list:
    """Part 2: the MTP chain of `depth` and the README's tree, on the blurred-head variant of `model`."""
    blurred = str(blurred_mtp_variant(model, tempfile.mkdtemp(prefix="vllm-treewy-blurred-")))
    shapes = {f"MTP chain, k={depth}": [1] * depth, f"MTP tree {TREE_WIDTHS}": TREE_WIDTHS}
    runs = {name: run_greedy(blurred, prompts, max_tokens, speculative_config=mtp_tree_config(widths))
            for name, widths in shapes.items()}
    with engine(blurred, logprobs_mode="raw_logits") as reference_llm:
        reference = generate_greedy(reference_llm, prompts, max_tokens)
        exact = ExactModel(blurred).next_token_logits
        verdicts = {name: compare_tie_aware(reference_llm, prompts, reference, run.outputs, exact)
                    for name, run in runs.items()}

    print(f"\nDraft trees: mamba_state_commit=reconstruct, {len(prompts)} prompts, on the fixture's blurred-head "
          "variant\n(its MTP head's top token is right about half the time, so a second candidate per level can "
          "be accepted)")
    for name, run in runs.items():
        acc = run.acceptance
        per_depth = " / ".join(f"{r:.2f}" for r in acc.per_position_rate[:depth])
        print(f"\n{name}: mean acceptance length {acc.mean_acceptance_length:.2f} tokens per verify "
              f"({acc.num_drafts} verifies)")
        print(f"  accepted drafts per verify at depth {' / '.join(map(str, range(1, depth + 1)))}: {per_depth}")
        print(f"  tie-aware comparison over {len(prompts)} prompts: {verdicts[name].summary()}")
    chain, tree = (runs[name].acceptance.mean_acceptance_length for name in shapes)
    num_nodes = DraftTree.from_widths(TREE_WIDTHS).num_nodes
    print(f"\nThe tree emits {tree / chain:.2f}x the chain's tokens per verify, verifying 1 + {num_nodes} tokens per "
          f"request instead of 1 + {depth}\n(whether that is faster depends on the device: see "
          "draft_tree_max_batch_size in docs/user-guide.md)")
    return list(verdicts.values())


if __name__ == "__main__":
    raise SystemExit(main())
