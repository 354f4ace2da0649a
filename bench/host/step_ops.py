"""Device ops per engine step on vLLM's CPU backend: in the adapter's per-step count updates, or in the whole step
outside the model forwards, by call site, for both GDN state commit strategies.

Outside the CUDA graphs every eager torch op that touches tensor data is a kernel launch on CUDA, which costs the
host several microseconds; the GPU is mostly idle on small batches, so these launches set the step's pace. One
engine (the fixture's `tiny` shape, MTP k = 3, eager) generates `--max-tokens` greedy tokens for `--batch` prompts
after a warm-up. Counted: every aten op that a torch dispatch mode sees except views and allocations (no data
touched, no launch), and each interpreted Triton launch as one (with the mode off inside it).

- default: inside the adapter's two per-step updates, under reconstruct: the GDN metadata builder's commit nodes and
  counts (`step_metadata.with_commit_nodes`, once per KV-cache group of GDN layers) and the after-sampling accepted
  counts (`accepted_counts.record_chain_accepted_counts`).
- `--whole-step`: everything the model runner runs per engine step (`execute_model` and `sample_tokens`) except the
  target model's and the MTP drafter's forwards (CUDA graphs on the GPU: counting is off inside them, and so are the
  GDN layers' own ops), for store_all and reconstruct with the same prompts; each op is attributed to its call site,
  the innermost frame in vllm/ or vllm_treewy/ (file:line function). The logits heads, the samplers and the
  drafter's input preparation are counted (eager on CUDA too); the scheduler and the front end are not (host work).

`--triton` forces the adapter's one-launch count kernels (the CUDA path), run by the interpreter: TRITON_INTERPRET=1.
`--whole-step --runner v2` counts Model Runner V2's steps instead (V2 forced on by `v2_cpu`, its Triton kernels
interpreted and counted as launches, as the adapter's are); the GPU's k = 1 comparison is `--k 1`.

    TRITON_INTERPRET=1 python bench/host/step_ops.py --batch 8 --max-tokens 64 [--triton] [--whole-step]
    python -m bench.host.step_ops --whole-step --runner v2 --triton --k 1 --batch 8 --max-tokens 16

An aten op may launch more than one CUDA kernel (an index put with a tensor index, say), and on CPU the runner's
"device" tensors are its host tensors (`CpuGpuBuffer.gpu` is `.cpu`), so an op that CUDA runs on a pinned host
tensor, or a host-to-device copy, counts here too: the counts say where device work can come from, not exactly how
many CUDA kernels it is.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import functools
import sys
import tempfile
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

NO_LAUNCH = {"empty", "empty_like", "empty_strided", "new_empty", "lift_fresh", "set_", "detach"}
HOST_SYNCS = {"_local_scalar_dense", "item"}
SITE_PACKAGES = ("vllm", "vllm_treewy")  # a call site is the innermost frame in one of these packages
UNKNOWN_SITE = "(no vllm or vllm_treewy frame)"


def op_name(func) -> str | None:
    """The name an aten op is counted under; None for a view or an allocation (no launch)."""
    name = func.overloadpacket.__name__
    if func.is_view or name in NO_LAUNCH:
        return None
    return "HOST SYNC " + name if name in HOST_SYNCS else name


def call_site(frames, packages=SITE_PACKAGES) -> str:
    """`package/path.py:line function` of the innermost of `frames` ((filename, line, function), innermost first)
    whose file lies in one of `packages` (the last such directory of its path)."""
    for filename, line, function in frames:
        parts = Path(filename).parts
        roots = [i for i, part in enumerate(parts) if part in packages]
        if roots:
            return f"{'/'.join(parts[roots[-1]:])}:{line} {function}"
    return UNKNOWN_SITE


def python_frames(frame):
    """(filename, line, function) from `frame` outwards."""
    while frame is not None:
        yield frame.f_code.co_filename, frame.f_lineno, frame.f_code.co_name
        frame = frame.f_back


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
        name = op_name(func)
        if name is not None:
            self.current[name] += 1
        return func(*args, **(kwargs or {}))

    def count_triton_launch(self, kernel: str) -> bool:
        """Counts an interpreted Triton launch if counting is on; says whether it was."""
        if self.current is None:
            return False
        self.current["TRITON LAUNCH " + kernel] += 1
        return True


class SiteOps(TorchDispatchMode):
    """Counts the aten ops that would launch device work, and interpreted Triton launches, by (call site, op name),
    while `active`; `entered` wraps the runner's step methods, `suspended` the model forwards (neither ops nor Triton
    launches counted inside them: on the GPU they are CUDA graph replays)."""

    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()
        self.steps = 0
        self.active = False
        self.in_forward = 0  # depth of suspended model forwards being run

    def entered(self, method, counts_step: bool = False):
        """`method` run under the mode while `active` (a step counted per call if `counts_step`)."""
        @functools.wraps(method)
        def counted(*args, **kwargs):
            if not self.active:
                return method(*args, **kwargs)
            self.steps += counts_step
            with self:
                return method(*args, **kwargs)

        return counted

    def suspended(self, forward):
        """`forward` with every dispatch mode off and Triton launches uncounted."""
        @functools.wraps(forward)
        def uncounted(*args, **kwargs):
            self.in_forward += 1
            try:
                with _disable_current_modes():
                    return forward(*args, **kwargs)
            finally:
                self.in_forward -= 1

        uncounted.step_ops_suspended = True
        return uncounted

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = op_name(func)
        if name is not None:
            self.ops[call_site(python_frames(sys._getframe(1))), name] += 1
        return func(*args, **(kwargs or {}))

    def count_triton_launch(self, kernel: str) -> bool:
        if not self.active or self.in_forward:
            return False
        self.ops[call_site(python_frames(sys._getframe())), "TRITON LAUNCH " + kernel] += 1
        return True


@contextlib.contextmanager
def triton_launches_counted(counter):
    """Within: each interpreted Triton launch goes to `counter.count_triton_launch(kernel name)`, and runs with the
    dispatch mode off if counted (the interpreter's own tensor handling is not the kernel's)."""
    from triton.runtime.interpreter import GridExecutor

    launch = GridExecutor.__call__

    def counted(self, *args, **kwargs):
        if not counter.count_triton_launch(self.fn.__name__):
            return launch(self, *args, **kwargs)
        with _disable_current_modes():
            return launch(self, *args, **kwargs)

    GridExecutor.__call__ = counted
    try:
        yield
    finally:
        GridExecutor.__call__ = launch


def suspend_model_forwards(runner, site_ops: SiteOps) -> None:
    """Counting off inside the target model's and the drafter's forwards (instance `forward`s: vLLM's eager
    `__call__` runs `self.forward`), once per runner: the V1 runner's `drafter`, Model Runner V2's `speculator`."""
    drafter = getattr(runner, "drafter", None) or getattr(runner, "speculator", None)
    models = [runner.model] + ([drafter.model] if getattr(drafter, "model", None) is not None else [])
    for model in models:
        if not getattr(model.forward, "step_ops_suspended", False):
            model.forward = site_ops.suspended(model.forward)


def fixture_engine_inputs(batch: int):
    """(model path, prompts) of the fixture."""
    from transformers import AutoTokenizer

    from vllm_treewy.fixture import build_fixture, fixture_prompts

    model = str(build_fixture(Path(tempfile.mkdtemp()) / "fixture"))
    return model, fixture_prompts(AutoTokenizer.from_pretrained(model), batch)


def count_updates(args) -> None:
    """The adapter's two per-step count updates under reconstruct (the default mode)."""
    from vllm_treewy.vllm_plugin.v1 import accepted_counts
    from vllm_treewy.vllm_plugin.gdn import step_metadata
    from vllm_treewy.vllm_plugin.testing.equivalence import engine, generate_greedy

    model, prompts = fixture_engine_inputs(args.batch)
    spec = {"method": "mtp", "num_speculative_tokens": args.k, "mamba_state_commit": "reconstruct"}
    step_ops = StepOps(("GDN metadata build", "after sampling"))
    with engine(model, speculative_config=spec, max_num_seqs=args.batch) as llm:
        generate_greedy(llm, prompts, [8] * len(prompts))  # warm-up: one-off tables and compiles
        # the adapter's wrappers look both up at each call
        step_metadata.with_commit_nodes = step_ops.counting(step_metadata.with_commit_nodes, "GDN metadata build")
        accepted_counts.record_chain_accepted_counts = step_ops.counting(
            accepted_counts.record_chain_accepted_counts, "after sampling")
        with triton_launches_counted(step_ops) if args.triton else contextlib.nullcontext():
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


