"""Where an engine step's host time goes, reconstruct beside store_all, on the H200 (or, without CUDA, the same flow on
vLLM's CPU backend: the plumbing check that CI runs).

One engine per strategy, each in its own process (`strategy`, run by `run`), built as `gpu_vllm_e2e.py` builds its
engines (the fixture at shape qwen35, default compilation with FULL CUDA graphs for decode, async scheduling, MTP k).
The engine core and the model runner run in that process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, and the runner is
reached through the in-process client: the script stops if it is not there). After a warm-up generate of the audited
batch (`--batch` prompts, `--max-tokens` greedy tokens), three more generates of it:

1. timed: wall per engine step (an engine step: one `execute_model` call) and host time per step of the runner's,
   scheduler's and adapter's methods (wrappers that only take the time), the CUDA graph mode of each step, and every
   explicit wait on the GPU (`torch.Event` / `torch.cuda.Event` / `torch.cuda.Stream` synchronize,
   `torch.cuda.synchronize`, `torch.accelerator.synchronize`) with its seconds, by call site;
2. cProfile: per step, functions of vllm / vllm_treewy / torch / triton files and builtins by own and cumulative
   time, the runner's key methods, the adapter's wrappers' own time (`host_profile.WRAPPERS`), and the waiting calls
   (synchronize, item, tolist, cpu, ...) with their callers;
3. sync audit (CUDA only): `torch.cuda.set_sync_debug_mode("warn")`, each warning of a synchronizing op (`.item()`,
   `.tolist()`, a blocking copy, `nonzero`, a stream sync...) recorded with its Python stack, and likewise each
   `non_blocking` copy that blocks the host all the same (a pageable or gapped CPU side: vLLM's own check, which
   torch's misses).

A call site is the innermost frame in vllm/ or vllm_treewy/ (`step_ops.call_site`), with the innermost three such
frames as its chain. Each strategy writes `OUT/<strategy>-k<k>.json` after every pass (and `.prof`, `.log`), so a
crash or a cut keeps what was done; `run` then writes `OUT/host_audit.json` and prints the differences (`diff` alone
does that from the files, anywhere):

    python bench/host/gpu_host_audit.py run --out OUT --strategy-timeout-s 160   # H200: B = 64, 64 tokens, k = 3
    python bench/host/gpu_host_audit.py run --out OUT --batch 2 --max-tokens 4 --engine-batch-sizes 2   # CPU
    python bench/host/gpu_host_audit.py diff --out OUT

The explicit-wait timers replace `torch.Event` by a subclass before the engine starts (vLLM makes its runner's events
then) and wrap the other waits in place, CUDA only: vLLM's CPU backend makes them all no-ops.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import cProfile
import functools
import json
import os
import pstats
import re
import signal
import subprocess
import sys
import time
import traceback
import warnings
from pathlib import Path

from bench.host.host_profile import WRAPPERS, _cumulative
from bench.host.step_ops import SITE_PACKAGES, UNKNOWN_SITE, call_site, python_frames
from bench.host.step_timers import StepTimers

ROOT = Path(__file__).resolve().parents[2]
SUBJECT, BASE = "reconstruct", "store_all"
CHAIN_DEPTH = 3  # innermost vllm / vllm_treewy frames kept per site
PROFILED_PACKAGES = ("torch", "triton")  # besides vllm and vllm_treewy
MIN_FUNCTION_US = 1.0  # per step: functions below this cumulative time are left out of the JSON
SYNC_WARNING = "called a synchronizing"  # torch's message for sync debug mode
# vLLM's message for a non_blocking copy that blocks the host (vllm/utils/gpu_sync_debug.py, _report_implicit_sync)
IMPLICIT_SYNC = re.compile(r"Tensor\.(\w+): a non_blocking (\w+) copy that may be silently synchronous \((.*?)\)")
GPU_SYNC_DEBUG = "vllm/utils/gpu_sync_debug.py"  # its checks' own frames: not call sites
# builtins whose time is (or may be) the host waiting, as cProfile names them
WAITING_BUILTIN = re.compile(r"synchronize|'(item|tolist|cpu|to|copy_|numpy)'|\b(acquire|wait|sleep|select|poll)\b")
RUNNER_METHODS = ("execute_model", "sample_tokens", "_update_states", "_prepare_inputs", "_build_attention_metadata",
                  "_determine_batch_execution_and_padding", "_model_forward", "_sample",
                  "_update_states_after_model_execute", "propose_draft_token_ids", "_bookkeeping_sync",
                  "take_draft_token_ids",
                  # Model Runner V2's (vllm/v1/worker/gpu/model_runner.py); absent names are skipped
                  "update_requests", "add_requests", "gather_batch_req_state", "prepare_inputs", "prepare_attn",
                  "sample", "postprocess_sampled")
STEPS = "runner.execute_model"
# cProfile: (what, file suffix, function); every function of that name in the file counts
KEY_METHODS = (
    *((f"runner.{name}", "worker/gpu_model_runner.py", name) for name in RUNNER_METHODS
      if name != "propose_draft_token_ids"),
    ("runner.propose_draft_token_ids and sample_tokens' closure of that name", "worker/gpu_model_runner.py",
     "propose_draft_token_ids"),
    ("Async*ModelRunnerOutput.get_output", "worker/gpu_model_runner.py", "get_output"),
    ("GDN metadata build (vLLM's)", "backends/gdn_attn.py", "build"),
    ("scheduler.schedule", "core/sched/scheduler.py", "schedule"),
    ("scheduler.update_from_output", "core/sched/scheduler.py", "update_from_output"),
    ("output_processor.process_outputs", "engine/output_processor.py", "process_outputs"),
    ("LLMEngine.step", "engine/llm_engine.py", "step"),
)


# --- call sites and the comparison (pure) ------------------------------------------------------------------------

def package_frames(frames, depth: int = CHAIN_DEPTH) -> tuple[str, ...]:
    """The innermost `depth` of `frames` ((filename, line, function), innermost first) in vllm/ or vllm_treewy/, as
    `step_ops.call_site` names them."""
    sites = []
    for frame in frames:
        site = call_site([frame])
        if site != UNKNOWN_SITE:
            sites.append(site)
            if len(sites) == depth:
                break
    return tuple(sites)


class SiteLog:
    """Events (what, the innermost package frames, seconds) by call site."""

    def __init__(self):
        self.events = collections.Counter()  # (what, frames) -> calls
        self.seconds = collections.Counter()

    def add(self, what: str, frames: tuple[str, ...], seconds: float = 0.0) -> None:
        self.events[what, frames] += 1
        self.seconds[what, frames] += seconds

    def clear(self) -> None:
        self.events.clear()
        self.seconds.clear()

    def by_site(self, steps: int) -> dict:
        return group_by_site(((what, frames, n, self.seconds[what, frames]) for (what, frames), n in
                              self.events.items()), steps)


def group_by_site(events, steps: int) -> dict:
    """`(what, frames innermost first, calls, seconds)` events grouped by call site (innermost frame), per step:
    calls, microseconds, calls of each kind (`what`) and of each chain of frames; busiest site first."""
    sites = {}
    for what, frames, calls, seconds in events:
        site = frames[0] if frames else UNKNOWN_SITE
        entry = sites.setdefault(site, {"calls_per_step": 0.0, "us_per_step": 0.0, "what": {}, "chains": {}})
        entry["calls_per_step"] += calls / steps
        entry["us_per_step"] += 1e6 * seconds / steps
        entry["what"][what] = entry["what"].get(what, 0.0) + calls / steps
        chain = " < ".join(frames) or UNKNOWN_SITE
        entry["chains"][chain] = entry["chains"].get(chain, 0.0) + calls / steps
    return dict(sorted(sites.items(), key=lambda kv: (-kv[1]["calls_per_step"], kv[0])))


def more_in_subject(base: dict, subject: dict, key: str = "calls_per_step", tolerance: float = 0.05) -> list[dict]:
    """Sites (per-step entries of `group_by_site`) where the subject has more `key` per step than the base (by more
    than `tolerance`), largest difference first; `only_in_subject` where the base has none."""
    rows = []
    for site, entry in subject.items():
        theirs = base.get(site, {}).get(key, 0.0)
        if entry[key] - theirs > tolerance:
            rows.append({"site": site, "subject": entry[key], "base": theirs, "difference": entry[key] - theirs,
                         "only_in_subject": site not in base, "chains": entry["chains"]})
    return sorted(rows, key=lambda row: -row["difference"])


def largest_differences(base: dict, subject: dict, value, top: int) -> list[dict]:
    """Keys of either mapping by |value(subject) - value(base)| (a missing key counts 0), largest first."""
    rows = []
    for key in set(base) | set(subject):
        a = value(base[key]) if key in base else 0.0
        b = value(subject[key]) if key in subject else 0.0
        rows.append({"key": key, "base": a, "subject": b, "difference": b - a})
    return sorted(rows, key=lambda row: (-abs(row["difference"]), row["key"]))[:top]


def audit_role(run: dict) -> str:
    """'subject' or 'base': a run's side of the comparison (its `audit_role`; runs written before trees were audited
    have none: reconstruct is the subject, store_all the base)."""
    return run.get("audit_role") or ("subject" if run["strategy"] == SUBJECT else "base")


def run_label(run: dict) -> str:
    """A run's label in the report: its name (its strategy for runs written before names were recorded)."""
    return run.get("name", run["strategy"])


