"""Reconstruct MTP chains on vLLM's Model Runner V2 (the runner vLLM 0.32 picks on CUDA), beside store_all on V2 and
reconstruct forced onto V1, judged against no speculation, in one device call (`bench/e2e/run_gpu_v2_chains.sh`).

Every engine is one process and they all start at once, each with a fixed KV-cache budget (no memory profiling, which
other processes' allocations would disturb): a fresh H200 spends ~2 minutes in each engine's start, so one after the
other they would not fit one call. Their timed batches do not overlap: each engine, once started, waits until every
engine has started (none compiles any more) and the previous one's timing is done, then times its batches
(`gpu_vllm_e2e.timed_batches`: B = 1 / 8 / 64 / 256 prompts at once, median of the passes) while the others wait idle,
and tears down only after the last engine timed; so tokens/s compare like for like, as in engines run one after the
other. A run records whether it was timed so (`timing.alone`). The no-speculation reference has the last turn; it then
judges every run's outputs tie-aware (`gpu_vllm_e2e.py`'s verdict: a divergence passes only within one bf16 step of
the reference's top two logits, or where the fp64 fixture does not prefer the reference's token by more), and itself
in smaller batches (the fixture's floor). Each engine records the runner vLLM picked (`use_v2_model_runner`: nothing
forces V2; `--runner v1` sets VLLM_USE_V2_MODEL_RUNNER=0), and on V2 the FULL graphs its graph manager captured and
how many of the timed passes' steps replayed one.

    python3 bench/e2e/gpu_v2_chains.py spec --strategy reconstruct --k 3 --runs R --turns-dir T --turn 0 --engines 3 ...
    python3 bench/e2e/gpu_v2_chains.py reference --runs R --expect 2 --out report.json --turns-dir T --turn 2 --engines 3
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path

from bench.e2e import gpu_site
from bench.e2e.gpu_vllm_e2e import (add_common_args, batch_shape_control, beside_store_all, device_facts, engine_kwargs,
                                fixture_dir, judged, maybe_profile, print_runs, prompts_and_model, timed_batches,
                                tree_model, verdict_record)
from vllm_treewy.fixture.exact import ExactModel

# Longest waits (s) for the other engines' starts, the previous engine's timing (a turn takes well under a minute),
# and the runs to judge: past them an engine goes on (timing.alone false), so that a hung engine holds up no verdict.
START_WAIT_S, TURN_WAIT_S, RUNS_WAIT_S = 300, 90, 60


def _wait(ready, timeout_s: float) -> float | None:
    """Seconds until `ready()` held, None if it did not within `timeout_s`."""
    start = time.monotonic()
    while not ready():
        if time.monotonic() - start > timeout_s:
            return None
        time.sleep(0.5)
    return time.monotonic() - start


class Turns:
    """Engine `turn` of `engines` that run at once: marks in `turns_dir` say which have started and which have timed."""

    def __init__(self, args):
        self.dir, self.turn, self.engines = Path(args.turns_dir), args.turn, args.engines
        self.dir.mkdir(parents=True, exist_ok=True)

    def mark(self, what: str) -> None:
        (self.dir / f"{what}-{self.turn}").touch()

    def _wait_for_turn_done(self, turn: int) -> float | None:
        """Seconds until engine `turn`'s timing was done (at once for turn < 0); None once no engine finished its
        timing for TURN_WAIT_S (one that hung)."""
        start = last_progress = time.monotonic()
        done = -1
        while turn >= 0 and not (self.dir / f"done-{turn}").exists():
            if len(list(self.dir.glob("done-*"))) != done:
                done, last_progress = len(list(self.dir.glob("done-*"))), time.monotonic()
            if time.monotonic() - last_progress > TURN_WAIT_S:
                return None
            time.sleep(0.5)
        return time.monotonic() - start

    @contextmanager
    def timing(self):
        """Waits until every engine started and the previous turn is done; yields what it waited for."""
        self.mark("started")
        all_started = _wait(lambda: len(list(self.dir.glob("started-*"))) >= self.engines, START_WAIT_S)
        previous = self._wait_for_turn_done(self.turn - 1)
        record = {"turn": self.turn, "engines": self.engines, "waited_s": [all_started, previous],
                  "alone": all_started is not None and previous is not None}
        try:
            yield record
        finally:
            self.mark("done")

    def hold_until_the_last_timing(self) -> None:
        """An engine's teardown (freeing its KV cache, its CUDA context) would run beside the next engine's timing:
        it waits until the last engine (the reference) has timed."""
        self._wait_for_turn_done(self.engines - 1)


def model_runner_of(llm):
    """The in-process engine's model runner (instrumentation: the bench reads what it captured and replays)."""
    return llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner


