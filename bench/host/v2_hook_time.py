"""Host time per engine step of the adapter's Model Runner V2 hooks, reconstruct beside store_all (vLLM's CPU backend,
V2 forced on by `v2_cpu`), and the Triton launches they add.

The hooks (each a wrapper of a vLLM function):
- GDN metadata build: `gdn.step_metadata`'s wrapper of `GDNAttentionMetadataBuilder.build` (a step's first GDN group,
  and prefills);
- GDN update_block_table: `v2.accepted_counts`'s wrapper of `update_block_table` (each further GDN group of the step);
- after sampling: `v2.accepted_counts`'s wrapper of V2's `postprocess_sampled` (the slot counts).

One engine per strategy, one after another in this process (the fixture's `tiny` shape, MTP k, eager, prefix caching
off: the GPU k = 1 runs' configuration, `testing.equivalence.ENGINE_DEFAULTS`): a warm-up generate, then `--repeats`
timed generates of `--max-tokens` greedy tokens for `--batch` prompts. Two measurements, both in CPU time of the
engine's thread (`time.thread_time`: the engine runs in this process), so that other processes on the same cores do
not count:

1. In the engine, per engine step (one `execute_model`; medians over the repeats): each hook's calls, its own Triton
   launches, and its own time (a timer around the adapter's wrapper minus one around the vLLM function inside, less
   the interpreted launches in either). The interpreter's kernels churn through the CPU's
   caches between the hooks, so these times run 10-20x above a warm call's: compare strategies and versions, not
   absolutes.
2. Warm replay: each hook's wrapper body alone, on the inputs of its last call in the last generate, with the vLLM
   function it wraps answered by that call's result and every Triton launch stubbed (counted, not run): microseconds
   per call (the fastest of `--replay-rounds` rounds of `--replay-calls` calls), and per step (x calls per step). This
   is the adapter's own Python and eager torch ops; on CUDA each launch adds its launcher's few microseconds.

`--triton` makes the adapter take its CUDA path (its Triton kernels, one launch per update, instead of the torch twins
that the CPU backend runs: a few CPU ops each, which CUDA would launch one by one).

    python -m bench.host.v2_hook_time --batch 8 --max-tokens 16 --k 1 --triton
"""

from __future__ import annotations

import argparse
import functools
import importlib
import statistics
import time
import timeit

from bench.host import v2_cpu

STEP = "V2 execute_model"
# the engine thread's CPU time (the engine runs in this process): other processes on the same cores leave it alone
CLOCK = time.thread_time
# (label, vLLM's module, attribute path, the adapter's module and wrapper maker): what the adapter wraps, timed inside
# and outside its wrapper
HOOKED = (
    ("GDN metadata build", "vllm.v1.attention.backends.gdn_attn", "GDNAttentionMetadataBuilder.build",
     "vllm_treewy.vllm_plugin.gdn.step_metadata", "_building_commit_nodes"),
    ("GDN update_block_table", "vllm.v1.attention.backends.gdn_attn", "GDNAttentionMetadataBuilder.update_block_table",
     "vllm_treewy.vllm_plugin.v2.accepted_counts", "_regathering_commit_nodes"),
    ("after sampling", "vllm.v1.worker.gpu.model_runner", "GPUModelRunner.postprocess_sampled",
     "vllm_treewy.vllm_plugin.v2.accepted_counts", "_recording_sampled_counts"),
)
# vLLM's own phases, timed once (for scale: their kernels run in the interpreter here)
PHASES = (
    (STEP, "vllm.v1.worker.gpu.model_runner", "GPUModelRunner.execute_model"),
    ("V2 sample_tokens", "vllm.v1.worker.gpu.model_runner", "GPUModelRunner.sample_tokens"),
    ("V2 prepare_attn (mamba hybrid)", "vllm.v1.worker.gpu.model_states.mamba_hybrid",
     "MambaHybridModelState.prepare_attn"),
)


def _owner_and_name(module: str, path: str):
    owner = importlib.import_module(module)
    *parents, name = path.split(".")
    for part in parents:
        owner = getattr(owner, part)
    return owner, name