def diff_report(runs: dict, top: int = 20) -> dict:
    """The subject's run (reconstruct's; with --tree-widths the tree's) beside the base's (store_all's; the chain
    of the tree's depth), from their results (the runs' JSON files, by name); None where either lacks the pass."""
    by_role = {audit_role(run): run for run in runs.values()}
    base, subject = by_role.get("base"), by_role.get("subject")
    by_strategy = {run_label(run): run for run in (base, subject) if run is not None}

    def passes(name):
        found = [(r or {}).get("passes", {}).get(name) for r in (base, subject)]
        return found if all(found) else None

    report = {"names": {role: run_label(run) for role, run in by_role.items()},
              "wall_ms_per_step": {s: (r.get("passes", {}).get("timed") or {}).get("wall_ms_per_step")
                                   for s, r in by_strategy.items()},
              "methods": None, "waits": None, "sync_sites": None, "functions": None, "cudagraph_modes": None}
    if timed := passes("timed"):
        report["methods"] = largest_differences(timed[0]["methods"], timed[1]["methods"],
                                                lambda m: m["us_per_step"], top)
        report["waits"] = {"more_in_subject": more_in_subject(timed[0]["waits"], timed[1]["waits"], "us_per_step",
                                                              tolerance=1.0),
                           "more_calls_in_subject": more_in_subject(timed[0]["waits"], timed[1]["waits"])}
        report["cudagraph_modes"] = {run_label(r): t["cudagraph_modes"] for r, t in zip((base, subject), timed)}
    if (audit := passes("sync_audit")) and all(a["available"] for a in audit):
        report["sync_sites"] = more_in_subject(audit[0]["sites"], audit[1]["sites"])
    if profile := passes("profile"):
        report["functions"] = largest_differences(profile[0]["functions"], profile[1]["functions"],
                                                  lambda f: f["cumtime_us"], top)
    return report