def engine_facts(llm) -> dict:
    """The runner vLLM picked and, on V2, the FULL graphs its graph manager captured (tokens, requests)."""
    config, runner = llm.llm_engine.vllm_config, model_runner_of(llm)
    manager = getattr(runner, "cudagraph_manager", None)
    full = None
    if manager is not None and hasattr(manager, "run_fullgraph"):
        full = sorted((d.num_tokens, d.num_reqs) for d in manager.graphs if d.cg_mode.name == "FULL")
    return {"model_runner": "V2" if config.use_v2_model_runner else "V1", "runner_class": type(runner).__module__,
            "cudagraph_mode": str(config.compilation_config.cudagraph_mode), "full_graphs": full}


@contextmanager
def counting_steps(llm):
    """Counts the runner's forward steps and, on V2, its FULL-graph replays by token count, while the block runs."""
    runner = model_runner_of(llm)
    manager = getattr(runner, "cudagraph_manager", None)
    counts = {"steps": 0, "full_graph_replays": {} if hasattr(manager, "run_fullgraph") else None}
    execute_model = runner.execute_model

    def counted_execute_model(*args, **kwargs):
        counts["steps"] += 1
        return execute_model(*args, **kwargs)

    runner.execute_model = counted_execute_model
    if counts["full_graph_replays"] is not None:
        run_fullgraph = manager.run_fullgraph

        def counted_run_fullgraph(desc, *args, **kwargs):
            replays = counts["full_graph_replays"]
            replays[desc.num_tokens] = replays.get(desc.num_tokens, 0) + 1
            return run_fullgraph(desc, *args, **kwargs)

        manager.run_fullgraph = counted_run_fullgraph
    try:
        yield counts
    finally:
        del runner.execute_model
        if counts["full_graph_replays"] is not None:
            del manager.run_fullgraph


def run_name(args) -> str:
    shape = f"-tree{''.join(map(str, args.tree_widths))}" if args.tree_widths else f"-k{args.k}"
    if args.tree_widths and args.tree_max_batch_size is not None:
        shape += f"-t{args.tree_max_batch_size}"
    return (f"{args.strategy}{shape}" + ("-v1" if args.runner == "v1" else "")
            + (f"-{args.name_suffix}" if args.name_suffix else "")
            + (f"-{args.attention_backend.lower()}" if args.attention_backend else ""))


def speculative_config(args) -> dict:
    """MTP with the strategy: a chain of k drafts, or (`--tree-widths`) the MTP tree of those widths (depth drafts
    as the user writes them; vLLM then schedules the tree's N nodes)."""
    spec = {"method": "mtp", "num_speculative_tokens": args.k, "mamba_state_commit": args.strategy,
            **gpu_site.attention_site(args.attention_backend)}
    if args.tree_widths:
        spec.update(num_speculative_tokens=len(args.tree_widths), draft_tree_widths=list(args.tree_widths))
        if args.tree_max_batch_size is not None:
            spec.update(draft_tree_max_batch_size=args.tree_max_batch_size)
    return spec


def tokens_per_request(args) -> int | tuple[int, int]:
    """1 + the drafts vLLM verifies per request (a tree: its N nodes): the FULL graphs' token counts; with
    `--tree-max-batch-size` both shapes' (1 + N, 1 + depth)."""
    if not args.tree_widths:
        return 1 + args.k
    from vllm_treewy.tree import DraftTree

    tree_tokens = 1 + DraftTree.from_widths(args.tree_widths).num_nodes
    if args.tree_max_batch_size is None:
        return tree_tokens
    return tree_tokens, 1 + len(args.tree_widths)


def describe(args) -> str:
    """What an engine of these arguments would run, without vLLM or the fixture (the scripts' DRY_RUN): its run name
    and speculative config (the reference: its role), the fixture folder and the engine kwargs on CUDA."""
    if args.role == "spec":
        per_request = tokens_per_request(args)
        head = f"{run_name(args)} {speculative_config(args)} tokens/request {per_request}"
        model = fixture_dir(args.fixture_architecture, args.blurred_mtp)
    else:
        per_request, head = 1, f"{args.role} expect {args.expect}"
        model = fixture_dir(args.fixture_architecture)
    return f"{head} model {model} engine {engine_kwargs(args, per_request, cuda=True)}"


def print_dry_runs(calls: list[str]) -> None:
    """The scripts' DRY_RUN, in one Python for every process of a call: each of `calls` is one process's name and
    its driver arguments (a shell-quoted line); prints `NAME -> ` what it would run (`describe`; the reference also
    its timing repeats and shape control). Arguments the driver's parser refuses exit as the driver would (status 2),
    after the lines of the calls before them."""
    import shlex

    parser = build_parser()
    for call in calls:
        name, *argv = shlex.split(call)
        args = parser.parse_args(argv)
        line = f"{name} -> {describe(args)}"
        if args.role == "reference":
            line += f" repeats {args.timing_repeats} shape control {not args.no_shape_control}"
        print(line, flush=True)


