"""Where an engine's decode time goes: GPU kernel time by kind, launches, and host time, per output token.

`profile_generate` runs one `generate` under `torch.profiler` (CUDA activity; kernels inside CUDA graph replays
are reported one by one) in an in-process engine (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, as the GPU scripts
run). `summarize` is the pure part: it sorts kernels into kinds by name and takes the union of their intervals as
the GPU's busy time; the rest of the wall time is the host's (scheduling, sampling, Python between graph pieces,
launch gaps).
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass

# First match wins; names lower-cased. Our kernels' names start with the Triton functions in
# vllm_treewy/kernels/conv_step_triton.py and vllm_treewy/kernels/gdn_step_triton (the step: _conv_step_kernel, then
# _state_pass_kernel and _request_epilogue_kernel or _path_epilogue_kernel).
KERNEL_KINDS = (
    # vLLM's MoE layers: routing (top-k gating softmax, the token sort by expert), the experts' grouped GEMMs, the sum
    # over a token's experts; ahead of GEMM and sampling, whose needles ("cutlass", "topk") some of them also hold.
    ("MoE", ("moe", "gating", "expert")),
    ("treewy GDN step", ("_state_pass_kernel", "_request_epilogue_kernel", "_path_epilogue_kernel",
                         "_conv_step_kernel")),
    ("vLLM GDN", ("gdn", "gated_delta", "delta_rule", "causal_conv1d", "chunk_", "fused_recurrent", "l2norm",
                  "rms_norm_gated", "layer_norm_fwd")),
    ("attention", ("attn", "attention")),
    ("GEMM", ("gemm", "cutlass", "xmma", "nvjet", "cublas", "matmul", "sm90_")),
    ("sampling and copies", ("sample", "argmax", "softmax", "topk", "memcpy", "memset", "copy", "index", "scatter",
                             "gather", "cat")),
)


@dataclass(frozen=True)
class KernelEvent:
    name: str
    start_us: float
    duration_us: float


def kind_of(name: str) -> str:
    lowered = name.lower()
    for kind, needles in KERNEL_KINDS:
        if any(n in lowered for n in needles):
            return kind
    return "other"


def busy_us(events: Iterable[KernelEvent]) -> float:
    """The union of the kernels' intervals (kernels of one stream do not overlap; of several they may)."""
    total, end = 0.0, float("-inf")
    for e in sorted(events, key=lambda e: e.start_us):
        stop = e.start_us + e.duration_us
        if e.start_us >= end:
            total += e.duration_us
        elif stop > end:
            total += stop - end
        end = max(end, stop)
    return total


MOST_LAUNCHED_NAME = 160  # characters of a kernel's name kept (C++ template names run to thousands)


def summarize(events: list[KernelEvent], wall_s: float, output_tokens: int) -> dict:
    by_kind: dict[str, dict] = {}
    for e in events:
        entry = by_kind.setdefault(kind_of(e.name), {"us": 0.0, "launches": 0, "top": {}, "counts": {}})
        entry["us"] += e.duration_us
        entry["launches"] += 1
        entry["top"][e.name] = entry["top"].get(e.name, 0.0) + e.duration_us
        entry["counts"][e.name] = entry["counts"].get(e.name, 0) + 1
    busy = busy_us(events)
    wall_us = wall_s * 1e6
    per_token = 1 / max(output_tokens, 1)
    return {
        "wall_s": wall_s, "output_tokens": output_tokens,
        "wall_us_per_token": wall_us * per_token,
        "gpu_busy_us_per_token": busy * per_token,
        "host_us_per_token": max(wall_us - busy, 0.0) * per_token,
        "kinds": {
            kind: {"us_per_token": v["us"] * per_token, "launches_per_token": v["launches"] * per_token,
                   "share_of_gpu": v["us"] / max(busy, 1e-9),
                   "top": dict(sorted(v["top"].items(), key=lambda kv: -kv[1])[:5]),
                   # launches per token of the most launched kernels: where two strategies' launch counts differ
                   "most_launched": {name[:MOST_LAUNCHED_NAME]: n * per_token for name, n in
                                     sorted(v["counts"].items(), key=lambda kv: -kv[1])[:8]}}
            for kind, v in sorted(by_kind.items(), key=lambda kv: -kv[1]["us"])
        },
    }