def print_report(report: dict) -> None:
    names = report.get("names") or {}
    base, subject = names.get("base", BASE), names.get("subject", SUBJECT)
    print("\nwall per engine step, ms (timed pass):", json.dumps(report["wall_ms_per_step"]))
    if report["methods"]:
        print(f"\nhost us per step (timed pass)      {base:>16} {subject:>20}{'diff':>9}  method")
        for row in report["methods"]:
            print(f"{'':34}{row['base']:10.1f}{row['subject']:12.1f}{row['difference']:+9.1f}  {row['key']}")
    if report["waits"] is not None:
        rows = report["waits"]["more_in_subject"]
        print(f"\nexplicit waits, us per step more in {subject} (timed pass): {len(rows)} sites")
        for row in rows:
            print(f"  {row['base']:10.1f}{row['subject']:10.1f}{row['difference']:+9.1f}  {row['site']}"
                  f"{'  (only here)' if row['only_in_subject'] else ''}")
        for row in report["waits"]["more_calls_in_subject"]:
            print(f"  calls/step {row['base']:.2f} -> {row['subject']:.2f}  {row['site']}")
    if report["sync_sites"] is None:
        print("\nsync audit: not in both strategies' results (it needs CUDA)")
    else:
        print(f"\nsynchronizing ops per step more in {subject}: {len(report['sync_sites'])} sites")
        for row in report["sync_sites"]:
            print(f"  {row['base']:6.2f} -> {row['subject']:6.2f}  {row['site']}"
                  f"{'  (only here)' if row['only_in_subject'] else ''}")
            for chain in list(row["chains"])[:2]:
                print(f"      {chain}")
    if report["functions"]:
        print(f"\ncProfile cumulative us per step  {base:>16} {subject:>20}{'diff':>9}  function")
        for row in report["functions"]:
            print(f"{'':32}{row['base']:10.1f}{row['subject']:12.1f}{row['difference']:+9.1f}  {row['key']}")
    if report["cudagraph_modes"]:
        for strategy, modes in report["cudagraph_modes"].items():
            print(f"\nCUDA graph modes per step, {strategy}: {json.dumps(modes)}")