def runner_class(runner: str):
    """The model runner class whose steps are counted: vLLM's V1 runner, or Model Runner V2 (`v2_cpu`)."""
    if runner == "v2":
        from vllm.v1.worker.gpu.model_runner import GPUModelRunner
    else:
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    return GPUModelRunner


def count_whole_step(args, strategy: str, model: str, prompts) -> SiteOps:
    """One engine's device ops outside the model forwards, by call site, for `strategy` (after a warm-up)."""
    GPUModelRunner = runner_class(args.runner)
    from vllm_treewy.vllm_plugin.testing.equivalence import engine, generate_greedy

    site_ops = SiteOps()
    originals = {name: getattr(GPUModelRunner, name) for name in ("execute_model", "sample_tokens")}

    def execute_model(runner, *a, **kw):
        suspend_model_forwards(runner, site_ops)
        return originals["execute_model"](runner, *a, **kw)

    GPUModelRunner.execute_model = site_ops.entered(functools.wraps(originals["execute_model"])(execute_model),
                                                    counts_step=True)
    GPUModelRunner.sample_tokens = site_ops.entered(originals["sample_tokens"])
    spec = {"method": "mtp", "num_speculative_tokens": args.k, "mamba_state_commit": strategy}
    try:
        with engine(model, speculative_config=spec, max_num_seqs=args.batch) as llm:
            generate_greedy(llm, prompts, [8] * len(prompts))  # warm-up: one-off tables and compiles
            site_ops.active = True
            with triton_launches_counted(site_ops):  # the adapter's (--triton) and any of vLLM's
                generate_greedy(llm, prompts, [args.max_tokens] * len(prompts))
            site_ops.active = False
    finally:
        for name, method in originals.items():
            setattr(GPUModelRunner, name, method)
    return site_ops