def profile_generate(llm, prompts, max_tokens: int) -> dict:
    """One greedy `generate` of `max_tokens` tokens per prompt under the profiler (`profile_call`)."""
    from vllm_treewy.vllm_plugin.testing.equivalence import generate_greedy

    return profile_call(lambda: sum(len(o) for o in generate_greedy(llm, prompts, [max_tokens] * len(prompts))))


def profile_call(generate) -> dict:
    """`summarize` of one call of `generate` (returns the number of output tokens) under `torch.profiler`."""
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    # CUDA activity only: recording every CPU op would inflate the host time being measured
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        output_tokens = generate()
        torch.cuda.synchronize()
        wall_s = time.perf_counter() - start
    events = [KernelEvent(e.name, e.time_range.start, e.time_range.elapsed_us())
              for e in prof.events() if e.device_type == DeviceType.CUDA]
    return summarize(events, wall_s, output_tokens)


def print_summary(name: str, summary: dict) -> None:
    print(f"{name} profile: {summary['wall_us_per_token']:.1f} us/token wall, "
          f"{summary['gpu_busy_us_per_token']:.1f} GPU busy, {summary['host_us_per_token']:.1f} host", flush=True)
    for kind, v in summary["kinds"].items():
        print(f"  {kind}: {v['us_per_token']:.2f} us/token, {v['launches_per_token']:.1f} launches/token, "
              f"{100 * v['share_of_gpu']:.0f}% of GPU", flush=True)


HOST_TOP = 40  # functions kept per ordering
# an engine step: one `execute_model` of vLLM's V1 runner or of Model Runner V2 (cProfile's file paths)
STEP_FILES = ("gpu_model_runner.py", "worker/gpu/model_runner.py")


def is_engine_step(key) -> bool:
    """Whether a cProfile stats key `(file, line, function)` is a model runner's `execute_model`, either runner's."""
    file, _, name = key
    return name == "execute_model" and file.replace("\\", "/").endswith(STEP_FILES)


def host_profile_generate(llm, prompts, max_tokens: int, dump_path: str | None = None) -> dict:
    """One `generate` under cProfile: the host's Python per engine step (an engine step: one `execute_model`),
    the functions of most own time and of most cumulative time; with `dump_path`, the whole profile there too
    (`pstats` reads it: callers and callees). cProfile's per-call cost inflates code of many small calls: compare
    engines and versions, not absolutes."""
    import cProfile
    import pstats

    from vllm_treewy.vllm_plugin.testing.equivalence import generate_greedy

    profiler = cProfile.Profile()
    start = time.perf_counter()
    profiler.enable()
    outputs = generate_greedy(llm, prompts, [max_tokens] * len(prompts))
    profiler.disable()
    wall_s = time.perf_counter() - start
    if dump_path is not None:
        profiler.dump_stats(dump_path)
    stats = pstats.Stats(profiler).stats  # (file, line, name) -> (primitive calls, calls, tottime, cumtime, callers)
    steps = sum(v[1] for k, v in stats.items() if is_engine_step(k))

    def row(key, value):
        file, line, name = key
        return {"function": f"{'/'.join(file.split('/')[-3:])}:{line}({name})", "calls_per_step": value[1] / max(steps, 1),
                "own_us_per_step": 1e6 * value[2] / max(steps, 1), "cum_us_per_step": 1e6 * value[3] / max(steps, 1)}

    def top(index):
        return [row(k, v) for k, v in sorted(stats.items(), key=lambda kv: -kv[1][index])[:HOST_TOP]]

    return {"wall_s": wall_s, "steps": steps, "output_tokens": sum(len(o) for o in outputs),
            "wall_us_per_step": 1e6 * wall_s / max(steps, 1), "by_own_time": top(2), "by_cumulative_time": top(3)}


def print_host_summary(name: str, host: dict) -> None:
    print(f"{name} host profile (cProfile): {host['steps']} steps, {host['wall_us_per_step']:.0f} us/step wall",
          flush=True)
    for title, key in (("own time", "by_own_time"), ("cumulative", "by_cumulative_time")):
        print(f"  by {title} (us/step, calls/step):", flush=True)
        for r in host[key]:
            print(f"    {r['own_us_per_step'] if key == 'by_own_time' else r['cum_us_per_step']:9.1f} "
                  f"{r['calls_per_step']:7.1f}  {r['function']}", flush=True)