# --- instruments, in the engine's process --------------------------------------------------------------------------

def timed_wait(log: SiteLog, what: str, wait):
    """`wait` (a synchronize) that logs its call site and seconds."""
    @functools.wraps(wait)
    def logged(*args, **kwargs):
        start = time.perf_counter()
        try:
            return wait(*args, **kwargs)
        finally:
            log.add(what, package_frames(python_frames(sys._getframe(1))), time.perf_counter() - start)

    return logged


def install_wait_timers(log: SiteLog) -> list[str]:
    """CUDA: every explicit wait on the GPU from Python goes to `log`; before the engine starts (vLLM makes its runner's
    `torch.Event`s at start-up). Returns what it wraps."""
    import torch

    class LoggedEvent(torch.Event):
        synchronize = timed_wait(log, "torch.Event.synchronize", torch.Event.synchronize)

    torch.Event = LoggedEvent
    torch.cuda.Event.synchronize = timed_wait(log, "torch.cuda.Event.synchronize", torch.cuda.Event.synchronize)
    torch.cuda.Stream.synchronize = timed_wait(log, "torch.cuda.Stream.synchronize", torch.cuda.Stream.synchronize)
    torch.cuda.synchronize = timed_wait(log, "torch.cuda.synchronize", torch.cuda.synchronize)
    torch.accelerator.synchronize = timed_wait(log, "torch.accelerator.synchronize", torch.accelerator.synchronize)
    return ["torch.Event.synchronize", "torch.cuda.Event.synchronize", "torch.cuda.Stream.synchronize",
            "torch.cuda.synchronize", "torch.accelerator.synchronize"]


@contextlib.contextmanager
def sync_warnings(log: SiteLog):
    """Within (CUDA): torch's sync debug mode warns, and so do vLLM's checks of `non_blocking` copies that block the
    host all the same (`vllm.utils.gpu_sync_debug`, VLLM_GPU_SYNC_CHECK's; they stay installed: run this last);
    each goes to `log` with its Python stack. Yields what vLLM's copy checks came to ("on", or why not)."""
    import torch

    shown = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None):
        text = str(message)
        implicit = IMPLICIT_SYNC.match(text)
        if implicit is None and not text.startswith(SYNC_WARNING):
            return shown(message, category, filename, lineno, file, line)
        what = "sync warning" if implicit is None else "implicit sync: Tensor.{} {} ({})".format(*implicit.groups())
        stack = reversed(traceback.extract_stack()[:-1])
        log.add(what, package_frames((f.filename, f.lineno, f.name) for f in stack
                                     if not f.filename.endswith(GPU_SYNC_DEBUG)))

    with warnings.catch_warnings(), implicit_copy_checks() as copy_checks:
        warnings.filterwarnings("always", message=SYNC_WARNING)
        warnings.filterwarnings("always", message=IMPLICIT_SYNC.pattern)
        warnings.showwarning = show
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield copy_checks
        finally:
            torch.cuda.set_sync_debug_mode("default")


@contextlib.contextmanager
def implicit_copy_checks():
    """vLLM's copy checks, on for this thread within (its private switches, as of vLLM 0.32)."""
    try:
        from vllm.utils import gpu_sync_debug

        gpu_sync_debug._install_copy_checkers()
        checking = gpu_sync_debug._checking.set("warn")
        gpu_sync_debug._sync_check_enabled = True
    except Exception as e:  # torch's own check still runs
        yield f"unavailable: {e!r}"
        return
    try:
        yield "on"
    finally:
        gpu_sync_debug._sync_check_enabled = False
        gpu_sync_debug._checking.reset(checking)


def in_process_runner(llm):
    """(scheduler, model runner) of an in-process engine; raises if the engine core runs in another process."""
    try:
        core = llm.llm_engine.engine_core.engine_core
        return core.scheduler, core.model_executor.driver_worker.worker.model_runner
    except AttributeError as e:
        raise RuntimeError("the engine core does not run in this process (VLLM_ENABLE_V1_MULTIPROCESSING must be 0): "
                           "the audit needs the model runner here") from e