def per_step(site_ops: SiteOps, by_op: bool) -> collections.Counter:
    """Ops per engine step, by (site, op) or by site."""
    result = collections.Counter()
    for (site, name), count in site_ops.ops.items():
        result[(site, name) if by_op else site] += count / site_ops.steps
    return result


def print_comparison(runs: dict[str, SiteOps], top: int) -> None:
    """Totals per step, then the call sites (and ops) whose per-step counts differ, largest difference first."""
    base, other = runs["store_all"], runs["reconstruct"]
    print("\ndevice ops per engine step outside the model forwards")
    for strategy, site_ops in runs.items():
        print(f"  {strategy:<12}{sum(site_ops.ops.values()) / site_ops.steps:8.1f} per step "
              f"({site_ops.steps} steps)")
    a, b = per_step(base, by_op=True), per_step(other, by_op=True)
    differences = sorted(set(a) | set(b), key=lambda key: -abs(b[key] - a[key]))
    print(f"\n{'reconstruct - store_all':>24}{'store_all':>10}{'reconstr.':>10}  call site: op")
    for key in differences[:top]:
        if abs(b[key] - a[key]) < 0.05:
            break
        print(f"{b[key] - a[key]:+24.2f}{a[key]:10.2f}{b[key]:10.2f}  {key[0]}: {key[1]}")
    print(f"\n{'all call sites':>24}{'store_all':>10}{'reconstr.':>10}  call site")
    a, b = per_step(base, by_op=False), per_step(other, by_op=False)
    for site in sorted(set(a) | set(b), key=lambda site: -max(a[site], b[site]))[:top]:
        print(f"{b[site] - a[site]:+24.2f}{a[site]:10.2f}{b[site]:10.2f}  {site}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--triton", action="store_true", help="force the one-launch kernels (interpreted)")
    parser.add_argument("--whole-step", action="store_true",
                        help="the whole step outside the model forwards, by call site, both strategies")
    parser.add_argument("--top", type=int, default=40, help="--whole-step: rows per table")
    parser.add_argument("--runner", choices=("v1", "v2"), default="v1",
                        help="--whole-step: vLLM's V1 runner (the CPU backend's), or Model Runner V2 (`v2_cpu`: "
                             "every Triton kernel interpreted)")
    args = parser.parse_args(argv)
    if args.runner == "v2":
        if not args.whole_step:
            parser.error("--runner v2 counts the whole step (--whole-step)")
        from bench.host import v2_cpu

        v2_cpu.force()

    import vllm_treewy.vllm_plugin as plugin

    plugin.register()
    if args.runner == "v2":
        v2_cpu.install_hooks()
    if args.triton:
        from vllm_treewy.kernels.bookkeeping import dispatch

        dispatch.launches_triton = lambda counts: True
    if not args.whole_step:
        count_updates(args)
        return 0
    model, prompts = fixture_engine_inputs(args.batch)
    runs = {strategy: count_whole_step(args, strategy, model, prompts) for strategy in ("store_all", "reconstruct")}
    print_comparison(runs, args.top)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
