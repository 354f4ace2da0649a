"""vLLM's KV-cache report for draft trees, reconstruct beside the store_all tree baseline, on the fixture (CPU).

One short greedy run per (widths, strategy), each engine in turn in this process: GDN blocks per request, the GDN
bytes per request at the pages vLLM allocates, the pseudo-value buffer's share, and vLLM's max concurrency.

    python3 bench/e2e/tree_memory.py --out bench/results/tree_memory_cpu --widths 2,2,1 3,2,2
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
STRATEGIES = ("store_all", "reconstruct")
DRAFTER = "vllm_treewy.vllm_plugin.testing.continuation_drafter.ContinuationTreeDrafter"


def main() -> int:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from transformers import AutoTokenizer

    from vllm_treewy.fixture import build_fixture, fixture_prompts
    from vllm_treewy.vllm_plugin.testing.continuation_drafter import DRAFTS_ENV, write_drafts_file
    from vllm_treewy.vllm_plugin.testing.equivalence import run_greedy

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--widths", nargs="+", default=["2,2,1", "3,2,2"])
    args = parser.parse_args()
    scratch = Path(tempfile.mkdtemp())
    model = str(build_fixture(scratch / "fixture"))
    prompt = fixture_prompts(AutoTokenizer.from_pretrained(model), 1)[0]
    # the drafts do not matter here: any tokens fill the tree
    os.environ[DRAFTS_ENV] = write_drafts_file(scratch / "drafts.json", [prompt + [1] * 40], 1)
    rows = []
    for text in args.widths:
        widths = [int(w) for w in text.split(",")]
        for strategy in STRATEGIES:
            spec = {"method": "custom_class", "model": DRAFTER, "num_speculative_tokens": len(widths),
                    "draft_tree_widths": widths, "mamba_state_commit": strategy}
            report = run_greedy(model, [prompt], [4], speculative_config=spec, max_num_seqs=4).kv_cache
            rows.append({"widths": widths, "strategy": strategy, **asdict(report)})
            print(json.dumps(rows[-1]), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    command = " ".join(["python3", "bench/e2e/tree_memory.py", *sys.argv[1:]])
    (out / "tree_memory.json").write_text(json.dumps({"command": command, "rows": rows}, indent=1))
    space = os.environ.get("VLLM_CPU_KVCACHE_SPACE", "unset: vLLM's default")
    lines = [f"Command: `{command}` (vLLM's CPU backend, the fixture, VLLM_CPU_KVCACHE_SPACE {space}).", "",
             "| widths | strategy | GDN blocks per request | GDN bytes per request | of which extra page states "
             "(reconstruct: the pseudo-value buffer; store_all tree: the slot counts) | max concurrency |",
             "|---|---|---|---|---|---|"]
    lines += [f"| {r['widths']} | {r['strategy']} | {r['gdn_blocks_per_request'][0]} | "
              f"{r['gdn_state_bytes_per_request']:,} | {r['gdn_buffer_bytes_per_request']:,} | "
              f"{r['max_concurrency']:.1f} |" for r in rows]
    (out / "README.md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
