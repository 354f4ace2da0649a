"""bench/kernels/tree_attention_ancestors_bench.py without a GPU: its dry run (Triton interpreter, nothing timed) checks
the current kernel and a baseline loaded from a file on every row and writes the JSON; a baseline from git at the
default commit where the checkout's history holds it; a baseline that is neither a file nor a commit is refused."""

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


def test_a_baseline_neither_file_nor_commit_is_refused(tmp_path):
    with pytest.raises(SystemExit, match="neither a file nor a commit"):
        bench.load_baseline(str(tmp_path / "missing.py"))
