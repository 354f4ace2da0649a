"""Device ops per engine step in the adapter's per-step count updates under reconstruct (vLLM's CPU backend).

Outside the CUDA graphs every eager torch op that touches tensor data is a kernel launch on CUDA, which costs the
host several microseconds; the GPU is mostly idle on small batches, so these launches set the step's pace. This
counts them on CPU in the two per-step updates: the GDN metadata builder's commit nodes and counts
(`step_metadata.with_commit_nodes`, once per KV-cache group of GDN layers) and the after-sampling accepted counts
(`accepted_counts.record_chain_accepted_counts`), in one engine (the fixture's `tiny` shape, MTP k = 3, eager)
generating `--max-tokens` greedy tokens for `--batch` prompts after a warm-up. Counted: every aten op that a torch
dispatch mode sees except views and allocations (no data touched, no launch), and each Triton launch as one.
`--triton` forces the one-launch kernels (the CUDA path), run by the interpreter: TRITON_INTERPRET=1.

    TRITON_INTERPRET=1 python bench/step_ops.py --batch 8 --max-tokens 64 [--triton]

An aten op may launch more than one CUDA kernel (an index put with a tensor index, say): the torch path's counts are
a lower bound on its launches.
"""

from __future__ import annotations

import argparse
import collections
import tempfile
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

NO_LAUNCH = {"empty", "empty_like", "empty_strided", "new_empty", "lift_fresh", "set_", "detach"}
HOST_SYNCS = {"_local_scalar_dense", "item"}


class StepOps(TorchDispatchMode):
    """Counts, per update, the aten ops that would launch device work (by name) while one of the counted updates
    runs, and each interpreted Triton launch once (with the mode off inside it: the interpreter's own tensor
    handling is not the kernel's)."""

    def __init__(self, updates):
        super().__init__()
        self.ops = {what: collections.Counter() for what in updates}
        self.calls = collections.Counter()
        self.current = None

    def counting(self, function, what: str):
        def counted(*args, **kwargs):
            self.calls[what] += 1
            self.current = self.ops[what]
            try:
                with self:
                    return function(*args, **kwargs)
            finally:
                self.current = None

        return counted

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if not (func.is_view or name in NO_LAUNCH):
            self.current["HOST SYNC " + name if name in HOST_SYNCS else name] += 1
        return func(*args, **(kwargs or {}))

    def count_triton_launches(self) -> None:
        from triton.runtime.interpreter import GridExecutor

        launch = GridExecutor.__call__
        step_ops = self

        def counted(self, *args, **kwargs):
            if step_ops.current is None:
                return launch(self, *args, **kwargs)
            step_ops.current["TRITON LAUNCH " + self.fn.__name__] += 1
            with torch.utils._python_dispatch._disable_current_modes():
                return launch(self, *args, **kwargs)

        GridExecutor.__call__ = counted


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--triton", action="store_true", help="force the one-launch kernels (interpreted)")
    args = parser.parse_args(argv)

    from transformers import AutoTokenizer

    import vllm_treewy.vllm_plugin as plugin
    from vllm_treewy.fixture import build_fixture, fixture_prompts
    from vllm_treewy.vllm_plugin import accepted_counts, step_metadata
    from vllm_treewy.vllm_plugin.equivalence import engine, generate_greedy

    plugin.register()
    if args.triton:
        from vllm_treewy.kernels.triton import slot_counts

        slot_counts.launches_triton = lambda counts: True
    model = str(build_fixture(Path(tempfile.mkdtemp()) / "fixture"))
    prompts = fixture_prompts(AutoTokenizer.from_pretrained(model), args.batch)
    spec = {"method": "mtp", "num_speculative_tokens": args.k, "mamba_state_commit": "reconstruct"}
    step_ops = StepOps(("GDN metadata build", "after sampling"))
    with engine(model, speculative_config=spec, max_num_seqs=args.batch) as llm:
        generate_greedy(llm, prompts, [8] * len(prompts))  # warm-up: one-off tables and compiles
        # the adapter's wrappers look both up at each call
        step_metadata.with_commit_nodes = step_ops.counting(step_metadata.with_commit_nodes, "GDN metadata build")
        accepted_counts.record_chain_accepted_counts = step_ops.counting(
            accepted_counts.record_chain_accepted_counts, "after sampling")
        if args.triton:
            step_ops.count_triton_launches()
        generate_greedy(llm, prompts, [args.max_tokens] * len(prompts))
    steps = step_ops.calls["after sampling"]  # once per engine step (every step of a hybrid with speculation)
    path = "Triton, interpreted" if args.triton else "torch"
    print(f"\ndevice ops per engine step in the adapter's count updates ({path} path); batch {args.batch}, "
          f"k {args.k}, {steps} steps")
    total = 0
    for what, ops in step_ops.ops.items():
        n, calls = sum(ops.values()), step_ops.calls[what]
        total += n
        print(f"{what:<24}{n / steps:6.1f} per step ({calls / steps:.1f} calls per step, {n / max(calls, 1):.1f} "
              "per call)")
        for name, count in ops.most_common():
            print(f"    {name:<40}{count / steps:6.1f}")
    print(f"{'both':<24}{total / steps:6.1f} per step")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