def install_step_timers(timers: StepTimers, llm, scheduler, runner) -> list[str]:
    """Times the engine's step methods; returns the labels of those it did not find."""
    from vllm.v1.attention.backends.gdn_attn import GDNAttentionMetadataBuilder
    from vllm.v1.worker import gpu_model_runner

    from vllm_treewy.vllm_plugin.v1 import accepted_counts
    from vllm_treewy.vllm_plugin.gdn import step_metadata

    targets = [(llm.llm_engine, "step", "LLMEngine.step"),
               (llm.llm_engine.output_processor, "process_outputs", "output_processor.process_outputs"),
               (scheduler, "schedule", "scheduler.schedule"),
               (scheduler, "update_from_output", "scheduler.update_from_output"),
               *((runner, name, f"runner.{name}") for name in RUNNER_METHODS),
               (gpu_model_runner.AsyncGPUModelRunnerOutput, "get_output", "AsyncGPUModelRunnerOutput.get_output"),
               (GDNAttentionMetadataBuilder, "build", "GDN metadata build (vLLM's and the adapter's)"),
               (step_metadata, "with_commit_nodes", "adapter: with_commit_nodes"),
               (accepted_counts, "record_chain_accepted_counts", "adapter: record_chain_accepted_counts"),
               (getattr(runner, "speculator", None), "propose", "V2 speculator.propose")]
    timers.record_cudagraph_modes(runner)  # before the runner's timer wraps the same method
    return [label for owner, name, label in targets if not timers.wrap(owner, name, label)]


def function_label(path: str, line: int, name: str) -> str | None:
    """A cProfile function's label: `package/path.py:line name` in vllm or vllm_treewy (first: vllm_treewy has a
    triton/ folder), else in torch or triton; `builtin name`; None elsewhere."""
    if path == "~":
        return f"builtin {name}"
    for packages in (SITE_PACKAGES, PROFILED_PACKAGES):
        site = call_site([(path, line, name)], packages)
        if site != UNKNOWN_SITE:
            return site
    return None


def heaviest_caller(stats: pstats.Stats, key):
    """The caller that spent the most time in `key` (None for none)."""
    callers = stats.stats.get(key, (0, 0, 0, 0, {}))[4]
    return max(callers, key=lambda caller: callers[caller][3]) if callers else None


def caller_chain(stats: pstats.Stats, key, depth: int = CHAIN_DEPTH) -> list[str]:
    """Labels of `key` and its heaviest callers outwards (`depth` of them), through this script's own wrappers."""
    chain = []
    for _ in range(4 * depth):  # bounded: wrappers may nest, recursion may loop
        if key is None or len(chain) == depth:
            break
        if Path(key[0]).name != Path(__file__).name:
            chain.append(function_label(*key) or f"{Path(key[0]).name}:{key[1]} {key[2]}")
        key = heaviest_caller(stats, key)
    return chain


def profile_summary(stats: pstats.Stats, steps: int, top: int) -> dict:
    """cProfile's figures per engine step (microseconds)."""
    us = 1e6 / steps
    functions = {}
    for (path, line, name), (_, calls, tottime, cumtime, _) in stats.stats.items():
        label = function_label(path, line, name)
        if label is not None and cumtime * us >= MIN_FUNCTION_US:
            entry = functions.setdefault(label, {"calls": 0.0, "tottime_us": 0.0, "cumtime_us": 0.0})
            entry["calls"] += calls / steps
            entry["tottime_us"] += tottime * us
            entry["cumtime_us"] += cumtime * us
    waiting = []
    for key, (_, calls, tottime, _, callers) in stats.stats.items():
        if key[0] == "~" and WAITING_BUILTIN.search(key[2]) and tottime * us >= MIN_FUNCTION_US:
            by_caller = sorted(callers.items(), key=lambda kv: -kv[1][2])[:5]
            waiting.append({"function": key[2], "calls": calls / steps, "tottime_us": tottime * us, "callers": [
                {"chain": caller_chain(stats, caller), "calls": edge[0] / steps, "tottime_us": edge[2] * us}
                for caller, edge in by_caller]})
    wrappers = {}
    for what, wrapper, original in WRAPPERS:
        calls, total = _cumulative(stats, *wrapper)
        wrappers[what] = {"calls": calls / steps, "own_us": (total - _cumulative(stats, *original)[1]) * us}
    key_methods = {}
    for what, suffix, name in KEY_METHODS:
        calls, total = _cumulative(stats, suffix, name)
        key_methods[what] = {"calls": calls / steps, "cumtime_us": total * us}
    return {
        "top_tottime": sorted(functions.items(), key=lambda kv: -kv[1]["tottime_us"])[:top],
        "top_cumtime": sorted(functions.items(), key=lambda kv: -kv[1]["cumtime_us"])[:top],
        "key_methods": key_methods, "wrappers": wrappers,
        "waiting_calls": sorted(waiting, key=lambda w: -w["tottime_us"]), "functions": functions,
    }


