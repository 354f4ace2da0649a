"""How the kernel benchmarks time and describe the GPU: the median over CUDA-graph replays of many back-to-back calls
(vLLM decodes under CUDA graphs), the device's copy bandwidth, the device facts a result records (a dry run's:
`run_facts`), a benchmark's loop over its checked rows (`collect_rows`), and an earlier version of a kernel module
to time beside the current one (`load_baseline`: the package keeps one production path, so the earlier one comes
from git or from a file holding its source)."""

import importlib.util
import json
import math
import pathlib
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import traceback

import torch
import triton


def graph_time_us(calls, replays=7, min_calls=48):
    """Median time of one call: capture all `calls` (repeated up to min_calls) in a CUDA graph, replay it."""
    for call in calls:
        call()
    torch.cuda.synchronize()
    repeat = max(1, math.ceil(min_calls / len(calls)))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(repeat):
            for call in calls:
                call()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / (repeat * len(calls)))
    del graph
    return statistics.median(times)


def copy_bandwidth():
    """Device-to-device copy of 1 GiB of bf16, bytes read + written per second: the best of a memcpy (eager and
    in a CUDA graph) and an elementwise kernel (also graphed)."""
    src = torch.randn(1 << 29, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    seconds = []
    for _ in range(10):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        seconds.append(start.elapsed_time(end) * 1e-3)
    seconds.append(graph_time_us([lambda: dst.copy_(src)], min_calls=10) * 1e-6)
    seconds.append(graph_time_us([lambda: torch.mul(src, 1, out=dst)], min_calls=10) * 1e-6)
    del src, dst
    return 2 * (1 << 30) / min(seconds)


def device_facts():
    props = torch.cuda.get_device_properties(0)
    smi = subprocess.run(
        ["nvidia-smi", "--query-gpu=name,driver_version,clocks.max.sm,clocks.max.mem,memory.total",
         "--format=csv,noheader"], capture_output=True, text=True).stdout.strip()
    return dict(
        name=props.name, sms=props.multi_processor_count, l2_bytes=getattr(props, "L2_cache_size", None),
        memory_bytes=props.total_memory, capability=f"{props.major}.{props.minor}", nvidia_smi=smi,
        torch=torch.__version__, triton=triton.__version__, cuda=torch.version.cuda, python=platform.python_version(),
    )


def run_facts(dry_run):
    """The machine facts a kernel benchmark's result records: `device_facts()`, or for a dry run (CPU, the Triton
    interpreter, nothing timed) the versions alone."""
    if not dry_run:
        return device_facts()
    return dict(name="cpu (Triton interpreter)", torch=torch.__version__, triton=triton.__version__,
                python=platform.python_version())


def start_run(dry_run, out):
    """A kernel benchmark's start: refuses a timed run without CUDA, makes the folder `out`, prints and returns
    `(out as a path, run_facts, start time)`."""
    if not dry_run and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: pass --dry-run for the CPU check")
    out = pathlib.Path(out)
    out.mkdir(parents=True, exist_ok=True)
    started = time.time()
    facts = run_facts(dry_run)
    print(json.dumps(facts), flush=True)
    return out, facts, started


def baseline_ratio(record):
    """`record` with "baseline_over_current" where both of its versions were timed."""
    times = {name: result.get("time_us") for name, result in record["versions"].items()}
    if times.get("current") and times.get("baseline"):
        record["baseline_over_current"] = round(times["baseline"] / times["current"], 3)
    return record


def collect_rows(rows, ok, records, save):
    """Each of `rows` (callables, each returning one result row) run in turn: its row appended to `records` and
    printed, then `save()` (a long run keeps what it has). A row that raises (printed) or that `ok(row)` refuses
    counts as failed. Returns whether any failed."""
    failed = False
    for row in rows:
        try:
            record = row()
        except Exception:  # noqa: BLE001
            traceback.print_exc()
            failed = True
            continue
        failed |= not ok(record)
        records.append(record)
        print(json.dumps(record), flush=True)
        save()
    save()
    return failed


def load_baseline(source: str, kernel_path: str, root: pathlib.Path):
    """The module of an earlier version of the kernel file `kernel_path` (relative to the checkout `root`): from the
    file `source` if it exists, else from git at the commit `source`. Loaded from a real file (Triton's JIT reads the
    kernel's source) as a module of its own; its relative imports resolve against `vllm_treewy.kernels` (the
    current helpers, which it must still match). On the GPU machine, where git does not travel, write the earlier
    version to a file first (`git show REF:PATH > .scratch/NAME.py`, carried in the device call)."""
    path = pathlib.Path(source)
    if path.is_file():
        text = path.read_text()
    else:
        done = subprocess.run(["git", "-C", str(root), "show", f"{source}:{kernel_path}"], capture_output=True,
                              text=True)
        if done.returncode != 0:
            raise SystemExit(f"--baseline {source}: neither a file nor a commit git can show ({done.stderr.strip()}); "
                             f"without git, write `git show {source}:{kernel_path}` to a file and pass that")
        text = done.stdout
    stem = pathlib.Path(kernel_path).stem + "_baseline"
    module_path = pathlib.Path(tempfile.mkdtemp(prefix=stem + "_")) / f"{stem}.py"
    module_path.write_text(text)
    package = ".".join(pathlib.Path(kernel_path).parent.parts)
    spec = importlib.util.spec_from_file_location(f"{package}.{stem}", module_path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module
