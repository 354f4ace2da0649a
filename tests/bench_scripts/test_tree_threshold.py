"""bench/e2e/tree_threshold.py: the largest unbroken prefix of batch sizes where the tree keeps up with its chain."""

import json
from pathlib import Path

import pytest

from bench.e2e.tree_threshold import main, threshold, thresholds

CALL6 = Path(__file__).parents[2] / "bench/results/gpu_v2_trees/call6_accept_graphs/gpu_v2_trees.json"


@pytest.mark.parametrize(("tree", "chain", "margin", "expected"), [
    ({1: 110, 8: 105, 64: 90, 256: 80}, {1: 100, 8: 100, 64: 100, 256: 100}, 0.0, 8),
    ({1: 90, 8: 120}, {1: 100, 8: 100}, 0.0, 0),  # loses at the smallest size: a later win does not count
    ({1: 120, 8: 90, 64: 130}, {1: 100, 8: 100, 64: 100}, 0.0, 1),  # the prefix stops at the first loss
    ({1: 96, 8: 94}, {1: 100, 8: 100}, 0.05, 1),  # within the margin counts, beyond it not
    ({1: 100, 8: 100, 64: 100}, {1: 100, 64: 100}, 0.0, 64),  # only sizes both runs measured
])
def test_threshold(tree, chain, margin, expected):
    assert threshold(tree, chain, margin) == expected


def test_pairs_each_tree_with_the_chain_of_its_depth():
    report = {"runs": {
        "reconstruct-tree42-bf16": {"tokens_per_s": {"1": 120, "8": 90}},
        "reconstruct-k2-bf16": {"tokens_per_s": {"1": 100, "8": 100}},
        "reconstruct-tree221-bf16": {"tokens_per_s": {"1": 99, "8": 200}},
        "reconstruct-k3-bf16": {"tokens_per_s": {"1": 100, "8": 100}},
        "reconstruct-tree221-fp16": {"tokens_per_s": {"1": 500}},  # judged runs are not timed against chains
    }}
    found = thresholds(report, 0.0)
    assert set(found) == {"[4,2]", "[2,2,1]"}
    assert found["[4,2]"]["chain"] == "reconstruct-k2-bf16" and found["[4,2]"]["draft_tree_max_batch_size"] == 1
    assert found["[2,2,1]"]["draft_tree_max_batch_size"] == 0
    with pytest.raises(SystemExit, match="no chain of depth 3"):
        thresholds({"runs": {"reconstruct-tree221-bf16": {"tokens_per_s": {"1": 1}}}}, 0.0)


def test_the_fixtures_measured_threshold(tmp_path):
    out = tmp_path / "thresholds.json"
    assert main([str(CALL6), "--out", str(out)]) == 0
    trees = json.loads(out.read_text())["trees"]
    assert trees["[2,2,1]"]["draft_tree_max_batch_size"] == 0  # the tree loses at every size there