class Timers:
    """Seconds and calls by label of wrapped attributes, the interpreted Triton launches inside each (their count and
    seconds), and each label's last call (arguments and result)."""

    def __init__(self):
        self.seconds: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self.launches: dict[str, int] = {}
        self.launch_seconds: dict[str, float] = {}
        self.last_call: dict[str, tuple] = {}
        self._launched = [0, 0.0]  # launches and their seconds so far, all call sites

    def wrap(self, module: str, path: str, label: str) -> None:
        owner, name = _owner_and_name(module, path)
        method = getattr(owner, name)
        for counter in (self.seconds, self.calls, self.launches, self.launch_seconds):
            counter.setdefault(label, 0)
        launched = self._launched

        @functools.wraps(method)
        def timed(*args, **kwargs):
            launches, launch_seconds = launched
            start = CLOCK()
            result = None
            try:
                result = method(*args, **kwargs)
                return result
            finally:
                self.seconds[label] += CLOCK() - start
                self.calls[label] += 1
                self.launches[label] += launched[0] - launches
                self.launch_seconds[label] += launched[1] - launch_seconds
                self.last_call[label] = (args, kwargs, result)

        setattr(owner, name, timed)

    def count_triton_launches(self) -> None:
        """Every interpreted Triton launch counted, with its seconds."""
        from triton.runtime.interpreter import GridExecutor

        launch, launched = GridExecutor.__call__, self._launched

        def counted(executor, *args, **kwargs):
            start = CLOCK()
            try:
                return launch(executor, *args, **kwargs)
            finally:
                launched[0] += 1
                launched[1] += CLOCK() - start

        GridExecutor.__call__ = counted

    def clear(self) -> None:
        for label in self.seconds:
            self.seconds[label], self.calls[label], self.launches[label], self.launch_seconds[label] = 0.0, 0, 0, 0.0


def install_timers() -> Timers:
    """Inner timers on vLLM's functions, the plugin and its V2 hooks, then outer timers on the adapter's wrappers."""
    import vllm_treewy.vllm_plugin as plugin

    timers = Timers()
    timers.count_triton_launches()
    for label, module, path, _, _ in HOOKED:
        timers.wrap(module, path, f"{label} (vLLM's)")
    plugin.register()
    v2_cpu.install_hooks()
    for label, module, path, _, _ in HOOKED:
        timers.wrap(module, path, f"{label} (with the adapter's wrapper)")
    for label, module, path in PHASES:
        timers.wrap(module, path, label)
    return timers


def in_engine(timers: Timers) -> dict[str, tuple[float, float]]:
    """label -> (us per step, calls or launches per step): each hook's own time (wrapper minus vLLM's, less the
    interpreted Triton launches in either) and its own launches; vLLM's functions and phases as they are."""
    steps = max(timers.calls[STEP], 1)
    rows = {}
    for label, *_ in HOOKED:
        outer, inner = f"{label} (with the adapter's wrapper)", f"{label} (vLLM's)"
        own = (timers.seconds[outer] - timers.launch_seconds[outer]) - (
            timers.seconds[inner] - timers.launch_seconds[inner])
        rows[f"{label}: own time (calls)"] = (1e6 * own / steps, timers.calls[outer] / steps)
        rows[f"{label}: own Triton launches"] = (0.0, (timers.launches[outer] - timers.launches[inner]) / steps)
    rows["the adapter's hooks, all (launches)"] = (sum(us for us, _ in rows.values()),
                                                   sum(n for label, (_, n) in rows.items()
                                                       if label.endswith("launches")))
    for label, *_ in HOOKED:
        inner = f"{label} (vLLM's)"
        rows[inner] = (1e6 * timers.seconds[inner] / steps, timers.calls[inner] / steps)
    for label, _, _ in PHASES:
        rows[label] = (1e6 * timers.seconds[label] / steps, timers.calls[label] / steps)
    return rows


