"""bench/host/gpu_host_audit.py: call sites, per-step figures and the reconstruct / store_all comparison on synthetic
inputs; the instruments on CPU; and (e2e) the whole flow on vLLM's CPU backend, where the sync audit is unavailable."""

import argparse
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from bench.host import gpu_host_audit as audit

ROOT = Path(__file__).resolve().parents[2]
VENV = "/venv/lib/python3.12/site-packages"
RUNNER = f"{VENV}/vllm/v1/worker/gpu_model_runner.py"


def frames(*sites):
    """Innermost first, as `package_frames` reads them."""
    return [(path, line, name) for path, line, name in sites]


def test_the_innermost_three_package_frames():
    stack = frames((f"{VENV}/torch/_tensor.py", 10, "tolist"),
                   ("/w/vllm_treewy/vllm_plugin/gdn/step_metadata.py", 131, "with_commit_nodes"),
                   ("/w/bench/gpu_host_audit.py", 200, "timed"),
                   (f"{VENV}/vllm/v1/attention/backends/gdn_attn.py", 300, "build"),
                   (RUNNER, 2249, "_build_attention_metadata"),
                   (RUNNER, 3940, "execute_model"))
    assert audit.package_frames(stack) == ("vllm_treewy/vllm_plugin/gdn/step_metadata.py:131 with_commit_nodes",
                                           "vllm/v1/attention/backends/gdn_attn.py:300 build",
                                           "vllm/v1/worker/gpu_model_runner.py:2249 _build_attention_metadata")
    assert audit.package_frames(stack[:1]) == ()


def test_sites_per_step_with_their_chains():
    log = audit.SiteLog()
    chain_a = ("vllm/a.py:1 f", "vllm/b.py:2 g")
    chain_b = ("vllm/a.py:1 f", "vllm/c.py:3 h")
    for _ in range(6):
        log.add("sync warning", chain_a, 0.002)
    for _ in range(2):
        log.add("sync warning", chain_b, 0.001)
    log.add("sync warning", ())
    sites = log.by_site(steps=4)
    assert list(sites) == ["vllm/a.py:1 f", audit.UNKNOWN_SITE]
    site = sites["vllm/a.py:1 f"]
    assert site["calls_per_step"] == 2.0 and site["us_per_step"] == pytest.approx(3500.0)
    assert site["chains"] == {"vllm/a.py:1 f < vllm/b.py:2 g": 1.5, "vllm/a.py:1 f < vllm/c.py:3 h": 0.5}
    assert sites[audit.UNKNOWN_SITE]["calls_per_step"] == 0.25


def run_result(strategy, sync_events, steps, functions=None, methods=None):
    """A strategy's JSON as `run_strategy` writes it, with the given sync events over `steps` steps."""
    log = audit.SiteLog()
    for chain, n in sync_events.items():
        for _ in range(n):
            log.add("sync warning", chain)
    return {"strategy": strategy, "errors": {}, "passes": {
        "timed": {"wall_ms_per_step": 10.0 if strategy == "store_all" else 11.0, "methods": methods or {},
                  "waits": {}, "cudagraph_modes": {"FULL tokens=256": 0.9}},
        "sync_audit": {"available": True, "sites": log.by_site(steps)},
        "profile": {"functions": functions or {}}}}


def test_a_sync_site_only_in_reconstruct_is_reported_and_counts_are_per_step():
    shared, more, only = ("vllm/shared.py:1 f",), ("vllm/more.py:2 g",), ("vllm_treewy/x.py:3 h",)
    runs = {
        # store_all: 20 steps; reconstruct: 10 steps. `shared` once a step in both (20 vs 10 calls); `more` once a
        # step vs twice (the same 20 calls); `only` once a step in reconstruct alone.
        "store_all-k3": run_result("store_all", {shared: 20, more: 20}, steps=20),
        "reconstruct-k3": run_result("reconstruct", {shared: 10, more: 20, only: 10}, steps=10),
    }
    rows = audit.diff_report(runs)["sync_sites"]
    assert [(r["site"], r["base"], r["subject"], r["only_in_subject"]) for r in rows] == [
        ("vllm/more.py:2 g", 1.0, 2.0, False), ("vllm_treewy/x.py:3 h", 0.0, 1.0, True)]


