"""bench/kernels/tree_attention_ancestors_bench.py without a GPU: its dry run (Triton interpreter, nothing timed) checks
the current (fused) kernel and a baseline loaded from a file on every row and writes the JSON; an unfused baseline
from git at the default commit (followed by vLLM's merge, its CPU path, where vLLM imports; alone otherwise) where the
checkout's history holds it; a baseline that is neither a file nor a commit is refused."""

import json
import subprocess
from pathlib import Path

import pytest

from bench.kernels import tree_attention_ancestors_bench as bench

ROOT = Path(__file__).resolve().parents[2]
SHAPE = ["--shape", "12", "2", "64"]  # groups of 6 as at the 27B shape, a smaller head: seconds interpreted


def test_dry_run_checks_every_row_and_writes_the_json(tmp_path):
    baseline = tmp_path / "before.py"
    baseline.write_text((ROOT / bench.KERNEL_PATH).read_text())
    assert bench.main(["--dry-run", "--out", str(tmp_path), "--batches", "1", "3", "--baseline", str(baseline),
                       *SHAPE, "--trees", "2,2,1", "2,1"]) == 0
    result = json.loads((tmp_path / "tree_attention_ancestors.json").read_text())
    assert result["dry_run"] and result["baseline"] == str(baseline) and "--dry-run" in result["command"]
    assert [(r["tree"], r["batch"]) for r in result["rows"]] == [([2, 2, 1], 1), ([2, 2, 1], 3), ([2, 1], 1),
                                                                 ([2, 1], 3)]
    for r in result["rows"]:
        assert set(r["versions"]) == {"current", "baseline"}
        assert all(v["ok"] and "time_us" not in v for v in r["versions"].values())
        assert all(v["launches"] == bench.FUSED for v in r["versions"].values())
    assert result["rows"][1]["tokens"] == 3 * 11 and result["rows"][1]["ancestors_width"] == 4


def test_baseline_from_git_at_the_default_commit(tmp_path):
    shown = subprocess.run(["git", "-C", str(ROOT), "cat-file", "-e", f"{bench.BASELINE}^{{commit}}"],
                           capture_output=True)
    if shown.returncode != 0:
        pytest.skip(f"the checkout's history lacks {bench.BASELINE}")
    baseline = bench.load_baseline(bench.BASELINE)
    assert bench.main(["--dry-run", "--out", str(tmp_path), "--batches", "2", "--baseline", bench.BASELINE,
                       *SHAPE, "--trees", "2,1"]) == 0
    assert callable(baseline)
    versions = json.loads((tmp_path / "tree_attention_ancestors.json").read_text())["rows"][0]["versions"]
    assert versions["current"]["launches"] == bench.FUSED and all(v["ok"] for v in versions.values())
    assert versions["baseline"]["launches"] == (bench.ALONE if bench.vllm_merge() is None else bench.MERGED)


def test_an_unfused_baseline_without_vllm_is_checked_alone(tmp_path, monkeypatch):
    """Where vLLM does not import, the unfused baseline is timed alone, checked against the ancestor attention's
    output and log-sum-exp."""
    shown = subprocess.run(["git", "-C", str(ROOT), "cat-file", "-e", f"{bench.BASELINE}^{{commit}}"],
                           capture_output=True)
    if shown.returncode != 0:
        pytest.skip(f"the checkout's history lacks {bench.BASELINE}")
    monkeypatch.setattr(bench, "vllm_merge", lambda: None)
    assert bench.main(["--dry-run", "--out", str(tmp_path), "--batches", "1", "--baseline", bench.BASELINE,
                       *SHAPE, "--trees", "2,1"]) == 0
    baseline = json.loads((tmp_path / "tree_attention_ancestors.json").read_text())["rows"][0]["versions"]["baseline"]
    assert baseline["launches"] == bench.ALONE and baseline["ok"] and baseline["lse_error"] is not None


def test_a_baseline_neither_file_nor_commit_is_refused(tmp_path):
    with pytest.raises(SystemExit, match="neither a file nor a commit"):
        bench.load_baseline(str(tmp_path / "missing.py"))
