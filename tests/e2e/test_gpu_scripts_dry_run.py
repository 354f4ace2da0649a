"""The H200 scripts' whole flow on vLLM's CPU backend, at a few tokens: device time is scarce, so a script that
breaks on its own logic (arguments, roles, files, the report) must break here first. What only CUDA has (graphs,
backends, compiled ops) is not exercised; tokens/s and verdicts are not judged, only that they are written."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.stand_ins import logging_python3_path

ROOT = Path(__file__).resolve().parents[2]
SMALL = ["--batch-sizes", "1", "2", "--max-tokens", "4", "--timing-repeats", "1"]


def run_script(*command: str, timeout: int = 900, **env_vars: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
               PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
               VLLM_ENABLE_V1_MULTIPROCESSING="0", TREE_GPU_TESTS="0", PYTHONUNBUFFERED="1",
               CALL_LIMIT_S="100000", **env_vars)  # a loaded CPU must not skip runs: the flow is what is tested
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def test_chain_script_writes_every_run_and_verdict(tmp_path):
    done = run_script("bash", "bench/e2e/run_gpu_vllm_e2e.sh", str(tmp_path), "1", *SMALL)
    report_file = tmp_path / "gpu_vllm_e2e.json"
    log = (tmp_path / "log.txt").read_text() if (tmp_path / "log.txt").exists() else done.stdout + done.stderr
    assert report_file.exists(), log[-4000:]
    report = json.loads(report_file.read_text())
    assert set(report["runs"]) == {"no-spec", "reconstruct-k1", "store_all-k1"}
    for name in ("reconstruct-k1", "store_all-k1"):
        run = report["runs"][name]
        assert set(run["verdicts"]) == {"1", "2"} and run["kv_cache"]["gdn_blocks_per_request"]
        assert all(t > 0 for t in run["tokens_per_s"].values())
        assert set(run["acceptance_length"]) == {"1", "2"} and all(n >= 1 for n in run["acceptance_length"].values())
    assert report["runs"]["reconstruct-k1"]["kv_cache"]["gdn_blocks_per_request"][0] == 1
    assert set(report["no_spec_in_smaller_batches"]) == {"2"}  # batch 2 again as two batches of 1
    assert [line.split(":")[0] for line in report["beside_store_all"]] == [
        "reconstruct-k1 beside store_all at batch 1", "reconstruct-k1 beside store_all at batch 2"]
    assert all("tokens/s per verify" in line for line in report["beside_store_all"])


def test_chain_script_skips_runs_that_would_leave_the_reference_no_time(tmp_path):
    # a stand-in python3 that only logs its arguments: the script's own scheduling, without engines
    path = logging_python3_path(tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    env = dict(os.environ, PATH=path, CALL_LIMIT_S="200", RUN_S="150",
               REFERENCE_S="170")
    subprocess.run(["bash", "bench/e2e/run_gpu_vllm_e2e.sh", str(out), "3 1"], cwd=ROOT, env=env, check=True,
                   capture_output=True, timeout=60)
    markers = [line for line in (out / "log.txt").read_text().splitlines() if line.startswith("=== ")]
    assert [m.split(" at ")[0] for m in markers] == [
        "=== reconstruct k=3", "=== rc=0", "=== skipped store_all k=3 (time)", "=== skipped reconstruct k=1 (time)",
        "=== skipped store_all k=1 (time)", "=== reference", "=== rc=0"]


@pytest.mark.parametrize("widths", ["2,1"])
def test_tree_script_writes_its_report(tmp_path, widths):
    # the continuations, then the tree run (two CPU engines in turn); the script's preemption stages
    # (PREEMPTION_SHAPES: two more engines, most of this test's time on the 2-core CI machine) are left to the device
    done = run_script("bash", "bench/e2e/run_gpu_tree_e2e.sh", str(tmp_path), widths, *SMALL, timeout=1800)
    report_file = tmp_path / "gpu_tree_e2e.json"
    log = (tmp_path / "log.txt").read_text() if (tmp_path / "log.txt").exists() else done.stdout + done.stderr
    assert report_file.exists(), log[-4000:]
    report = json.loads(report_file.read_text())
    name = "tree-" + widths.replace(",", "x")
    assert sorted(report["runs"]) == [name], log[-4000:]
    assert set(report["runs"][name]["verdicts"]) == {"1", "2"}
    assert report["missing_runs"] == []
