"""Runs one grid through vLLM's `vllm bench sweep serve`, then the report.

    python -m bench.sweep run cpu --out bench/results/sweeps/cpu

Writes under OUT: `model/` and `workloads/` (generated), `params/serve.json` and `params/bench.json` (the grid
in vLLM's sweep format), `raw/GRID/...` (vLLM's per-point result JSON, each with our server figures),
`sweep.log` (everything the sweep, the servers and the benchmarks printed), `command.json` (the commands, the
grid and the machine), then the report (`report.py`). Progress (point i of n, elapsed, the point's headline
figures) goes to stdout while the grid runs.

An OUT that already holds results resumes: vLLM's sweep skips every point whose result exists.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import platform
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from bench.e2e.gpu_site import plugin_metadata_dir
from bench.sweep.grids import GRIDS, Grid
from bench.sweep.models import prepare_model
from bench.sweep.workloads import write_workloads

HOST = "127.0.0.1"
REPO_ROOT = Path(__file__).resolve().parents[2]
WORKER_READY_TIMEOUT_S = 300
SERVER_READY_TIMEOUT_S = 900  # the H200's first start compiles for minutes; a CPU start takes about one


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def vllm_cli() -> list[str]:
    """The `vllm` console script beside this interpreter, else the module (the H200 site has no script)."""
    script = Path(sys.executable).parent / "vllm"
    return [str(script)] if script.exists() else [sys.executable, "-m", "vllm.entrypoints.cli.main"]


# A profiled point (`--points NAME-profile`): NAME's workload, one request per concurrency slot, with vLLM's torch
# profiler started by the benchmark (`--profile`) and recording PROFILE_STEPS engine steps after PROFILE_DELAY_STEPS
# (past the first wave's prefills, while the batch decodes). It runs after the measured points it is listed after,
# so the profiler never runs during a measured point; the report leaves it out. The server writes the per-kernel
# table (`*.profiler_out.txt`, device time) and the trace under OUT/profiles/SERVER/.
PROFILE_DELAY_STEPS = 100
PROFILE_STEPS = 10


def profiled_point(point: dict) -> dict:
    return {**point, "_benchmark_name": f"{point['_benchmark_name']}-profile", "profile": True,
            "num_prompts": point["max_concurrency"]}  # fmt: skip


def profiler_config(trace_dir: Path) -> dict:
    """vLLM's `--profiler-config` for profiled points: the torch profiler in the engine only (the front end
    records no steps), without Python stacks; idle until a benchmark with `--profile` starts it."""
    return {"profiler": "torch", "torch_profiler_dir": str(trace_dir), "delay_iterations": PROFILE_DELAY_STEPS,
            "max_iterations": PROFILE_STEPS, "ignore_frontend": True, "torch_profiler_with_stack": False}  # fmt: skip


@dataclasses.dataclass
class SweepPlan:
    grid: Grid
    out: Path
    port: int
    serve_cmd: list[str]
    bench_cmd: list[str]
    after_bench_cmd: list[str]
    sweep_cmd: list[str]
    env: dict
    num_points: int
    worker_socket: str | None  # the warm benchmark worker's socket, None: one process per point


def plan_sweep(grid: Grid, out: Path, *, only_servers: list[str] | None = None, only_points: list[str] | None = None,
               port: int | None = None, dry_run: bool = False, show_bench_progress: bool = False,
               warm_worker: bool = True, model_dir: Path | None = None) -> SweepPlan:  # fmt: skip
    """Prepares the model, the workload files and vLLM's parameter files; returns the commands to run. `only_servers`
    picks servers and the order vLLM's sweep starts them in (the first start of a call is the cold one);
    `only_points` picks benchmark points and their order (the decisive ones first, before a call's limit).
    `model_dir` (default OUT/model): where the model files go; the model's path is part of vLLM's torch.compile
    cache key, so runs that share it start warm after the first."""
    out = out.resolve()
    model = prepare_model(grid.model, (model_dir or out / "model").resolve())
    workload_data = write_workloads(out / "workloads", grid.lengths, model.text, grid.workloads)

    serve_params = _selected(grid.serve_params(), only_servers, "server", grid.name)
    points = grid.bench_params(workload_data)
    if only_points:  # profiled points run only where named
        points += [profiled_point(p) for p in points]
    bench_params = _selected(points, only_points, "point", grid.name)
    if any(p.get("profile") for p in bench_params):
        for record in serve_params:  # each server its own trace directory (the table's file name is per worker)
            record["profiler_config"] = profiler_config(out / "profiles" / record["_benchmark_name"])
    params_dir = out / "params"
    params_dir.mkdir(parents=True, exist_ok=True)
    (params_dir / "serve.json").write_text(json.dumps(serve_params, indent=1) + "\n")
    (params_dir / "bench.json").write_text(json.dumps(bench_params, indent=1) + "\n")

    port = port or free_port()
    base_url = f"http://{HOST}:{port}"
    load_format = () if model.load_format == "auto" else ("--load-format", model.load_format)
    tokenizer = () if model.tokenizer is None else ("--tokenizer", str(model.tokenizer))
    serve_cmd = [*vllm_cli(), "serve", str(model.path), *grid.serve_flags, *load_format, *tokenizer,
                 "--host", HOST, "--port", str(port)]  # fmt: skip
    worker_socket = f"/tmp/treewy-sweep-bench-{os.getpid()}-{port}.sock" if warm_worker and not dry_run else None
    bench_cmd = [sys.executable, "-m", "bench.sweep.point", *(("--worker", worker_socket) if worker_socket else ()),
                 "--backend", "vllm", "--model", str(model.path), *tokenizer, "--host", HOST, "--port", str(port),
                 *grid.bench_flags]  # fmt: skip
    if not show_bench_progress:
        bench_cmd.append("--disable-tqdm")
    after_bench_cmd = [sys.executable, "-m", "bench.sweep.metrics", "reset-caches", base_url]
    raw = out / "raw"
    sweep_cmd = [
        *vllm_cli(), "bench", "sweep", "serve",
        "--serve-cmd", shlex.join(serve_cmd),
        "--bench-cmd", shlex.join(bench_cmd),
        "--after-bench-cmd", shlex.join(after_bench_cmd),
        "--serve-params", str(params_dir / "serve.json"),
        "--bench-params", str(params_dir / "bench.json"),
        "--output-dir", str(raw),
        "--experiment-name", grid.name,
        "--num-runs", "1",
        "--server-ready-timeout", str(SERVER_READY_TIMEOUT_S),
        # A point that fails is recorded and skipped; the report lists it.
        "--continue-on-error",
        "--show-stdout",
    ]  # fmt: skip
    if (raw / grid.name).exists():
        sweep_cmd.append("--resume")
    if dry_run:
        sweep_cmd.append("--dry-run")

    env = dict(os.environ, **grid.env)
    # The benchmark and reset commands import bench.sweep: the repository root must be importable. A server needs
    # the plugin's entry point, which a source tree on PYTHONPATH (the H200 site) lacks.
    plugin_metadata = plugin_metadata_dir(out / "plugin-metadata")
    env["PYTHONPATH"] = os.pathsep.join(
        str(p) for p in (REPO_ROOT, plugin_metadata, env.get("PYTHONPATH", "")) if p)
    # A server runs its engine core in its own process, as deployed (the in-process engine is for tests).
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    env.setdefault("PYTHONUNBUFFERED", "1")
    env.setdefault("TRITON_PRINT_AUTOTUNING", "1")  # the start-up's autotuning in server_starts.json
    return SweepPlan(grid, out, port, serve_cmd, bench_cmd, after_bench_cmd, sweep_cmd, env,
                     len(serve_params) * len(bench_params), worker_socket)  # fmt: skip


@contextlib.contextmanager
def bench_worker(plan: SweepPlan, log_path: Path):
    """The warm benchmark worker (bench.sweep.point.serve_points) for the sweep's duration."""
    if plan.worker_socket is None:
        yield None
        return
    socket_path = Path(plan.worker_socket)
    socket_path.unlink(missing_ok=True)
    with open(log_path, "a") as log:
        proc = subprocess.Popen([sys.executable, "-m", "bench.sweep.point", "--serve-worker", plan.worker_socket],
                                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=plan.env,
                                cwd=REPO_ROOT)  # fmt: skip
    try:
        deadline = time.monotonic() + WORKER_READY_TIMEOUT_S
        while not socket_path.exists():
            if proc.poll() is not None:
                raise RuntimeError(f"bench worker exited with {proc.returncode}; see {log_path}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"bench worker not ready after {WORKER_READY_TIMEOUT_S} s; see {log_path}")
            time.sleep(0.5)
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
        socket_path.unlink(missing_ok=True)


def _fmt_duration(seconds: float) -> str:
    minutes, seconds = divmod(int(seconds), 60)
    return f"{minutes}m{seconds:02d}s"


def point_headline(result_path: Path) -> str:
    """The figures progress prints once a point is done."""
    try:
        r = json.loads(result_path.read_text())
    except (OSError, ValueError):
        return "(no result file)"
    parts = [f"{r.get('output_throughput', float('nan')):.1f} tok/s",
             f"TTFT p99 {r.get('p99_ttft_ms', float('nan')):.0f} ms",
             f"TPOT {r.get('mean_tpot_ms', float('nan')):.1f} ms",
             f"running<= {r.get('server_peak_running_requests')}",
             f"preempted {r.get('server_preemptions')}",
             f"KV<= {100 * (r.get('server_peak_kv_cache_usage') or 0):.0f}%"]  # fmt: skip
    if r.get("spec_decode_acceptance_length") is not None:
        parts.append(f"accept len {r['spec_decode_acceptance_length']:.2f}")
    if r.get("failed"):
        parts.append(f"FAILED REQUESTS {r['failed']}")
    return ", ".join(parts)


_NAME = re.compile(r"'_benchmark_name': '([^']+)'")
# What a server's log says about its start-up (vLLM 0.32's lines), as (field, pattern); a field of a drafter or other
# compiled module gets its name as a prefix ("[eagle_head] torch.compile took ...": eagle_head_torch_compile_s).
_START_PHASES = (
    ("torch_compile_s", re.compile(r"\[(\w+)\] torch\.compile took ([\d.]+) s in total")),
    ("profile_run_s", re.compile(r"\[(\w+)\] Initial profiling/warmup run took ([\d.]+) s")),
    ("model_load_s", re.compile(r"Model loading took [\d.]+ GiB memory and ([\d.]+) seconds")),
    ("jit_warmup_s", re.compile(r"JIT kernel warmup finished in ([\d.]+)s")),
    ("graph_capture_s", re.compile(r"Graph capturing finished in ([\d.]+) secs")),
    ("init_engine_s", re.compile(r"init engine \(profile, create kv cache, warmup model\) took ([\d.]+) s")),
    ("kv_cache_max_concurrency", re.compile(r"Maximum concurrency for [\d,]+ tokens per request: ([\d.]+)x")),
)
_READY = "Application startup complete."
# Triton's autotuner, with TRITON_PRINT_AUTOTUNING=1 (the plan's servers run with it), reports each tuning it does in
# a process (not one it read from TRITON_CACHE_AUTOTUNING's cache) over four lines: the kernel's name on the first,
# its benchmarking seconds on the third.
_AUTOTUNE_NAME = re.compile(r"Triton autotuning for function (\w+),")
_AUTOTUNE_TIME = re.compile(r"finished after ([\d.]+)s,")


class ServerStarts:
    """Each server's start-up as the sweep ran it: wall seconds from vLLM's sweep announcing the server to its API
    server's "Application startup complete." (`ready_s`), the phases the engine logs (`_START_PHASES`), and its
    place among the call's starts (the first start of a call is the cold one: the device starts bare), and the Triton
    autotuning it did before it was ready (`autotune_s`: the benchmarking seconds Triton reports, summed;
    `autotune_kernels`: tunings per kernel). Kept in OUT/server_starts.json, appended call by call."""

    def __init__(self, path: Path, call: str):
        self.path = path
        self.call = call
        self.records = json.loads(path.read_text()) if path.exists() else []
        self.current: dict | None = None
        self.started = 0.0
        self.order = 0
        self.tuning: str | None = None  # the kernel whose autotuning report is being read

    def server(self, name: str, now: float) -> None:
        self.order += 1
        self.current = {"server": name, "call": self.call, "start_in_call": self.order, "autotune_s": 0.0,
                        "autotune_kernels": {}}
        self.started = now
        self.tuning = None

    def line(self, text: str, now: float) -> None:
        if self.current is None or "ready_s" in self.current:
            return
        for field, pattern in _START_PHASES:
            match = pattern.search(text)
            if match:
                *module, value = match.groups()
                key = field if not module or module[0] == "backbone" else f"{module[0]}_{field}"
                self.current[key] = float(value)
        if match := _AUTOTUNE_NAME.search(text):
            self.tuning = match.group(1)
        elif self.tuning is not None and (match := _AUTOTUNE_TIME.search(text)):
            self.current["autotune_s"] = round(self.current["autotune_s"] + float(match.group(1)), 2)
            kernels = self.current["autotune_kernels"]
            kernels[self.tuning] = kernels.get(self.tuning, 0) + 1
            self.tuning = None
        if _READY in text:
            self.current["ready_s"] = round(now - self.started, 1)
            self.records.append(self.current)
            self.path.write_text(json.dumps(self.records, indent=1) + "\n")


def run_sweep(plan: SweepPlan, log_path: Path, echo=print) -> int:
    """Runs vLLM's sweep, logging all it prints and echoing progress; returns its exit status."""
    start = time.monotonic()
    with bench_worker(plan, log_path.with_name("bench_worker.log")), open(log_path, "a") as log, subprocess.Popen(
        plan.sweep_cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, text=True,
        env=plan.env, cwd=REPO_ROOT, errors="replace",
    ) as proc:  # fmt: skip
        try:
            _follow(proc, plan, log, log_path, start, echo)
        except BaseException:
            # SIGINT lets vLLM's sweep leave its server context, which kills the server's process group (the
            # servers run in their own sessions: nothing else would stop them).
            proc.send_signal(signal.SIGINT)
            proc.wait(timeout=120)
            raise
        finally:
            # A server interrupted in its start can outlive vLLM's sweep and hold the GPU for the next run.
            stop_servers(plan.serve_cmd)
        returncode = proc.wait()
    echo(f"[sweep] finished in {_fmt_duration(time.monotonic() - start)} with exit status {returncode}", flush=True)
    return returncode


def server_pids(serve_cmd: list[str]) -> list[int]:
    """The processes running this plan's `vllm serve` (its arguments, port included, as the sweep starts it)."""
    prefix = "\0".join(serve_cmd[serve_cmd.index("serve"):]).encode()
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            with contextlib.suppress(OSError):
                if prefix in (entry / "cmdline").read_bytes():
                    found.append(int(entry.name))
    return found


def stop_servers(serve_cmd: list[str], grace_s: float = 20.0) -> list[int]:
    """Ends the process group (server and engine core) of every process `server_pids` finds: SIGTERM, then
    SIGKILL after `grace_s`. Returns the pids it found."""
    pids = server_pids(serve_cmd)
    groups = set()
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            groups.add(os.getpgid(pid))
    groups.discard(os.getpgrp())  # never our own group (a server the sweep starts has its own session)
    for group in groups:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(group, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while groups and time.monotonic() < deadline and server_pids(serve_cmd):
        time.sleep(0.5)
    for group in groups:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(group, signal.SIGKILL)
    return pids


def _follow(proc, plan: SweepPlan, log, log_path: Path, start: float, echo) -> None:
    done = 0
    server = point = "?"
    result_path = None
    starts = ServerStarts(plan.out / "server_starts.json", time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    for line in proc.stdout:  # ends when the sweep exits (the servers it starts are in their own sessions)
        log.write(line)
        text = line.rstrip("\n")
        starts.line(text, time.monotonic())
        if text.startswith("Server overrides:"):
            match = _NAME.search(text)
            server = match.group(1) if match else text
            starts.server(server, time.monotonic())
            echo(f"[sweep {_fmt_duration(time.monotonic() - start)}] starting server {server}", flush=True)
        elif _READY in text:
            echo(f"[sweep {_fmt_duration(time.monotonic() - start)}] server {server} ready after "
                 f"{starts.records[-1]['ready_s'] if starts.records else '?'} s", flush=True)
        elif text.startswith("Benchmark overrides:"):
            match = _NAME.search(text)
            point = match.group(1) if match else text
        elif text.startswith("Output file:"):
            result_path = Path(text.split(":", 1)[1].strip())
        elif text in ("[END BENCHMARK]", "[SKIPPED BENCHMARK]") or text.startswith("[FAILED BENCHMARK]"):
            done += 1
            elapsed = time.monotonic() - start
            eta = elapsed / done * (plan.num_points - done)
            what = "skipped (result exists)" if text == "[SKIPPED BENCHMARK]" else (
                text if text.startswith("[FAILED") else point_headline(result_path))  # fmt: skip
            echo(f"[sweep {_fmt_duration(elapsed)}, ~{_fmt_duration(eta)} left] {done}/{plan.num_points} "
                 f"{server} {point}: {what}", flush=True)  # fmt: skip
        elif text.startswith("[FAILED SERVER COMBINATION]") or text.startswith("Traceback"):
            echo(f"[sweep] {text} (see {log_path})", flush=True)


_RECORDED_ENV = ("VLLM_", "TRITON_", "TORCHINDUCTOR_", "CUDA_VISIBLE_DEVICES")


def write_command_record(plan: SweepPlan, argv: list[str]) -> None:
    grid = dataclasses.asdict(plan.grid)
    record = {
        "command": "python -m bench.sweep " + shlex.join(argv),
        "sweep_command": shlex.join(plan.sweep_cmd),
        "serve_command": shlex.join(plan.serve_cmd),
        "bench_command": shlex.join(plan.bench_cmd),
        "port": plan.port,
        "grid": grid,
        # what else the servers ran with (e.g. TRITON_CACHE_AUTOTUNING=1 for starts that reuse Triton's tunings)
        "environment": {k: v for k, v in sorted(plan.env.items())
                        if k.startswith(_RECORDED_ENV) and not any(word in k for word in ("KEY", "TOKEN", "SECRET"))},
        "machine": {"platform": platform.platform(), "python": platform.python_version(),
                    "cpu_count": os.cpu_count(), "processor": platform.processor(),
                    # Other work on a shared machine moves every figure; the report says how loaded it was.
                    "load_average_1_5_15min_at_start": os.getloadavg()},  # fmt: skip
        "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    # A grid split over calls (--only, --resume) keeps the command and date of every call that added to it.
    path = plan.out / "command.json"
    earlier = json.loads(path.read_text()) if path.exists() else None
    if earlier:
        record["earlier_calls"] = [*earlier.pop("earlier_calls", []),
                                   {"command": earlier["command"], "date_utc": earlier["date_utc"]}]  # fmt: skip
    path.write_text(json.dumps(record, indent=1, default=str) + "\n")


def _interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def main(args: argparse.Namespace, argv: list[str]) -> int:
    # SIGINT and SIGTERM stop the sweep cleanly (see run_sweep). A shell starts background jobs with SIGINT
    # ignored, and an ignored signal stays ignored in children: set handlers, which children get as defaults.
    signal.signal(signal.SIGINT, _interrupt)
    signal.signal(signal.SIGTERM, _interrupt)
    grid = GRIDS[args.grid]
    plan = plan_sweep(grid, Path(args.out), only_servers=args.only, only_points=args.points, port=args.port,
                      dry_run=args.dry_run, show_bench_progress=sys.stdout.isatty(),
                      warm_worker=not args.process_per_point,
                      model_dir=Path(args.model_dir) if args.model_dir else None)  # fmt: skip
    print(f"[sweep] grid {grid.name}: {plan.num_points} points "
          f"({len(grid.budgets)} budgets x {len(grid.strategies)} strategies, filtered by --only: {args.only}, "
          f"--points: {args.points}), "
          f"output {plan.out}", flush=True)  # fmt: skip
    write_command_record(plan, argv)
    if not args.dry_run:
        from bench.e2e.gpu_site import seed_model_info_cache

        seed_model_info_cache()  # the servers' first start skips vLLM's model inspection subprocesses
    returncode = run_sweep(plan, plan.out / "sweep.log")
    if args.dry_run or args.no_report:
        return returncode
    from bench.sweep.report import write_report

    write_report(plan.out)
    return returncode


def _selected(records: list[dict], names, what: str, grid_name: str) -> list[dict]:
    """The records named in `names`, in that order (each once); all of them when `names` is empty."""
    if not names:
        return records
    by_name = {r["_benchmark_name"]: r for r in records}
    unknown = set(names) - set(by_name)
    if unknown:
        raise SystemExit(f"no {what} named {sorted(unknown)} in grid {grid_name}")
    return [by_name[name] for name in dict.fromkeys(names)]