def test_functions_and_methods_by_largest_per_step_difference():
    runs = {
        "store_all-k3": run_result("store_all", {}, 1, functions={"a": {"cumtime_us": 10.0}, "b": {"cumtime_us": 5.0}},
                                   methods={"runner.execute_model": {"us_per_step": 100.0}}),
        "reconstruct-k3": run_result("reconstruct", {}, 1,
                                     functions={"a": {"cumtime_us": 11.0}, "c": {"cumtime_us": 30.0}},
                                     methods={"runner.execute_model": {"us_per_step": 180.0}}),
    }
    report = audit.diff_report(runs, top=2)
    assert [(r["key"], r["difference"]) for r in report["functions"]] == [("c", 30.0), ("b", -5.0)]
    assert report["methods"] == [{"key": "runner.execute_model", "base": 100.0, "subject": 180.0, "difference": 80.0}]
    assert report["wall_ms_per_step"] == {"store_all": 10.0, "reconstruct": 11.0}


def test_one_strategy_alone_still_reports(tmp_path, capsys):
    run = run_result("store_all", {("vllm/a.py:1 f",): 2}, steps=2)
    (tmp_path / "store_all-k3.json").write_text(json.dumps(run))
    assert audit.main(["diff", "--out", str(tmp_path)]) == 1  # reconstruct's run is missing
    report = json.loads((tmp_path / "host_audit.json").read_text())
    assert report["diff"]["wall_ms_per_step"] == {"store_all": 10.0}
    assert report["diff"]["sync_sites"] is None and report["diff"]["functions"] is None
    assert "store_all-k3: passes" in capsys.readouterr().out


def test_function_labels():
    assert audit.function_label("/w/vllm_treewy/kernels/bookkeeping/dispatch.py", 33, "commit_nodes_and_counts") == (
        "vllm_treewy/kernels/bookkeeping/dispatch.py:33 commit_nodes_and_counts")
    assert audit.function_label(f"{VENV}/triton/runtime/jit.py", 700, "run") == "triton/runtime/jit.py:700 run"
    assert audit.function_label("~", 0, "<method 'item' of 'torch._C.TensorBase' objects>").startswith("builtin")
    assert audit.function_label("/usr/lib/python3.12/threading.py", 1, "wait") is None
    assert audit.WAITING_BUILTIN.search("<method 'item' of 'torch._C.TensorBase' objects>")
    assert not audit.WAITING_BUILTIN.search("<built-in method torch.index_select>")


def test_step_timers_time_instance_methods_and_count_steps():
    class Runner:
        def execute_model(self, x):
            return x + 1

    runner, timers = Runner(), audit.StepTimers()
    assert timers.wrap(runner, "execute_model", audit.STEPS)
    assert not timers.wrap(runner, "missing", "runner.missing")
    assert [runner.execute_model(i) for i in range(3)] == [1, 2, 3]
    assert timers.per_step(steps=3)[audit.STEPS]["calls_per_step"] == 1.0
    assert Runner().execute_model(1) == 2 and timers.calls[audit.STEPS] == 3  # other instances: not timed


def test_sync_warnings_are_logged_with_their_package_stack(monkeypatch):
    from vllm.utils import gpu_sync_debug

    modes, installed = [], []
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", modes.append)
    # vLLM's copy checks would wrap Tensor.to for the rest of this process
    monkeypatch.setattr(gpu_sync_debug, "_install_copy_checkers", lambda: installed.append(True))
    # code whose frames lie in vllm, as the warnings' stacks would on the GPU: a synchronizing op, and vLLM's check
    # of a non_blocking copy (its own frames are not the call site)
    caller = ("import warnings\ndef tolist():\n    warnings.warn('called a synchronizing CUDA operation (at x)')\n"
              "def copy(report):\n    report()\n")
    checker = ("import warnings\ndef report():\n    warnings.warn('Tensor.copy_: a non_blocking H2D copy that may be "
               "silently synchronous (the CPU tensor is not pinned). Implicit GPU<->CPU sync detected')\n")
    code, check = {}, {}
    exec(compile(caller, "/site/vllm/v1/worker/fake.py", "exec"), code)
    exec(compile(checker, f"/site/{audit.GPU_SYNC_DEBUG}", "exec"), check)
    log = audit.SiteLog()
    with audit.sync_warnings(log) as copy_checks:
        assert gpu_sync_debug._active_check_mode() == "warn"
        code["tolist"]()
        code["tolist"]()
        code["copy"](check["report"])
        with pytest.warns(UserWarning, match="something else"):
            warnings.warn("something else")
    assert (copy_checks, installed, modes) == ("on", [True], ["warn", "default"])
    assert gpu_sync_debug._active_check_mode() is None
    sites = log.by_site(steps=2)
    assert sites["vllm/v1/worker/fake.py:3 tolist"]["what"] == {"sync warning": 1.0}
    assert sites["vllm/v1/worker/fake.py:5 copy"]["what"] == {
        "implicit sync: Tensor.copy_ H2D (the CPU tensor is not pinned)": 0.5}