def run_spec(args, turns: Turns) -> int:
    import vllm_treewy.vllm_plugin as plugin
    from vllm_treewy.vllm_plugin.testing.equivalence import engine, kv_cache_report, read_acceptance

    plugin.register()  # in-process engine: this process is the only vLLM process
    model, prompts = tree_model(args)  # the fixture of --fixture-architecture, or its blurred-MTP variant
    spec = speculative_config(args)
    name = run_name(args)
    start = time.perf_counter()
    with engine(model, speculative_config=spec, **engine_kwargs(args, tokens_per_request(args))) as llm:
        started = time.perf_counter() - start
        facts = engine_facts(llm)
        print(name, "started", facts, flush=True)
        with turns.timing() as timing, counting_steps(llm) as steps:
            before = read_acceptance(llm)
            outputs, tokens_per_s, acceptance_length = timed_batches(llm, prompts, args)
            after = read_acceptance(llm)
            profile = maybe_profile(llm, prompts, args, name)  # --profile-batch, in this engine's turn
        kv = kv_cache_report(llm)
        turns.hold_until_the_last_timing()
    result = {
        "name": name, "strategy": args.strategy, "k": args.k, "tree_widths": args.tree_widths, "dtype": args.dtype,
        "fixture_architecture": args.fixture_architecture, "ssm_cache_dtype": args.ssm_cache_dtype,
        "temperature": args.temperature, "top_p": args.top_p, "blurred_mtp": args.blurred_mtp,
        "engine_start_s": started, **facts, "timing": timing, "steps": steps,
        "outputs": {str(b): o for b, o in outputs.items()},
        "tokens_per_s": {str(b): t for b, t in tokens_per_s.items()},
        "acceptance_rate": ((after.num_accepted_tokens - before.num_accepted_tokens)
                            / max(after.num_draft_tokens - before.num_draft_tokens, 1)),
        "acceptance_length": {str(b): n for b, n in acceptance_length.items()}, "kv_cache": asdict(kv),
        "profile": profile,
    }
    Path(args.runs).mkdir(parents=True, exist_ok=True)
    (Path(args.runs) / f"{name}.json").write_text(json.dumps(result))
    summary = {k: result[k] for k in ("model_runner", "full_graphs", "steps", "tokens_per_s", "timing")}
    print(name, "done", json.dumps(summary), flush=True)
    return 0


def beside_v1(runs: dict) -> list[str]:
    """Each run forced onto V1 (`-v1`) beside the same run on the runner vLLM picked: tokens/s and acceptance."""
    lines = []
    for name, run in runs.items():
        other = runs.get(name.removesuffix("-v1"))
        if not name.endswith("-v1") or other is None:
            continue
        for b, t in run["tokens_per_s"].items():
            lengths = [r.get("acceptance_length", {}).get(str(b)) for r in (other, run)]
            length = "" if None in lengths else f", acceptance length {lengths[0]:.3f} vs {lengths[1]:.3f}"
            lines.append(f"{other['name']} on {other['model_runner']} beside {run['model_runner']} at batch {b}: "
                         f"tokens/s {other['tokens_per_s'][b]:,.0f} vs {t:,.0f} ({other['tokens_per_s'][b] / t:.2f}x)"
                         f"{length}")
    return lines