# --- roles ---------------------------------------------------------------------------------------------------------

def engine_args(args) -> argparse.Namespace:
    """`gpu_vllm_e2e`'s engine options at its defaults, but for what this script's options set."""
    from bench.e2e import gpu_vllm_e2e

    parser = argparse.ArgumentParser()
    gpu_vllm_e2e.add_common_args(parser, runs=False)
    options = parser.parse_args([])
    options.batch_sizes = args.engine_batch_sizes or options.batch_sizes
    for name in ("max_tokens", "eager", "no_async_scheduling", "cudagraph_mode", "max_num_batched_tokens"):
        setattr(options, name, getattr(args, name))
    return options


def run_name(strategy: str, k: int, tree_widths=None) -> str:
    return f"{strategy}-tree{''.join(map(str, tree_widths))}" if tree_widths else f"{strategy}-k{k}"


def write_json(path: Path, data) -> None:
    """Whole or not at all (a cut call leaves the previous pass's file)."""
    partial = path.with_suffix(".partial")
    partial.write_text(json.dumps(data, indent=1) + "\n")
    os.replace(partial, path)


def run_strategy(args) -> int:
    """One engine: warm-up, then the timed, cProfile and sync-audit generates; the JSON after every pass."""
    import torch

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = run_name(args.strategy, args.k, args.tree_widths)
    cuda = torch.cuda.is_available()
    waits = SiteLog()
    result = {"name": name, "strategy": args.strategy, "k": args.k, "tree_widths": args.tree_widths,
              "audit_role": args.audit_role, "blurred_mtp": args.blurred_mtp, "batch": args.batch,
              "max_tokens": args.max_tokens,
              "wait_timers": install_wait_timers(waits) if cuda else "none: vLLM's CPU backend makes waits no-ops",
              "passes": {}, "errors": {}}

    import vllm_treewy.vllm_plugin as plugin  # vLLM after the wait timers
    from bench.e2e import gpu_site, gpu_vllm_e2e
    from vllm_treewy.vllm_plugin.testing.equivalence import engine, generate_greedy

    gpu_site.seed_model_info_cache()
    plugin.register()
    model, prompts = gpu_vllm_e2e.tree_model(args)
    prompts = prompts[: args.batch]
    options = engine_args(args)
    if args.batch > max(options.batch_sizes):
        raise SystemExit(f"--batch {args.batch} exceeds the engine's max_num_seqs {max(options.batch_sizes)}")
    spec = {"method": "mtp", "num_speculative_tokens": args.k, "mamba_state_commit": args.strategy,
            **gpu_site.SPECULATIVE}
    tokens_per_request = 1 + args.k
    if args.tree_widths:
        from vllm_treewy.tree import DraftTree

        spec.update(num_speculative_tokens=len(args.tree_widths), draft_tree_widths=list(args.tree_widths))
        tokens_per_request = 1 + DraftTree.from_widths(args.tree_widths).num_nodes
    timers = StepTimers()
    start = time.perf_counter()
    with engine(model, speculative_config=spec, **gpu_vllm_e2e.engine_kwargs(options, tokens_per_request)) as llm:
        result["engine_start_s"] = time.perf_counter() - start
        result.update(gpu_vllm_e2e.device_facts())
        scheduler, runner = in_process_runner(llm)
        result["not_timed"] = install_step_timers(timers, llm, scheduler, runner)

        def generate() -> tuple[int, float]:
            """(engine steps, wall seconds) of one generate of the audited batch."""
            timers.clear()
            waits.clear()
            start = time.perf_counter()
            generate_greedy(llm, prompts, [args.max_tokens] * len(prompts))
            wall = time.perf_counter() - start
            steps = timers.calls[STEPS]
            if steps == 0:
                raise RuntimeError("no execute_model call in this process: the runner runs elsewhere")
            return steps, wall

        def audited(pass_name: str, body) -> None:
            try:
                result["passes"][pass_name] = body()
            except Exception:  # the other passes still run
                result["errors"][pass_name] = traceback.format_exc()
                print(result["errors"][pass_name], flush=True)
            write_json(out / f"{name}.json", result)

        def timed() -> dict:
            steps, wall = generate()
            return {"steps": steps, "wall_s": wall, "wall_ms_per_step": 1e3 * wall / steps,
                    "output_tokens": args.batch * args.max_tokens, "methods": timers.per_step(steps),
                    "waits": waits.by_site(steps), "cudagraph_modes": {
                        mode: n / steps for mode, n in timers.cudagraph_modes.most_common()}}

        def sync_audit() -> dict:
            if not cuda:
                return {"available": False, "reason": "torch.cuda.set_sync_debug_mode needs CUDA"}
            sites = SiteLog()
            with sync_warnings(sites) as copy_checks:
                steps, wall = generate()
            return {"available": True, "implicit_copy_checks": copy_checks, "steps": steps, "wall_s": wall,
                    "sites": sites.by_site(steps), "waits": waits.by_site(steps)}

        def profiled() -> dict:
            profiler = cProfile.Profile()
            profiler.enable()
            try:
                steps, wall = generate()
            finally:
                profiler.disable()
            profiler.dump_stats(str(out / f"{name}.prof"))
            return {"steps": steps, "wall_s": wall, "wall_ms_per_step": 1e3 * wall / steps,
                    **profile_summary(pstats.Stats(profiler), steps, args.top)}

        audited("warm_up", lambda: dict(zip(("steps", "wall_s"), generate())))
        audited("timed", timed)
        audited("profile", profiled)
        audited("sync_audit", sync_audit)  # last: vLLM's copy checks stay installed
    print(name, "done:", json.dumps({p: {k: v for k, v in r.items() if k in ("steps", "wall_ms_per_step")}
                                     for p, r in result["passes"].items()}), flush=True)
    return 1 if result["errors"] else 0


