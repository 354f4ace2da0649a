"""Time per launch of two-pass tree attention's ancestor pass with the merge folded in
(`tree_attention_ancestors_triton`: prefix output and log-sum-exp in, merged rows written into the output) at
Qwen3.5-27B's full-attention shape (24 query heads over 4 KV heads, head size 256, bf16), for draft trees at batches
of verified blocks, beside an earlier version of the kernel (the package keeps one production path, so the earlier one
comes from git or from a file holding its source).

What is compared: "current" is the fused launch. "baseline" is the earlier version's work for the same result: an
earlier fused kernel (its signature takes `prefix_output`) alone; an earlier unfused one (the ancestors alone,
returning output and log-sum-exp; the default, `BASELINE`) followed by vLLM's `merge_attn_states` (the launch the
fusion removes; vLLM's CUDA op on the GPU, its torch path on the dry run) where vLLM imports, else that kernel alone
(then the row compares less work than the fused launch does). The unfused path's masked copy of the merged rows into
the output (four small launches) is not in the baseline's time. Each version's `launches` in the JSON says which.

On the GPU machine, where git does not travel, write the earlier version here first (`.scratch/` is git-ignored: name
the file in the device call's carry):

    mkdir -p .scratch && git show 3df28a9:vllm_treewy/kernels/tree_attention_ancestors_triton.py \\
        > .scratch/ancestors_before.py
    PYTHONPATH=$PWD python3 -m bench.kernels.tree_attention_ancestors_bench --out $OUT \\
        --baseline .scratch/ancestors_before.py

With git at hand `--baseline REF` reads the kernel at that commit (the default, `BASELINE`, is the last unfused
version: one program per (token, KV head), the merge left to vLLM). `--dry-run` (CPU: the Triton interpreter;
nothing timed) checks every version on every row and writes the JSON: the plumbing check.

Method: every row first checks each version's result against the torch twin (`tree_attention_ancestors_torch`; an
unfused baseline without a merge against the ancestor attention alone, `ancestor_attention`, output and log-sum-exp),
then times it as the median over CUDA-graph replays of back-to-back launches (`timing.graph_time_us`). Inputs as the
FLASH_ATTN hook sees them: query, key and value are views of one fused QKV row per token; every request of the batch
a verified block of the tree, with a committed prefix (the prefix pass's output and log-sum-exp random, finite).
Written: `OUT/NAME.json` (command, device facts, rows).
"""

from __future__ import annotations

import argparse
import functools
import inspect
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
from bench.kernels.timing import collect_rows  # noqa: E402
from vllm_treewy.kernels.tree_attention_ancestors_torch import (  # noqa: E402
    ancestor_attention,
    tree_attention_ancestors_torch,
)
from vllm_treewy.kernels.tree_attention_ancestors_triton import tree_attention_ancestors_triton  # noqa: E402
from vllm_treewy.tree import DraftTree  # noqa: E402
from vllm_treewy.vllm_plugin.trees.attention_flash import tree_block_ancestors  # noqa: E402

KERNEL_PATH = "vllm_treewy/kernels/tree_attention_ancestors_triton.py"
# the last unfused version (ancestors alone, output and log-sum-exp out; one program per (token, KV head))
BASELINE = "3df28a9"
HEADS, KV_HEADS, HEAD_SIZE = 24, 4, 256  # Qwen3.5-27B's full attention
TOLERANCE = {"output": 1.6e-2, "lse": 1e-4}  # bf16 output rounding (absolute and relative); fp32 log-sum-exp
FUSED, MERGED, ALONE = "fused", "ancestors + merge_attn_states", "ancestors alone"  # what a version's launch does


def load_baseline(source: str):
    """The earlier kernel's `tree_attention_ancestors_triton` (either signature: `launches_of`), from the file or
    commit `source` (`timing.load_baseline`)."""
    return timing.load_baseline(source, KERNEL_PATH, ROOT).tree_attention_ancestors_triton


def vllm_merge():
    """vLLM's `merge_attn_states`, or None where vLLM does not import."""
    try:
        from vllm.v1.attention.ops.merge_attn_states import merge_attn_states
    except ImportError:
        return None
    return merge_attn_states


def launches_of(version, merge) -> str:
    """What timing `version` launches: the fused kernel (its signature takes the prefix pass's output), or an
    unfused one followed by `merge` (vLLM's), or alone where there is no merge."""
    if "prefix_output" in inspect.signature(version).parameters:
        return FUSED
    return ALONE if merge is None else MERGED