def run_reference(args, turns: Turns) -> int:
    from vllm_treewy.vllm_plugin.testing.equivalence import compare_tie_aware, engine, kv_cache_report

    model, prompts = prompts_and_model(args.fixture_architecture)
    report = {"command": args.command or " ".join([sys.executable, *sys.argv]), **device_facts(),
              "mode": "default (torch.compile + CUDA graphs), compiled ops",
              "fixture_architecture": args.fixture_architecture, "model_dtype": args.dtype,
              "ssm_cache_dtype": args.ssm_cache_dtype, "max_tokens": args.max_tokens, "batch_sizes": args.batch_sizes,
              "kv_cache_memory_bytes": args.kv_cache_memory_bytes, "runs": {}}
    exact_logits = ExactModel(model).next_token_logits  # fp64, on the CPU: consulted beyond a bf16 tie only
    with engine(model, logprobs_mode="raw_logits", **engine_kwargs(args, 1)) as reference:
        facts = engine_facts(reference)
        with turns.timing() as timing, counting_steps(reference) as steps:
            outputs, tokens_per_s, _ = timed_batches(reference, prompts, args)
            profile = maybe_profile(reference, prompts, args, "no-spec")  # --profile-batch, in its turn
        report["runs"]["no-spec"] = {"tokens_per_s": tokens_per_s, "kv_cache": asdict(kv_cache_report(reference)),
                                     **facts, "timing": timing, "steps": steps, "profile": profile}
        report["no_spec_in_smaller_batches"] = {} if args.no_shape_control else {
            b: verdict_record(compare_tie_aware(reference, prompts[:b], outputs[b], out, exact_logits))
            for b, out in batch_shape_control(reference, prompts, args).items()}
        runs_dir = Path(args.runs)
        report["waited_for_runs_s"] = _wait(lambda: len(list(runs_dir.glob("*.json"))) >= args.expect, RUNS_WAIT_S)
        for path in sorted(runs_dir.glob("*.json")):
            run = json.loads(path.read_text())
            entry = {key: v for key, v in run.items() if key != "outputs"}
            report["runs"][run["name"]] = judged(entry, run, reference, prompts, outputs, tokens_per_s, exact_logits,
                                                 batches_to_judge(run, args))
    print_runs(report)
    report["beside_store_all"] = beside_store_all(report["runs"])
    report["beside_v1"] = beside_v1({n: r for n, r in report["runs"].items() if n != "no-spec"})
    for line in report["beside_store_all"] + report["beside_v1"]:
        print(line, flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    # throughput runs (another activation dtype, or sampled) are reported, not required to pass
    reconstruct = [e for n, e in report["runs"].items() if n.startswith("reconstruct") and batches_to_judge(e, args)]
    missing = args.expect - (len(report["runs"]) - 1)
    ok = not missing and all(v["passed"] for e in reconstruct for v in e["verdicts"].values())
    on_v2 = [n for n, e in report["runs"].items() if e.get("model_runner") == "V2"]
    print(f"runs on V2: {on_v2}; missing runs: {max(missing, 0)}", flush=True)
    if not reconstruct:  # a call of throughput runs only: nothing to judge, nothing failed
        print("NO RUN JUDGED (throughput runs only)" if ok else "RUNS MISSING", flush=True)
    else:
        print("RECONSTRUCT PASSES AT EVERY BATCH" if ok else "RECONSTRUCT FAILS", flush=True)
    return 0 if ok else 1


def batches_to_judge(run: dict, args) -> list[int]:
    """The batch sizes at which the reference judges a run: all of them for a greedy run in the reference's
    activation dtype; none for a run in another dtype (a throughput run: its outputs part from the reference's at
    many near-ties, each of which costs an exact-model comparison) or a sampled one (no greedy outputs)."""
    if run.get("dtype", args.dtype) != args.dtype or run.get("temperature"):
        return []
    return list(args.batch_sizes)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="role", required=True)
    spec = sub.add_parser("spec", help="one speculative engine: outputs, tokens/s (in its turn), KV report")
    ref = sub.add_parser("reference", help="the no-speculation engine: tokens/s (last turn), then judges every run")
    for role in (spec, ref):
        add_common_args(role)
        role.add_argument("--turns-dir", required=True, help="the engines' start and timing marks")
        role.add_argument("--turn", type=int, required=True, help="this engine's place in the timing order")
        role.add_argument("--engines", type=int, required=True, help="engines that run at once, the reference too")
    spec.add_argument("--strategy", required=True, choices=["store_all", "reconstruct"])
    spec.add_argument("--k", type=int, default=3)
    spec.add_argument("--runner", default="default", choices=["default", "v1"],
                      help="default: the runner vLLM picks (V2 on CUDA); v1: VLLM_USE_V2_MODEL_RUNNER=0")
    spec.add_argument("--tree-widths", type=int, nargs="+", default=None,
                      help="an MTP draft tree of these widths instead of the chain of --k drafts")
    spec.add_argument("--tree-max-batch-size", type=int, default=None,
                      help="draft_tree_max_batch_size: the tree up to this many requests, the chain of its depth above")
    spec.add_argument("--blurred-mtp", action="store_true", help="the fixture's blurred-MTP variant (same target)")
    spec.add_argument("--name-suffix", default="", help="appended to the run's name (e.g. its dtype)")
    ref.add_argument("--expect", type=int, required=True, help="speculative runs to wait for and judge")
    ref.add_argument("--out", required=True)
    ref.add_argument("--command", default=None, help="the whole shell command, for the report")
    ref.add_argument("--no-shape-control", action="store_true",
                     help="skip the no-speculation control in smaller batches (the fixture's floor, known from earlier "
                          "calls): a shorter call")
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if getattr(args, "runner", "default") == "v1":
        os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "0"  # read when the engine's config is built
    turns = Turns(args)
    gpu_site.seed_model_info_cache()
    try:
        return {"spec": run_spec, "reference": run_reference}[args.role](args, turns)
    finally:  # a failed engine holds no one up
        turns.mark("started")
        turns.mark("done")


if __name__ == "__main__":
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    raise SystemExit(main())
