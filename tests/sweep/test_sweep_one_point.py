"""The `cpu-ci` grid end to end: `python -m bench.sweep run` drives vLLM's `vllm bench sweep serve`, which starts
`vllm serve` on the fixture with reconstruct (MTP k = 3) and runs one benchmark point; the report it writes must
hold that point with vLLM's figures, the server's figures and acceptance, and the plots."""

from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

REPO_ROOT = Path(__file__).resolve().parents[2]
RUN_TIMEOUT_S = 600  # one server start (about a minute on 2 cores) and a point of a few seconds


def test_one_point_grid_writes_its_report(tmp_path):
    pytest.importorskip("pandas", reason="vLLM's sweep writes its summary with pandas (test extra)")
    pytest.importorskip("matplotlib", reason="the report's plots (test extra)")
    out = tmp_path / "cpu-ci"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])))
    proc = subprocess.Popen([sys.executable, "-m", "bench.sweep", "run", "cpu-ci", "--out", str(out)],
                            cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip
    try:
        output, _ = proc.communicate(timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)  # the driver stops vLLM's sweep, which stops its server
        output, _ = proc.communicate(timeout=180)
        pytest.fail(f"grid still running after {RUN_TIMEOUT_S} s:\n{output[-4000:]}")
    log_tail = (out / "sweep.log").read_text(errors="replace")[-4000:] if (out / "sweep.log").exists() else ""
    assert proc.returncode == 0, f"{output[-4000:]}\nsweep.log tail:\n{log_tail}"
    # Progress was shown while the grid ran.
    assert "starting server reconstruct-kv1GiB" in output and "1/1 reconstruct-kv1GiB chat-c2:" in output, output

    with (out / "points.csv").open() as f:
        points = list(csv.DictReader(f))
    assert len(points) == 1, points
    point = points[0]
    assert (point["strategy"], point["budget"], point["workload"], point["axis"]) == (
        "reconstruct", "kv1GiB", "chat", "concurrency")  # fmt: skip
    num_prompts = json.loads((out / "params" / "bench.json").read_text())[0]["num_prompts"]
    assert int(float(point["concurrency"])) == 2
    assert float(point["completed"]) == num_prompts and float(point["failed"]) == 0
    assert float(point["output_throughput"]) > 0
    assert 0 < float(point["median_ttft_ms"]) <= float(point["p99_ttft_ms"])
    assert 0 < float(point["mean_tpot_ms"]) and 0 < float(point["p99_tpot_ms"])
    # Server side: at most the client's concurrency ran at once; 1 GiB holds far more than 2 requests.
    assert 1 <= float(point["server_peak_running_requests"]) <= 2
    assert float(point["server_preemptions"]) == 0
    assert 0 < float(point["server_peak_kv_cache_usage"]) < 0.5
    assert float(point["server_kv_cache_max_concurrency"]) > 2
    # The fixture's MTP head drafts its target's greedy bigram: most drafts of k = 3 are accepted.
    assert 2.0 < float(point["spec_decode_acceptance_length"]) <= 4.0
    per_position = [float(point[f"acceptance_pos{i}"]) for i in range(3)]
    assert all(0 < p <= 1 for p in per_position) and per_position == sorted(per_position, reverse=True)
    assert 1 + sum(per_position) == pytest.approx(float(point["spec_decode_acceptance_length"]), rel=1e-6)

    ratios = (out / "ratios.md").read_text()
    assert "reconstruct (R) vs store_all (S)" in ratios and "python -m bench.sweep run cpu-ci" in ratios
    assert "Failed" not in ratios, ratios
    for name in ("throughput_vs_concurrency.png", "tpot_vs_concurrency.png", "pareto.png"):
        assert (out / "plots" / name).stat().st_size > 1000, name
    record = json.loads((out / "command.json").read_text())
    assert " bench sweep serve " in record["sweep_command"] and record["grid"]["name"] == "cpu-ci"

    # The server is gone once the run returns.
    with pytest.raises(OSError):
        urllib.request.urlopen(f"http://127.0.0.1:{record['port']}/health", timeout=5)