def case(widths, batch, heads, kv_heads, head_size, device, seed=0):
    """`(inputs, tokens, ancestors width)` for `batch` verified blocks of the tree `widths` (root + N tokens each):
    inputs the fused launch's keywords but the output (`make_output` gives that), prefixes finite."""
    tree = DraftTree.from_widths(widths)
    table = tree_block_ancestors(tree, device)
    block_len = table.shape[0]
    tokens = batch * block_len
    generator = torch.Generator().manual_seed(seed)
    qkv = torch.randn(tokens, heads + 2 * kv_heads, head_size, generator=generator).to(torch.bfloat16).to(device)
    query, key, value = qkv[:, :heads], qkv[:, heads : heads + kv_heads], qkv[:, heads + kv_heads :]
    starts = (torch.arange(batch + 1, dtype=torch.int32) * block_len).to(device)
    prefix_output = torch.randn(tokens, heads, head_size, generator=generator).to(torch.bfloat16).to(device)
    prefix_lse = (torch.randn(heads, tokens, generator=generator) * 3 + 4).to(device)
    inputs = dict(query=query, key=key, value=value, query_start_loc=starts, block_ancestors=table,
                  prefix_output=prefix_output, prefix_lse=prefix_lse, scale=head_size**-0.5)
    return inputs, tokens, table.shape[1]


def make_output(inputs):
    return torch.empty_like(inputs["query"])


def launcher(version, launches, inputs, merge):
    """A call of `version` doing its `launches` on `inputs`; returns what the check compares (the merged output, or
    an unfused kernel's output and log-sum-exp)."""
    ancestors = {name: inputs[name] for name in ("query", "key", "value", "query_start_loc", "block_ancestors")}
    output = make_output(inputs)
    if launches == FUSED:
        return lambda: version(**inputs, output=output)
    if launches == ALONE:
        return lambda: version(*ancestors.values(), inputs["scale"])

    def unfused_then_merge():
        suffix_output, suffix_lse = version(*ancestors.values(), inputs["scale"])
        merge(output, inputs["prefix_output"], inputs["prefix_lse"], suffix_output, suffix_lse)
        return output

    return unfused_then_merge


def check(got, launches, inputs):
    args = [inputs[name] for name in ("query", "key", "value", "query_start_loc", "block_ancestors")]
    if launches == ALONE:
        expected_out, expected_lse = ancestor_attention(*args, inputs["scale"])
        out, lse = got
        lse_error = float((lse - expected_lse).abs().max())
        lse_ok = torch.allclose(lse, expected_lse, atol=TOLERANCE["lse"], rtol=TOLERANCE["lse"])
    else:
        expected_out = tree_attention_ancestors_torch(*args, inputs["prefix_output"], inputs["prefix_lse"],
                                                      make_output(inputs), inputs["scale"])
        out, lse_error, lse_ok = got, None, True
    ok = lse_ok and torch.allclose(out.float(), expected_out.float(), atol=TOLERANCE["output"],
                                   rtol=TOLERANCE["output"])
    return dict(output_error=float((out.float() - expected_out.float()).abs().max()), lse_error=lse_error, ok=ok)


def row(widths, batch, versions, shape, dry_run, merge):
    from bench.kernels.timing import graph_time_us

    device = "cpu" if dry_run else "cuda"
    inputs, tokens, width = case(widths, batch, *shape, device)
    record = dict(tree=widths, batch=batch, tokens=tokens, ancestors_width=width, heads=shape[0], kv_heads=shape[1],
                  head_size=shape[2], dtype="bf16", versions={})
    for name, version in versions.items():
        launches = launches_of(version, merge)
        call = launcher(version, launches, inputs, merge)
        result = dict(launches=launches, **check(call(), launches, inputs))
        if not dry_run:
            result["time_us"] = round(graph_time_us([call]), 3)
        record["versions"][name] = result
    return timing.baseline_ratio(record)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "kernels"))
    parser.add_argument("--name", default="tree_attention_ancestors")
    parser.add_argument("--trees", nargs="*", default=["2,2,1", "3,2,2,1"], help="draft trees as widths")
    parser.add_argument("--batches", type=int, nargs="*", default=[1, 8, 64], help="verified blocks a launch")
    parser.add_argument("--shape", type=int, nargs=3, default=[HEADS, KV_HEADS, HEAD_SIZE],
                        metavar=("HEADS", "KV_HEADS", "HEAD_SIZE"))
    parser.add_argument("--baseline", default=BASELINE, help="the earlier kernel: a file, or a commit git can show")
    parser.add_argument("--no-baseline", action="store_true", help="time the current kernel alone")
    parser.add_argument("--dry-run", action="store_true", help="CPU, interpreted: check every row, time nothing")
    args = parser.parse_args(argv)
    out, device, started = timing.start_run(args.dry_run, args.out)
    versions = {"current": tree_attention_ancestors_triton}
    if not args.no_baseline:
        versions["baseline"] = load_baseline(args.baseline)
    merge = vllm_merge()
    records = []

    def save():
        result = dict(command="python3 -m bench.kernels.tree_attention_ancestors_bench " + " ".join(
            sys.argv[1:] if argv is None else argv), device=device, baseline=None if args.no_baseline else
            args.baseline, dry_run=args.dry_run, seconds=round(time.time() - started, 1), rows=records)
        (out / f"{args.name}.json").write_text(json.dumps(result, indent=1))

    rows = (functools.partial(row, [int(w) for w in widths.split(",")], batch, versions, args.shape, args.dry_run,
                              merge)
            for widths in args.trees for batch in args.batches)
    with torch.inference_mode():
        failed = collect_rows(rows, lambda record: all(result["ok"] for result in record["versions"].values()),
                              records, save)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