def audit_args(args) -> list[str]:
    """This invocation's options for a `strategy` process (all but the tree and the role, which `run_all` sets)."""
    argv = ["--out", args.out, "--k", str(args.k), "--batch", str(args.batch), "--max-tokens", str(args.max_tokens),
            "--top", str(args.top)]
    if args.blurred_mtp:
        argv.append("--blurred-mtp")
    if args.engine_batch_sizes:
        argv += ["--engine-batch-sizes", *map(str, args.engine_batch_sizes)]
    for flag in ("eager", "no_async_scheduling"):
        if getattr(args, flag):
            argv.append("--" + flag.replace("_", "-"))
    for option in ("cudagraph_mode", "max_num_batched_tokens"):
        if getattr(args, option) is not None:
            argv += ["--" + option.replace("_", "-"), str(getattr(args, option))]
    return argv


def audited_runs(args) -> list[tuple[str, list[str]]]:
    """(run name, `strategy` options) per engine: each of `--strategies` (reconstruct the subject, store_all the
    base); with `--tree-widths`, the reconstruct tree (subject, on V2) and the reconstruct chain of its depth (base)."""
    if args.tree_widths:
        depth = len(args.tree_widths)
        tree = ["--tree-widths", *map(str, args.tree_widths)]
        return [(run_name(SUBJECT, depth, args.tree_widths),
                 ["--strategy", SUBJECT, *tree, "--audit-role", "subject"]),
                (run_name(SUBJECT, depth), ["--strategy", SUBJECT, "--audit-role", "base"])]
    return [(run_name(strategy, args.k), ["--strategy", strategy, "--audit-role",
                                          "subject" if strategy == SUBJECT else "base"])
            for strategy in args.strategies]