def test_wait_timers_log_the_caller_of_an_event_synchronize(monkeypatch):
    for owner, name in ((torch, "Event"), (torch.cuda.Event, "synchronize"), (torch.cuda.Stream, "synchronize"),
                        (torch.cuda, "synchronize"), (torch.accelerator, "synchronize")):
        monkeypatch.setattr(owner, name, getattr(owner, name))  # restored after the test
    log = audit.SiteLog()
    audit.install_wait_timers(log)
    source = "import torch\ndef wait():\n    torch.Event().synchronize()\n"  # a CPU event: synchronize returns
    namespace = {}
    exec(compile(source, "/site/vllm/v1/worker/fake.py", "exec"), namespace)
    namespace["wait"]()
    (site, entry), = log.by_site(steps=1).items()
    assert site == "vllm/v1/worker/fake.py:3 wait" and entry["what"] == {"torch.Event.synchronize": 1.0}


def test_the_runner_must_be_in_this_process():
    class Client:  # what an engine core in another process leaves here: no engine_core object
        pass

    class LLM:
        class llm_engine:
            engine_core = Client()

    with pytest.raises(RuntimeError, match="VLLM_ENABLE_V1_MULTIPROCESSING"):
        audit.in_process_runner(LLM())


@pytest.mark.e2e
def test_the_whole_flow_on_vllms_cpu_backend(tmp_path):
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
               PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}", PYTHONUNBUFFERED="1")
    done = subprocess.run([sys.executable, "bench/host/gpu_host_audit.py", "run", "--out", str(tmp_path), "--batch", "2",
                           "--max-tokens", "4", "--engine-batch-sizes", "2", "--top", "5"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    logs = "\n".join(p.read_text()[-3000:] for p in tmp_path.glob("*.log"))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:] + logs
    report = json.loads((tmp_path / "host_audit.json").read_text())
    assert set(report["runs"]) == {"reconstruct-k3", "store_all-k3"}
    for name, run in report["runs"].items():
        passes = run["passes"]
        assert set(passes) == {"warm_up", "timed", "sync_audit", "profile"} and not run["errors"], name
        assert passes["sync_audit"] == {"available": False, "reason": "torch.cuda.set_sync_debug_mode needs CUDA"}
        assert passes["timed"]["steps"] > 0 and passes["timed"]["wall_ms_per_step"] > 0
        assert passes["timed"]["methods"][audit.STEPS]["calls_per_step"] == 1.0
        profile = passes["profile"]
        assert profile["key_methods"]["runner.execute_model"]["calls"] == 1.0
        assert len(profile["top_tottime"]) == len(profile["top_cumtime"]) == 5
        assert (tmp_path / f"{name}.prof").exists()
    timed = report["runs"]["reconstruct-k3"]["passes"]["timed"]["methods"]
    assert timed["adapter: with_commit_nodes"]["calls_per_step"] > 0  # the adapter's wrappers ran, and were timed
    assert report["diff"]["functions"] and report["diff"]["sync_sites"] is None
    assert "cProfile cumulative us per step" in done.stdout


def test_a_tree_is_audited_against_the_chain_of_its_depth():
    args = argparse.Namespace(tree_widths=[2, 2, 1], strategies=["reconstruct", "store_all"], k=3)
    runs = audit.audited_runs(args)
    assert [name for name, _ in runs] == ["reconstruct-tree221", "reconstruct-k3"]
    assert runs[0][1] == ["--strategy", "reconstruct", "--tree-widths", "2", "2", "1", "--audit-role", "subject"]
    assert runs[1][1] == ["--strategy", "reconstruct", "--audit-role", "base"]
    tree = dict(run_result("reconstruct", {("vllm/a.py:1 f",): 4}, steps=2), name="reconstruct-tree221",
                audit_role="subject")
    chain = dict(run_result("reconstruct", {}, steps=2), name="reconstruct-k3", audit_role="base")
    report = audit.diff_report({"reconstruct-tree221": tree, "reconstruct-k3": chain})
    assert report["names"] == {"subject": "reconstruct-tree221", "base": "reconstruct-k3"}
    assert [(r["site"], r["base"], r["subject"]) for r in report["sync_sites"]] == [("vllm/a.py:1 f", 0.0, 2.0)]
