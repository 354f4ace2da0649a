"""bench/kernels/conv_step_bench.py without a GPU: its dry run (Triton interpreter, nothing timed) checks the current
kernel and a baseline (from a file, or from git: the lost experiment whose signature takes this step's ancestor table)
against the torch twin on every row, chains and trees, and writes the JSON."""

import json
import subprocess
from pathlib import Path

import pytest

from bench.kernels import conv_step_bench as bench

ROOT = Path(__file__).resolve().parents[2]
SMALL = ["--channels", "96", "--batches", "1", "3"]  # seconds interpreted
EXPERIMENT = "aea2d08"  # the conv step that took the ancestor table (bench/results/kernels/tree_step_kernels)


def test_dry_run_checks_every_row_and_writes_the_json(tmp_path):
    baseline = tmp_path / "before.py"
    baseline.write_text((ROOT / bench.KERNEL_PATH).read_text())
    assert bench.main(["--dry-run", "--out", str(tmp_path), *SMALL, "--shapes", "k1", "2,2,1",
                       "--baseline", str(baseline)]) == 0
    result = json.loads((tmp_path / "conv_step.json").read_text())
    assert result["dry_run"] and result["baseline"] == str(baseline) and "--dry-run" in result["command"]
    assert [(r["shape"], r["batch"], r["nodes"]) for r in result["rows"]] == [
        ("k1", 1, 2), ("k1", 3, 6), ("2,2,1", 1, 11), ("2,2,1", 3, 33)]
    for r in result["rows"]:
        assert r["channels"] == 96 and set(r["versions"]) == {"current", "baseline"}
        assert all(v["ok"] and "time_us" not in v for v in r["versions"].values())


def test_an_ancestor_table_baseline_from_git(tmp_path):
    shown = subprocess.run(["git", "-C", str(ROOT), "cat-file", "-e", f"{EXPERIMENT}^{{commit}}"],
                           capture_output=True)
    if shown.returncode != 0:
        pytest.skip(f"the checkout's history lacks {EXPERIMENT}")
    assert bench.main(["--dry-run", "--out", str(tmp_path), "--channels", "64", "--batches", "2",
                       "--shapes", "k3", "3,2", "--baseline", EXPERIMENT]) == 0
    rows = json.loads((tmp_path / "conv_step.json").read_text())["rows"]
    assert all(v["ok"] for r in rows for v in r["versions"].values())


def test_a_wrong_baseline_row_fails(tmp_path, monkeypatch):
    """A baseline that convolves wrongly fails its rows (the check can fail)."""
    def off_by_one(x, conv_state, state_indices, weight, bias, parents, *args, **kwargs):
        return bench.conv_step_triton(x + 1, conv_state, state_indices, weight, bias, parents, *args, **kwargs)

    monkeypatch.setattr(bench.timing, "load_baseline", lambda *args: type("M", (), {"conv_step_triton": off_by_one}))
    assert bench.main(["--dry-run", "--out", str(tmp_path), "--channels", "64", "--batches", "1", "--shapes", "k1",
                       "--baseline", "any"]) == 1
    versions = json.loads((tmp_path / "conv_step.json").read_text())["rows"][0]["versions"]
    assert versions["current"]["ok"] and not versions["baseline"]["ok"]
