"""The batch size up to which a draft tree beats the chain of its depth, from one device call's tokens/s.

Input: a `gpu_v2_trees.json` written by `bench/e2e/run_gpu_v2_trees.sh` with bf16 trees and the bf16 chains of their
depths in the same call (`ENGINES="tree221-bf16 k3-bf16 ..."`): runs named `reconstruct-tree<widths>-bf16` and
`reconstruct-k<depth>-bf16`, each with `tokens_per_s` per batch size. For every tree, the threshold is the largest
measured batch size B such that at B and at every smaller measured size the tree's tokens/s is at least
(1 - margin) x the chain's; 0 when the tree loses already at the smallest size. Between two measured sizes nothing
is assumed: the threshold stays at the smaller one. That value is what `draft_tree_max_batch_size` takes.

Usage: python -m bench.e2e.tree_threshold RESULTS.json [--margin 0.0] [--out THRESHOLDS.json]
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

TREE_RUN = re.compile(r"^reconstruct-tree(\d+)-bf16$")


def chain_run_name(widths: str) -> str:
    return f"reconstruct-k{len(widths)}-bf16"


def threshold(tree_tokens_per_s: dict[int, float], chain_tokens_per_s: dict[int, float], margin: float) -> int:
    """Largest batch size of an unbroken prefix of measured sizes (both runs measured it) where the tree keeps at
    least (1 - margin) of the chain's tokens/s; 0 if none."""
    found = 0
    for batch in sorted(set(tree_tokens_per_s) & set(chain_tokens_per_s)):
        if tree_tokens_per_s[batch] < (1.0 - margin) * chain_tokens_per_s[batch]:
            break
        found = batch
    return found


def thresholds(report: dict, margin: float) -> dict[str, dict]:
    runs = report["runs"]
    found = {}
    for name, run in sorted(runs.items()):
        match = TREE_RUN.match(name)
        if match is None:
            continue
        widths = match.group(1)
        chain = runs.get(chain_run_name(widths))
        if chain is None:
            raise SystemExit(f"{name}: no chain of depth {len(widths)} ({chain_run_name(widths)}) in this call")
        tree_tps = {int(b): t for b, t in run["tokens_per_s"].items()}
        chain_tps = {int(b): t for b, t in chain["tokens_per_s"].items()}
        found[f"[{','.join(widths)}]"] = {
            "chain": chain_run_name(widths),
            "ratio_by_batch": {b: tree_tps[b] / chain_tps[b] for b in sorted(set(tree_tps) & set(chain_tps))},
            "draft_tree_max_batch_size": threshold(tree_tps, chain_tps, margin),
        }
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", type=Path)
    parser.add_argument("--margin", type=float, default=0.0,
                        help="fraction of the chain's tokens/s the tree may lose and still count (noise allowance)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    found = thresholds(json.loads(args.results.read_text()), args.margin)
    if not found:
        print(f"{args.results}: no bf16 tree runs", file=sys.stderr)
        return 1
    for shape, entry in found.items():
        ratios = " / ".join(f"B={b}: {r:.2f}x" for b, r in entry["ratio_by_batch"].items())
        print(f"{shape} vs {entry['chain']}: {ratios} -> draft_tree_max_batch_size {entry['draft_tree_max_batch_size']}")
    if args.out is not None:
        args.out.write_text(json.dumps({"results": str(args.results), "margin": args.margin, "trees": found},
                                       indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
