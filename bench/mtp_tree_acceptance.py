"""Accepted drafts per verify of the MTP chain and trees of one depth on vLLM's CPU backend (the fixture's blurred-MTP
variant, reconstruct, greedy), and the acceptance per depth: what `tests/e2e/test_mtp_trees.py` holds in order.

    python3 bench/mtp_tree_acceptance.py --out bench/results/mtp_tree_acceptance_cpu/acceptance.json

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
    args = parser.parse_args()
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    import vllm
    from transformers import AutoTokenizer

    from vllm_treewy.fixture import blurred_mtp_variant, build_fixture, fixture_prompts
    from vllm_treewy.vllm_plugin.testing.equivalence import run_greedy

    tmp = Path(tempfile.mkdtemp(prefix="mtp-tree-acceptance-"))
    model = str(blurred_mtp_variant(build_fixture(tmp / "tiny"), tmp / "blurred"))
    prompts = fixture_prompts(AutoTokenizer.from_pretrained(model), NUM_PROMPTS)
    rows = {}
    for widths in WIDTHS:
        spec = {"method": "mtp", "num_speculative_tokens": len(widths), "draft_tree_widths": widths,
                "mamba_state_commit": "reconstruct"}
        acceptance = run_greedy(model, prompts, [MAX_TOKENS] * NUM_PROMPTS, speculative_config=spec,
                                max_num_seqs=MAX_NUM_SEQS).acceptance
        name = "x".join(map(str, widths))
        rows[name] = {"accepted_per_verify": acceptance.num_accepted_tokens / acceptance.num_drafts,
                      "per_depth_rate": acceptance.per_position_rate[: len(widths)], "verifies": acceptance.num_drafts}
        print(name, json.dumps(rows[name]), flush=True)
    result = {"command": " ".join([sys.executable, *sys.argv]), "vllm": vllm.__version__,
              "machine": platform.processor() or platform.machine(), "num_prompts": NUM_PROMPTS,
              "max_tokens": MAX_TOKENS, "max_num_seqs": MAX_NUM_SEQS, "runs": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
