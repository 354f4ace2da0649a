"""Time per launch of the speculative conv step (`conv_step_triton`: the previous step's commit, then this step's
conv over packed chains or trees) at Qwen3.5-27B's GDN conv (10,240 channels: q and k of 16 heads, v of 48 heads,
128 wide; window 4; bf16 inputs, history and weight; silu, no bias), beside an earlier version of the kernel.

Each row is a batch of requests with the same draft shape (a chain of k drafts, or a tree as widths, with its root)
in the state the engine leaves between steps: every slot committing a node of its previous step (the deepest node of
the first path), then convolving this step's nodes. A version whose signature takes `parents` gets the packed parents;
one that takes `ancestors` (an experiment's: this step's ancestor table, None for chains) gets the table. Launch
tiles as the adapter picks them (`block_nodes` = the node count up to 16, channels 256 a program).

    PYTHONPATH=$PWD python3 -m bench.kernels.conv_step_bench --out $OUT --baseline .scratch/conv_before.py

(`git show REF:vllm_treewy/kernels/conv_step_triton.py > .scratch/conv_before.py` first where git does not travel;
with git, `--baseline REF`.) Every row first checks each version's output, history and input rows against the torch
twin (`conv_step_packed`), then times it as the median over CUDA-graph replays of back-to-back launches
(`timing.graph_time_us`); each call restores the slot state it commits from, so every replay does the same work.
`--dry-run` (CPU, Triton interpreted, nothing timed) checks every row. Written: `OUT/NAME.json` (command, device
facts, rows).
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
from vllm_treewy.kernels.ancestor_table_torch import ancestor_table_torch  # noqa: E402
from vllm_treewy.kernels.conv_step_torch import conv_step_packed  # noqa: E402
from vllm_treewy.kernels.conv_step_triton import conv_step_triton  # noqa: E402
from vllm_treewy.tree import DraftTree, pack_trees  # noqa: E402

KERNEL_PATH = "vllm_treewy/kernels/conv_step_triton.py"
CHANNELS, WIDTH = 2 * 16 * 128 + 48 * 128, 4  # Qwen3.5-27B's GDN conv


def shape_tree(shape: str) -> DraftTree:
    """"k3" a chain of 3 drafts, "2,2,1" a tree's widths; with the root."""
    widths = [1] * int(shape[1:]) if shape.startswith("k") else [int(w) for w in shape.split(",")]
    return DraftTree.from_widths(widths).with_root()


def case(shape, batch, history_len, channels, device, seed=0):
    tree = shape_tree(shape)
    is_chain = shape.startswith("k")
    packed, one = pack_trees([tree] * batch), pack_trees([tree])
    generator = torch.Generator().manual_seed(seed)

    def normal(*size):
        return torch.randn(*size, generator=generator).to(torch.bfloat16).to(device)

    slots = torch.randperm(batch + 3, generator=generator)[:batch].to(torch.int32)
    deepest = max(range(tree.num_nodes), key=lambda node: (tree.depth[node], -node))
    inputs = dict(x=normal(packed.num_nodes, channels),
                  # vLLM's layout: [S, L, D] storage seen as [S, D, L]
                  conv_state=normal(batch + 3, history_len, channels).transpose(1, 2),
                  state_indices=slots.to(device), weight=(0.3 * normal(channels, WIDTH).float()).bfloat16(),
                  step_inputs=normal(batch + 3, tree.num_nodes, channels),
                  commit_nodes=torch.full((batch,), deepest, dtype=torch.int32, device=device))
    topology = dict(parents=packed.parents.to(device), cu_nodes=packed.cu_nodes.to(device),
                    ancestors=None if is_chain else ancestor_table_torch(packed.parents, packed.cu_nodes,
                                                                         packed.max_depth).to(device),
                    commit_ancestors=None if is_chain else ancestor_table_torch(one.parents, one.cu_nodes,
                                                                                one.max_depth).to(device))
    return inputs, topology, tree.num_nodes


