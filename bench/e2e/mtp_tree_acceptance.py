"""Accepted drafts per verify of the MTP chain and trees of one depth on vLLM's CPU backend (the fixture's blurred-MTP
variant, reconstruct), and the acceptance per depth: greedy, what `tests/e2e/test_mtp_trees.py` holds in order, or
sampled (`--temperature`, optional `--top-p`; one seed per prompt), where the exact tree sampler accepts a child with
the target's probability of its token (vLLM's rejection sampler the chain's greedy draft likewise).

    python3 bench/e2e/mtp_tree_acceptance.py --num-prompts 16 --max-tokens 48 --widths 1 2 4 8 1,1 4,2 1,1,1 2,2,1 \
        3,2,2 1,1,1,1 2,2,2,1 3,2,2,1 2,2,2,2 --out bench/results/mtp_tree_acceptance_cpu/greedy_by_depth.json
    python3 bench/e2e/mtp_tree_acceptance.py --temperature 1.0 --num-prompts 16 --max-tokens 48 \
        --widths 1,1,1 2,2,1 3,2,2 1,1 4,2 --out bench/results/mtp_tree_acceptance_cpu/sampled_t1.json

Acceptance only (CPU timings say nothing about a GPU's).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
from pathlib import Path

WIDTHS = ([1, 1, 1], [2, 1, 1], [2, 2, 1], [3, 2, 2])
NUM_PROMPTS, MAX_TOKENS, MAX_NUM_SEQS = 8, 24, 4


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--widths", nargs="+", type=lambda w: [int(x) for x in w.split(",")], default=list(WIDTHS),
                        help="draft tree widths per run, comma-separated (1,1,1 is the chain of depth 3)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--num-prompts", type=int, default=NUM_PROMPTS)
    parser.add_argument("--max-tokens", type=int, default=MAX_TOKENS)
    args = parser.parse_args()
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    import vllm
    from transformers import AutoTokenizer

    from vllm_treewy.fixture import blurred_mtp_variant, build_fixture, fixture_prompts
    from vllm_treewy.vllm_plugin.testing.equivalence import run_greedy

    tmp = Path(tempfile.mkdtemp(prefix="mtp-tree-acceptance-"))
    model = str(blurred_mtp_variant(build_fixture(tmp / "tiny"), tmp / "blurred"))
    prompts = fixture_prompts(AutoTokenizer.from_pretrained(model), args.num_prompts)
    rows = {}
    for widths in args.widths:
        spec = {"method": "mtp", "num_speculative_tokens": len(widths), "draft_tree_widths": widths,
                "mamba_state_commit": "reconstruct"}
        if args.temperature == 0:
            acceptance = run_greedy(model, prompts, [args.max_tokens] * args.num_prompts, speculative_config=spec,
                                    max_num_seqs=MAX_NUM_SEQS).acceptance
        else:
            acceptance = sampled_acceptance(model, prompts, args, speculative_config=spec, max_num_seqs=MAX_NUM_SEQS)
        name = "x".join(map(str, widths))
        rows[name] = {"accepted_per_verify": acceptance.num_accepted_tokens / acceptance.num_drafts,
                      "per_depth_rate": acceptance.per_position_rate[: len(widths)], "verifies": acceptance.num_drafts}
        print(name, json.dumps(rows[name]), flush=True)
    result = {"command": " ".join([sys.executable, *sys.argv]), "vllm": vllm.__version__,
              "machine": platform.processor() or platform.machine(), "num_prompts": args.num_prompts,
              "max_tokens": args.max_tokens, "max_num_seqs": MAX_NUM_SEQS, "temperature": args.temperature,
              "top_p": args.top_p, "runs": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return 0


def sampled_acceptance(model: str, prompts: list[list[int]], args, **engine_kwargs):
    """The spec-decode counters of one engine that samples `prompts` (`args`' temperature, top-p and length; request
    i seeded 1000 + i). A function of its own, as `run_greedy`: the engine must be gone before the next one starts
    (a caller's variable would keep it alive, and its teardown would then end the next engine's distributed state)."""
    from vllm_treewy.vllm_plugin.testing.equivalence import engine, generate_sampled, read_acceptance

    with engine(model, **engine_kwargs) as llm:
        generate_sampled(llm, prompts, [args.max_tokens] * len(prompts), args.temperature, args.top_p, first_seed=1000)
        return read_acceptance(llm)


if __name__ == "__main__":
    raise SystemExit(main())