def run_all(args) -> int:
    """One `strategy` process per run (`audited_runs`), one after another (each cut at `--strategy-timeout-s`), then
    `diff`."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))  # stops the running strategy too
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    started = time.monotonic()
    processes = {}
    for name, options in audited_runs(args):
        print(f"=== {name} at {time.monotonic() - started:.0f} s", flush=True)
        begun = time.monotonic()
        with open(out / f"{name}.log", "w") as log:
            # in this process group: whatever stops the call stops it too
            argv = audit_args(args)
            if args.tree_widths:  # the chain's k: the tree's depth
                argv[argv.index("--k") + 1] = str(len(args.tree_widths))
            proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "strategy", *options, *argv],
                                    cwd=ROOT, env=env, stdout=log,
                                    stderr=subprocess.STDOUT)
            try:
                rc = proc.wait(timeout=args.strategy_timeout_s)
            except subprocess.TimeoutExpired:
                rc = "cut at its time limit"
            finally:  # also when this process is stopped
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
        processes[name] = {"rc": rc, "seconds": time.monotonic() - begun}
        print(f"=== {name} rc={rc} after {processes[name]['seconds']:.0f} s", flush=True)
    return run_diff(args, processes)


def run_diff(args, processes: dict | None = None) -> int:
    """`host_audit.json` and the table, from the strategies' files under `--out` (no engine)."""
    out = Path(args.out)
    runs = {path.stem: json.loads(path.read_text()) for path in sorted(out.glob("*.json"))
            if path.name != "host_audit.json"}
    first = next(iter(runs.values()), {})
    report = {"command": args.command or " ".join([sys.executable, *sys.argv]),
              "device": {k: first.get(k) for k in ("device", "nvidia_smi", "torch", "vllm", "python",
                                                   "compiled_mtp_kernel") if k in first},
              "processes": processes, "runs": runs, "diff": diff_report(runs, args.top_diff)}
    write_json(out / "host_audit.json", report)
    for name, run in runs.items():
        print(f"{name}: passes {sorted(run['passes'])}, errors in {sorted(run['errors'])}")
    print_report(report["diff"])
    complete = {audit_role(run) for run in runs.values() if not run["errors"] and "profile" in run["passes"]}
    return 0 if {"base", "subject"} <= complete else 1


def add_audit_args(parser) -> None:
    parser.add_argument("--out", required=True, help="folder of the per-strategy files and host_audit.json")
    parser.add_argument("--k", type=int, default=3, help="MTP drafts per step")
    parser.add_argument("--batch", type=int, default=64, help="prompts of the audited generate")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--engine-batch-sizes", type=int, nargs="+", default=None,
                        help="what the engine is built for (max_num_seqs, CUDA graph sizes); default: "
                             "gpu_vllm_e2e's --batch-sizes default, as in its profiles")
    parser.add_argument("--top", type=int, default=40, help="functions per cProfile table")
    parser.add_argument("--eager", action="store_true", help="enforce_eager (a second opinion)")
    parser.add_argument("--no-async-scheduling", action="store_true", help="a second opinion: vLLM's sync scheduler")
    parser.add_argument("--cudagraph-mode", default=None, help="default: vLLM's (FULL_AND_PIECEWISE)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=None, help="default: vLLM's")
    parser.add_argument("--blurred-mtp", action="store_true",
                        help="the fixture's blurred-MTP variant (same target; its head right about half the time)")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="role", required=True)
    run = sub.add_parser("run", help="every strategy, one process each, then diff")
    add_audit_args(run)
    run.add_argument("--strategies", nargs="+", default=[SUBJECT, BASE], choices=[SUBJECT, BASE])
    run.add_argument("--tree-widths", type=int, nargs="+", default=None,
                     help="audit the reconstruct MTP tree of these widths on V2 against the reconstruct chain of its "
                          "depth (instead of --strategies)")
    run.add_argument("--strategy-timeout-s", type=float, default=None,
                     help="a strategy's process is cut (its files so far kept) after this long")
    run.add_argument("--command", default=None, help="the whole shell command, for the report")
    run.add_argument("--top-diff", type=int, default=20)
    strategy = sub.add_parser("strategy", help="one engine's audit (run starts these)")
    add_audit_args(strategy)
    strategy.add_argument("--strategy", required=True, choices=[SUBJECT, BASE])
    strategy.add_argument("--tree-widths", type=int, nargs="+", default=None,
                          help="an MTP tree (on V2) of these widths")
    strategy.add_argument("--audit-role", choices=["subject", "base"], default=None)
    diff = sub.add_parser("diff", help="host_audit.json and the table from the files under --out")
    diff.add_argument("--out", required=True)
    diff.add_argument("--command", default=None)
    diff.add_argument("--top-diff", type=int, default=20)
    args = parser.parse_args(argv)
    roles = {"run": run_all, "strategy": run_strategy, "diff": run_diff}
    return roles[args.role](args)


if __name__ == "__main__":
    if sys.argv[1:2] == ["strategy"]:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the runner in this process: what the audit reads
    raise SystemExit(main())