def replay(timers: Timers, calls_per_step: dict[str, float], args) -> dict[str, tuple[float, float, float]]:
    """label -> (us per call, us per step, launches per call): each hook's wrapper body on its last call's inputs,
    the vLLM function answered by that call's result, Triton launches stubbed."""
    from triton.runtime.interpreter import InterpretedFunction

    launches = [0]
    run = InterpretedFunction.run

    def stubbed(self, *a, **kw):
        launches[0] += 1

    InterpretedFunction.run = stubbed
    rows = {}
    try:
        for label, _, _, maker_module, maker in HOOKED:
            if f"{label} (vLLM's)" not in timers.last_call:
                continue
            call_args, call_kwargs, result = timers.last_call[f"{label} (vLLM's)"]
            body = getattr(importlib.import_module(maker_module), maker)(lambda *a, **kw: result)

            def call():
                body(*call_args, **call_kwargs)

            call()
            launches[0] = 0
            rounds = [timeit.Timer(call, timer=CLOCK).timeit(number=args.replay_calls) / args.replay_calls
                      for _ in range(args.replay_rounds)]
            per_call = 1e6 * min(rounds)  # the least disturbed round (other processes share the cores)
            calls = calls_per_step[f"{label}: own time (calls)"]
            rows[label] = (per_call, per_call * calls, launches[0] / (args.replay_calls * args.replay_rounds))
    finally:
        InterpretedFunction.run = run
    rows["the adapter's hooks, all"] = (0.0, sum(r[1] for r in rows.values()), 0.0)
    return rows


def measure(strategy: str, model: str, prompts, timers: Timers, args) -> dict:
    from vllm_treewy.vllm_plugin.testing.equivalence import engine, generate_greedy

    spec = {"method": "mtp", "num_speculative_tokens": args.k, "mamba_state_commit": strategy}
    repeats = []
    with engine(model, speculative_config=spec, max_num_seqs=args.batch) as llm:
        if not llm.llm_engine.vllm_config.use_v2_model_runner:
            raise RuntimeError("the engine did not pick Model Runner V2")
        generate_greedy(llm, prompts, [8] * len(prompts))  # warm-up: one-off tables and interpreter set-up
        for _ in range(args.repeats):
            timers.clear()
            generate_greedy(llm, prompts, [args.max_tokens] * len(prompts))
            repeats.append((timers.calls[STEP], in_engine(timers)))
        rows = {label: tuple(statistics.median(r[label][i] for _, r in repeats) for i in range(2))
                for label in repeats[0][1]}
        warm = replay(timers, {label: n for label, (_, n) in rows.items()}, args)
    return {"steps": [steps for steps, _ in repeats], "rows": rows, "replay": warm}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--k", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--replay-calls", type=int, default=2000)
    parser.add_argument("--replay-rounds", type=int, default=7)
    parser.add_argument("--strategies", nargs="+", default=["store_all", "reconstruct"])
    parser.add_argument("--triton", action="store_true", help="the adapter's Triton kernels (the CUDA path)")
    args = parser.parse_args(argv)

    v2_cpu.force()
    timers = install_timers()
    if args.triton:
        from vllm_treewy.kernels.bookkeeping import dispatch

        dispatch.launches_triton = lambda counts: True
    from bench.host.step_ops import fixture_engine_inputs

    model, prompts = fixture_engine_inputs(args.batch)
    results = {s: measure(s, model, prompts, timers, args) for s in args.strategies}
    header = f"{'':<52}" + "".join(f"{s + ' ' + str(r['steps']) + ' steps':>34}" for s, r in results.items())
    print(f"\n1. in the engine, per engine step: us (calls or launches per step), median of {args.repeats} generates; "
          f"batch {args.batch}, k {args.k}, {args.max_tokens} tokens{', Triton path' if args.triton else ''}")
    print(header)
    for label in results[args.strategies[0]]["rows"]:
        cells = [f"{r['rows'][label][0]:>20.1f} ({r['rows'][label][1]:4.1f}/step)" for r in results.values()]
        print(f"{label:<52}" + "".join(f"{c:>34}" for c in cells))
    print(f"\n2. warm replay of each hook's wrapper body, Triton launches stubbed: us per call / us per step "
          f"(launches per call), fastest of {args.replay_rounds} rounds of {args.replay_calls} calls")
    print(header)
    for label in results[args.strategies[0]]["replay"]:
        cells = [f"{c:8.2f} / {s:8.2f} ({n:3.1f})" for c, s, n in (r["replay"].get(label, (0, 0, 0))
                                                                 for r in results.values())]
        print(f"{label:<52}" + "".join(f"{c:>34}" for c in cells))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
