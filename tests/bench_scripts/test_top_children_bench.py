"""bench/kernels/top_children_bench.py without a GPU: its dry run (Triton interpreter, a vocab past one chunk, nothing
timed) checks the kernel against the twin on every drafting call of the trees' steps and writes the JSON, with each
call's rows as the speculator's levels take them."""

import json

from bench.kernels import top_children_bench as bench


def test_dry_run_checks_every_row_and_writes_the_json(tmp_path):
    assert bench.main(["--dry-run", "--out", str(tmp_path), "--batches", "1", "3", "--trees", "2,2,1", "3,2,2,1"]) == 0
    result = json.loads((tmp_path / "top_children.json").read_text())
    assert result["dry_run"] and "--dry-run" in result["command"] and result["vocab"] == bench.DRY_RUN_VOCAB
    assert result["vocab"] > result["chunk"] and result["dtype"] == "bf16"
    calls = [(r["tree"], r["batch"], r["stage"], r["rows"], r["width"]) for r in result["rows"]]
    assert calls == [
        ([2, 2, 1], 1, "first pass", 1, 2), ([2, 2, 1], 1, "level 1", 2, 2), ([2, 2, 1], 1, "level 2", 4, 1),
        ([2, 2, 1], 3, "first pass", 3, 2), ([2, 2, 1], 3, "level 1", 6, 2), ([2, 2, 1], 3, "level 2", 12, 1),
        ([3, 2, 2, 1], 1, "first pass", 1, 3), ([3, 2, 2, 1], 1, "level 1", 3, 2), ([3, 2, 2, 1], 1, "level 2", 6, 2),
        ([3, 2, 2, 1], 1, "level 3", 12, 1), ([3, 2, 2, 1], 3, "first pass", 3, 3),
        ([3, 2, 2, 1], 3, "level 1", 9, 2), ([3, 2, 2, 1], 3, "level 2", 18, 2), ([3, 2, 2, 1], 3, "level 3", 36, 1)]
    assert all(r["ok"] and "triton_us" not in r and "topk_us" not in r for r in result["rows"])
    assert [(s["tree"], s["batch"], s["calls"]) for s in result["steps"]] == [
        ([2, 2, 1], 1, 3), ([2, 2, 1], 3, 3), ([3, 2, 2, 1], 1, 4), ([3, 2, 2, 1], 3, 4)]
