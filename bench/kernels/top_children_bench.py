"""Time per call of a drafting level's top children (`top_children_triton`, the split-vocab kernel that
`vllm_plugin.trees.drafting.top_children` runs on CUDA) beside `torch.topk`, at Qwen3.5's vocab (248,320) on bf16
logits (the MTP head's `compute_logits` returns the model's dtype), for the rows the [2,2,1] and [3,2,2,1] trees'
drafting levels take at batches of B requests:

- the first pass (`sample_draft`): B rows, the root's top-w1;
- level l = 1 .. depth - 1 (`_draft_levels`): B x (nodes of depth l) rows, each node's top-w_{l+1}.

    PYTHONPATH=$PWD python3 -m bench.kernels.top_children_bench --out $OUT

`--dry-run` (CPU: the Triton interpreter, a small vocab past one chunk; nothing timed) checks every row and writes the
JSON: the plumbing check.

Method: every row first checks the kernel's ids against the torch twin's (`top_children_torch`: the same order,
ties to the lowest token id), then times the kernel and `torch.topk(width).indices` each as the median over CUDA-graph
replays of back-to-back calls (`timing.graph_time_us`). Logits: normal draws. Written: `OUT/NAME.json` (command,
device facts, rows, and per tree and batch the sum over a step's levels).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import pathlib
import sys
import time

import torch

if not torch.cuda.is_available():  # the dry run interprets the kernels; set before any Triton kernel is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.kernels import timing  # noqa: E402
from bench.kernels.timing import collect_rows, graph_time_us  # noqa: E402
from vllm_treewy.kernels.top_children_torch import top_children_torch  # noqa: E402
from vllm_treewy.kernels.top_children_triton import CHUNK, top_children_triton  # noqa: E402
from vllm_treewy.spec_decode.tree_drafting import nodes_below_depth  # noqa: E402

VOCAB = 248320  # Qwen3.5
DRY_RUN_VOCAB = CHUNK + 904  # two chunks, the last one partial: seconds interpreted
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def level_rows(widths: list[int], batch: int) -> list[tuple[str, int, int]]:
    """`(stage, rows, width)` of every top-children call of a step: the first pass's, then each drafting level's."""
    nodes_below = nodes_below_depth(widths)
    calls = [("first pass", batch, widths[0])]
    for level in range(1, len(widths)):
        calls.append((f"level {level}", batch * (nodes_below[level] - nodes_below[level - 1]), widths[level]))
    return calls


def row(widths, batch, stage, num_rows, width, vocab, dtype, dry_run, seed=0):
    device = "cpu" if dry_run else "cuda"
    generator = torch.Generator(device=device).manual_seed(seed)
    logits = torch.randn(num_rows, vocab, generator=generator, device=device).to(DTYPES[dtype])
    ids = top_children_triton(logits, width)
    record = dict(tree=widths, batch=batch, stage=stage, rows=num_rows, width=width, vocab=vocab, dtype=dtype,
                  ok=bool(torch.equal(ids, top_children_torch(logits, width))))
    if not dry_run:
        record["triton_us"] = round(graph_time_us([lambda: top_children_triton(logits, width)]), 3)
        record["topk_us"] = round(graph_time_us([lambda: logits.topk(width, dim=-1).indices.reshape(-1)]), 3)
        record["topk_over_triton"] = round(record["topk_us"] / record["triton_us"], 3)
    return record


def step_totals(records):
    """Per (tree, batch): the step's calls summed, for each timed version."""
    totals = {}
    for record in records:
        key = (tuple(record["tree"]), record["batch"])
        total = totals.setdefault(key, dict(tree=record["tree"], batch=record["batch"], calls=0))
        total["calls"] += 1
        for name in ("triton_us", "topk_us"):
            if name in record:
                total[name] = round(total.get(name, 0.0) + record[name], 3)
    return list(totals.values())


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "kernels"))
    parser.add_argument("--name", default="top_children")
    parser.add_argument("--trees", nargs="*", default=["2,2,1", "3,2,2,1"], help="draft trees as widths")
    parser.add_argument("--batches", type=int, nargs="*", default=[1, 8, 64], help="requests a step")
    parser.add_argument("--vocab", type=int, help=f"default {VOCAB} (Qwen3.5), {DRY_RUN_VOCAB} in a dry run")
    parser.add_argument("--dtype", choices=list(DTYPES), default="bf16", help="the logits' dtype")
    parser.add_argument("--dry-run", action="store_true", help="CPU, interpreted: check every row, time nothing")
    args = parser.parse_args(argv)
    out, device, started = timing.start_run(args.dry_run, args.out)
    vocab = args.vocab or (DRY_RUN_VOCAB if args.dry_run else VOCAB)
    records = []

    def save():
        result = dict(command="python3 -m bench.kernels.top_children_bench " + " ".join(
            sys.argv[1:] if argv is None else argv), device=device, vocab=vocab, dtype=args.dtype, chunk=CHUNK,
            dry_run=args.dry_run, seconds=round(time.time() - started, 1), rows=records, steps=step_totals(records))
        (out / f"{args.name}.json").write_text(json.dumps(result, indent=1))

    rows = (functools.partial(row, widths, batch, stage, num_rows, width, vocab, args.dtype, args.dry_run)
            for widths in ([int(w) for w in text.split(",")] for text in args.trees) for batch in args.batches
            for stage, num_rows, width in level_rows(widths, batch))
    with torch.inference_mode():
        failed = collect_rows(rows, lambda record: record["ok"], records, save)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
