"""Host time of the adapter's per-step code, per engine step, reconstruct vs store_all (vLLM's CPU backend).

On CPU the model forward runs in Python, so wall time says nothing about CUDA; what carries over is the code that
also runs outside the CUDA graphs there: the GDN metadata builder (vLLM's and our wrapper around it), the
accepted-count recording after sampling, the runner and scheduler hooks. One engine per strategy (the fixture's
`tiny` shape, MTP k = 3, eager) generates `--max-tokens` greedy tokens for `--batch` prompts under cProfile; the
table gives each wrapper's own share per engine step (an engine step: one `execute_model` call): its cumulative
time minus that of the vLLM function it wraps.

    python bench/host/host_profile.py --batch 8 --max-tokens 64

cProfile's own cost per call inflates code of many small calls (ours): compare strategies and versions, not absolutes.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import tempfile
from pathlib import Path

# (what, the adapter's wrapper, the vLLM function it wraps): (file suffix, function name) each
WRAPPERS = (
    ("GDN metadata build", ("vllm_plugin/gdn/step_metadata.py", "build"), ("backends/gdn_attn.py", "build")),
    ("after sampling", ("vllm_plugin/v1/accepted_counts.py", "update_states_after_model_execute"),
     ("worker/gpu_model_runner.py", "_update_states_after_model_execute")),
    ("prepare inputs", ("vllm_plugin/v1/runner.py", "prepare_inputs"),
     ("worker/gpu_model_runner.py", "_prepare_inputs")),
    ("build attention metadata", ("vllm_plugin/v1/runner.py", "build_attention_metadata"),
     ("worker/gpu_model_runner.py", "_build_attention_metadata")),
    ("sample", ("vllm_plugin/v1/runner.py", "sample"), ("worker/gpu_model_runner.py", "_sample")),
    ("scheduler update", ("vllm_plugin/trees/budget.py", "update_after_schedule"),
     ("core/sched/scheduler.py", "_update_after_schedule")),
)
STEP = ("worker/gpu_model_runner.py", "execute_model")  # the CPU runner inherits it


def _cumulative(stats: pstats.Stats, suffix: str, name: str) -> tuple[int, float]:
    calls, total = 0, 0.0
    for (path, _, func), (_, ncalls, _, cumtime, _) in stats.stats.items():
        if path.endswith(suffix) and func == name:
            calls, total = calls + ncalls, total + cumtime
    return calls, total


def profile(strategy: str, model: str, prompts, args) -> dict:
    from vllm_treewy.vllm_plugin.testing.equivalence import engine, generate_greedy

    spec = {"method": "mtp", "num_speculative_tokens": args.k, "mamba_state_commit": strategy}
    with engine(model, speculative_config=spec, max_num_seqs=args.batch) as llm:
        generate_greedy(llm, prompts, [8] * len(prompts))  # warm-up
        profiler = cProfile.Profile()
        profiler.enable()
        generate_greedy(llm, prompts, [args.max_tokens] * len(prompts))
        profiler.disable()
    stats = pstats.Stats(profiler)
    steps = _cumulative(stats, *STEP)[0]
    rows = {}
    for what, wrapper, original in WRAPPERS:
        calls, total = _cumulative(stats, *wrapper)
        rows[what] = calls, total - _cumulative(stats, *original)[1]
    rows["adapter, all of the above"] = 0, sum(total for _, total in rows.values())
    return {"steps": steps, "rows": rows}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--strategies", nargs="+", default=["store_all", "reconstruct"])
    parser.add_argument("--triton", action="store_true",
                        help="force the one-launch count kernels (CUDA's path; here interpreted, so it times the "
                             "interpreter, not a launch)")
    args = parser.parse_args(argv)

    from transformers import AutoTokenizer

    import vllm_treewy.vllm_plugin as plugin
    from vllm_treewy.fixture import build_fixture, fixture_prompts

    plugin.register()
    if args.triton:
        from vllm_treewy.kernels.bookkeeping import dispatch

        dispatch.launches_triton = lambda counts: True
    model = str(build_fixture(Path(tempfile.mkdtemp()) / "fixture"))
    prompts = fixture_prompts(AutoTokenizer.from_pretrained(model), args.batch)
    results = {s: profile(s, model, prompts, args) for s in args.strategies}
    print(f"\nadapter's own host time per engine step, us under cProfile (calls per step); batch {args.batch}, "
          f"k {args.k}")
    print(f"{'function':<60}" + "".join(f"{s + ' (' + str(r['steps']) + ' steps)':>32}" for s, r in results.items()))
    for row in results[args.strategies[0]]["rows"]:
        cells = []
        for r in results.values():
            calls, total = r["rows"][row]
            cells.append(f"{1e6 * total / max(r['steps'], 1):>20.1f} ({calls / max(r['steps'], 1):5.1f}/step)")
        print(f"{row:<60}" + "".join(f"{c:>32}" for c in cells))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
