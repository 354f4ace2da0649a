"""Host time per call of the per-step slot count updates, torch ops vs one Triton launch
(`kernels.bookkeeping.slot_counts_*`).

Both run every engine step outside the CUDA graphs; on a mostly idle GPU their host time is the step's. A decode
batch of `--batch` speculative rows staged as for a FULL CUDA graph (vLLM's strided column of slots, strided
counts), `--groups` KV-cache groups of GDN layers: the builder's update once per group, the after-sampling update
once for all groups. The updates alone: the adapter's Python around them (the same on both paths) is not timed.
Each path is called `--calls` times back to back; the host time per call is the loop's wall time before the final
synchronize (the GPU keeps up with launches this small).

    python bench/host/count_updates_host_time.py --device cuda --batch 8 --groups 3

On CPU the torch path is vLLM's CPU backend's; the Triton path runs there only interpreted (TRITON_INTERPRET=1),
which times the interpreter, not a launch.
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from vllm_treewy.kernels.bookkeeping.slot_counts_torch import (
    commit_nodes_and_counts_torch,
    record_accepted_counts_torch,
)
from vllm_treewy.kernels.bookkeeping.slot_counts_triton import (
    commit_nodes_and_counts_triton,
    count_table,
    record_accepted_counts_triton,
)

NULL_BLOCK, K = 0, 3


def _step_tensors(batch: int, groups: int, device: str):
    # slot 0 is the null block, the batch's rows own slots 1..batch
    pages = torch.zeros(groups, batch + 1, 4, dtype=torch.int32, device=device)
    counts = [pages[g, :, 3] for g in range(groups)]  # strided, as in the KV cache's pages
    spec_state_indices = torch.zeros(batch, 1 + K, dtype=torch.int32, device=device)
    spec_state_indices[:, 0] = torch.arange(1, batch + 1, dtype=torch.int32)
    cu = torch.arange(0, (batch + 1) * (1 + K), 1 + K, dtype=torch.int32, device=device)
    staged = torch.full((2, batch), -1, dtype=torch.int32, device=device)
    block_tables = [spec_state_indices[:, :1].clone() for _ in range(groups)]
    draft_tokens = torch.full((batch,), K, dtype=torch.int32, device=device)
    accepted = torch.ones(batch, dtype=torch.int32, device=device)
    return counts, spec_state_indices[:, 0], cu, staged, block_tables, draft_tokens, accepted


def _host_us_per_call(step, calls: int, device: str) -> float:
    step()  # compile, allocate
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        step()
    host = time.perf_counter() - start
    if device == "cuda":
        torch.cuda.synchronize()
    return 1e6 * host / calls


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--groups", type=int, default=3)
    parser.add_argument("--calls", type=int, default=2000)
    args = parser.parse_args(argv)
    counts, batch_slots, cu, staged, block_tables, draft_tokens, accepted = _step_tensors(args.batch, args.groups,
                                                                                         args.device)
    groups = list(zip(counts, block_tables))
    table = count_table(groups)

    def builder(update):
        return lambda: [update(c, batch_slots, cu, staged[0], staged[1], None, NULL_BLOCK) for c in counts]

    paths = {"torch": (builder(commit_nodes_and_counts_torch),
                       lambda: record_accepted_counts_torch(groups, draft_tokens, accepted, args.batch))}
    if args.device == "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        paths["triton"] = (builder(commit_nodes_and_counts_triton),
                           lambda: record_accepted_counts_triton(table, draft_tokens, accepted, args.batch))
    print(f"host us per engine step ({args.device}, batch {args.batch}, {args.groups} GDN groups, {args.calls} calls)")
    print(f"{'path':<8}{'builder, all groups':>22}{'after sampling':>18}{'step':>10}")
    for name, (build, record) in paths.items():
        build_us = _host_us_per_call(build, args.calls, args.device)
        record_us = _host_us_per_call(record, args.calls, args.device)
        print(f"{name:<8}{build_us:>22.1f}{record_us:>18.1f}{build_us + record_us:>10.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