def launcher(version, inputs, topology, num_nodes):
    """A call of `version` on fresh copies of the slot state: (call, its out, history and input rows)."""
    takes_parents = "parents" in inspect.signature(version).parameters
    conv_state, step_inputs = inputs["conv_state"].clone(), inputs["step_inputs"].clone()
    out = torch.empty_like(inputs["x"])
    block_nodes = min(16, 1 << (num_nodes - 1).bit_length())

    def call():
        conv_state.copy_(inputs["conv_state"])
        step_inputs.copy_(inputs["step_inputs"])
        version(inputs["x"], conv_state, inputs["state_indices"], inputs["weight"], None,
                topology["parents"] if takes_parents else topology["ancestors"], topology["cu_nodes"], step_inputs,
                inputs["commit_nodes"], commit_ancestors=topology["commit_ancestors"], activation="silu", out=out,
                block_nodes=block_nodes)
        return out, conv_state, step_inputs

    return call


def restore_only(inputs):
    """The copies each timed call makes, timed alone (subtracted from each version's time)."""
    conv_state, step_inputs = inputs["conv_state"].clone(), inputs["step_inputs"].clone()
    return lambda: (conv_state.copy_(inputs["conv_state"]), step_inputs.copy_(inputs["step_inputs"]))


def check(got, inputs, topology):
    conv_state, step_inputs = inputs["conv_state"].clone(), inputs["step_inputs"].clone()
    expected = conv_step_packed(inputs["x"], conv_state, inputs["state_indices"], inputs["weight"], None,
                                topology["parents"], topology["cu_nodes"], step_inputs, inputs["commit_nodes"],
                                commit_ancestors=topology["commit_ancestors"], activation="silu")
    out, history, rows = got
    # the kernel rounds each product to bf16 as vLLM's CUDA conv does, the twin keeps exact products
    error = float((out.float() - expected.float()).abs().max() / expected.float().abs().max())
    ok = error <= 2e-2 and torch.equal(history, conv_state) and torch.equal(rows, step_inputs)
    return dict(output_error=error, ok=ok)


def row(shape, batch, history_len, channels, versions, dry_run):
    device = "cpu" if dry_run else "cuda"
    inputs, topology, num_nodes = case(shape, batch, history_len, channels, device)
    record = dict(shape=shape, batch=batch, nodes=num_nodes * batch, channels=channels, history_len=history_len,
                  versions={})
    restore_us = None if dry_run else timing.graph_time_us([restore_only(inputs)])
    for name, version in versions.items():
        call = launcher(version, inputs, topology, num_nodes)
        result = check(call(), inputs, topology)
        if not dry_run:
            result["time_us"] = round(timing.graph_time_us([call]) - restore_us, 3)
        record["versions"][name] = result
    if restore_us is not None:
        record["restore_us"] = round(restore_us, 3)
    return timing.baseline_ratio(record)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "kernels"))
    parser.add_argument("--name", default="conv_step")
    parser.add_argument("--shapes", nargs="*", default=["k1", "k3", "2,2,1", "3,2,2,1"],
                        help="k<drafts> for a chain, widths for a tree")
    parser.add_argument("--batches", type=int, nargs="*", default=[1, 8, 64])
    parser.add_argument("--history-len", type=int, default=WIDTH - 1, help="the history's columns (at least w - 1)")
    parser.add_argument("--channels", type=int, default=CHANNELS, help="conv channels (default Qwen3.5-27B's)")
    parser.add_argument("--baseline", default=None, help="the earlier kernel: a file, or a commit git can show")
    parser.add_argument("--dry-run", action="store_true", help="CPU, interpreted: check every row, time nothing")
    args = parser.parse_args(argv)
    out, device, started = timing.start_run(args.dry_run, args.out)
    versions = {"current": conv_step_triton}
    if args.baseline:
        versions["baseline"] = timing.load_baseline(args.baseline, KERNEL_PATH, ROOT).conv_step_triton
    records = []

    def save():
        result = dict(command="python3 -m bench.kernels.conv_step_bench " + " ".join(
            sys.argv[1:] if argv is None else argv), device=device, baseline=args.baseline, dry_run=args.dry_run,
            seconds=round(time.time() - started, 1), rows=records)
        (out / f"{args.name}.json").write_text(json.dumps(result, indent=1))

    rows = (functools.partial(row, shape, batch, args.history_len, args.channels, versions, args.dry_run)
            for shape in args.shapes for batch in args.batches)
    with torch.inference_mode():
        failed = timing.collect_rows(rows, lambda record: all(r["ok"] for r in record["versions"].values()),
                                     records, save)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
