"""`bench/e2e/tree_real_shapes.py` and its wrapper without engines (seconds): the engines' configs and classes, the
report's ratios and break-even sibling rates from written engine files, and the wrapper's engine commands and time
skips with a stand-in python3. (The whole flow on CPU engines takes minutes on 2 cores: run by hand, `SHAPE=fixture`,
as its docstring says; not in CI.)"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from bench.e2e import tree_real_shapes as bench
from tests.stand_ins import logging_python3_path
from vllm_treewy.spec_decode.synthetic_acceptance import expected_accepted_nodes
from vllm_treewy.tree import DraftTree

ROOT = Path(__file__).resolve().parents[2]


def test_configs_and_classes():
    tree = bench.speculative_config([2, 2, 1], "code", synthetic=True, backend="TRITON_ATTN")
    assert tree["draft_tree_widths"] == [2, 2, 1] and tree["rejection_sample_method"] == "synthetic"
    assert tree["synthetic_tree_acceptance_rates"] == pytest.approx([0.917, 0.837 / 0.917, 0.648 / 0.837])
    chain = bench.speculative_config([1, 1, 1, 1], "code", synthetic=True, backend=None)
    assert chain["synthetic_acceptance_rates"] == pytest.approx([0.917, 0.837, 0.648, 0.538])
    assert "draft_tree_widths" not in chain and "attention_backend" not in chain
    assert "rejection_sample_method" not in bench.speculative_config([2, 2, 1], "code", synthetic=False, backend=None)
    classes = bench.classes([3, 2, 2, 1], ["code", "prose"], [0.2, 0.4], synthetic=True)
    assert [(p, s) for p, s, _ in classes] == [("code", 0.2), ("code", 0.4), ("prose", 0.2), ("prose", 0.4)]
    assert classes[3][2] == {"synthetic_tree_acceptance_rates": [0.55] * 4, "synthetic_tree_sibling_rates": [0.4] * 4}
    assert bench.classes([1, 1, 1], ["prose"], [0.2], synthetic=True) == [("prose", None, None)]
    store_all = bench.speculative_config([1], "code", synthetic=True, backend=None, strategy="store_all")
    assert store_all["mamba_state_commit"] == "store_all" and store_all["synthetic_acceptance_rates"] == [0.917]
    assert bench.engine_name("k1", "code", "store_all") == "k1-code-store_all"
    with pytest.raises(ValueError, match="reconstruct only"):
        bench.speculative_config([2, 2, 1], "code", synthetic=True, backend=None, strategy="store_all")


def write_engine(out: Path, name: str, widths, points):
    (out / f"{name}.json").write_text(json.dumps({"engine": name, "widths": widths, "points": points}))


def point(profile, sibling, batch, tokens_per_s, step_ms, length):
    return {"profile": profile, "sibling_rate": sibling, "batch": batch, "tokens_per_s": tokens_per_s,
            "step_ms": step_ms, "acceptance_length": length}


def test_report_ratios_and_break_even(tmp_path):
    write_engine(tmp_path, "tree221", [2, 2, 1], [point("code", 0.4, 1, 110.0, 10.5, 3.6),
                                                   point("prose", 0.2, 1, 80.0, 10.5, 2.1)])
    write_engine(tmp_path, "k3-code", [1, 1, 1], [point("code", None, 1, 100.0, 10.0, 3.4)])
    assert bench.main(["report", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "report.json").read_text())["rows"]
    code, prose = rows
    assert code["chain"] == "k3-code" and code["tokens_per_s_ratio"] == pytest.approx(1.1)
    assert code["step_time_ratio"] == pytest.approx(1.05)
    # at the break-even sibling rate the tree's expected length over its step time is the chain's
    s = code["break_even_sibling_rate"]
    parents = DraftTree.from_widths([2, 2, 1]).parents
    tree_length = 1 + expected_accepted_nodes(parents, [bench.PROFILES["code"][:3], [s] * 3])
    assert tree_length / 1.05 == pytest.approx(3.4, abs=1e-6)
    assert code["expected_gain"] == pytest.approx(bench.expected_gain([2, 2, 1], "code", 0.4))
    assert prose["chain"] is None and "tokens_per_s_ratio" not in prose  # no prose chain measured
    assert (tmp_path / "report.csv").read_text().splitlines()[0].startswith("tree,chain,profile")
    assert "| tree221 | k3-code | code |" in (tmp_path / "report.md").read_text()


def test_report_takes_decode_steps_where_both_points_have_them(tmp_path):
    """A point's decode step time leaves out its generate's first (prefill) step, which a whole-generate mean shares
    among fewer steps for the engine that accepts more: the ratio and report.md's step times are the decode steps'."""
    tree = dict(point("code", 0.4, 1, 110.0, 12.0, 3.6), decode_step_ms=10.0)
    write_engine(tmp_path, "tree221", [2, 2, 1], [tree, dict(point("code", 0.4, 8, 600.0, 14.0, 3.6))])
    write_engine(tmp_path, "k3-code", [1, 1, 1], [dict(point("code", None, 1, 100.0, 11.0, 3.4), decode_step_ms=9.5),
                                                  dict(point("code", None, 8, 590.0, 13.0, 3.4), decode_step_ms=12.0)])
    assert bench.main(["report", "--out", str(tmp_path)]) == 0
    one, eight = json.loads((tmp_path / "report.json").read_text())["rows"]
    assert one["step_time_ratio"] == pytest.approx(10.0 / 9.5)
    assert one["tree_step_ms"] == 12.0 and one["tree_decode_step_ms"] == 10.0
    assert eight["step_time_ratio"] == pytest.approx(14.0 / 13.0)  # the tree's point has no decode time
    table = (tmp_path / "report.md").read_text()
    assert "| 10.00 / 9.50 | 1.05 |" in table and "| 14.00 / 13.00 | 1.08 |" in table


def test_report_gives_reconstruct_over_store_all_per_chain(tmp_path):
    write_engine(tmp_path, "k1-code", [1], [point("code", None, 1, 90.0, 10.0, 1.9), point("code", None, 8, 700.0,
                                                                                              11.0, 1.9)])
    (tmp_path / "k1-code-store_all.json").write_text(json.dumps(
        {"engine": "k1-code-store_all", "widths": [1], "strategy": "store_all",
         "points": [point("code", None, 1, 100.0, 9.0, 1.9)]}))
    assert bench.main(["report", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["rows"] == [] and len(report["strategy_rows"]) == 1  # B = 8 has no store_all point
    (row,) = report["strategy_rows"]
    assert row["chain"] == "k1-code" and row["tokens_per_s_ratio"] == pytest.approx(0.9)
    assert row["step_time_ratio"] == pytest.approx(10 / 9)
    assert "| k1-code | code | 1 | 90 / 100 | 0.90 |" in (tmp_path / "report.md").read_text()


def test_auto_engines_serve_one_class_and_the_staggered_batch_shrinks():
    auto = bench.speculative_config([2, 2, 1], "prose", synthetic=True, backend=None, auto_sibling=0.2)
    assert auto["draft_tree_max_batch_size"] == "auto"
    assert auto["synthetic_tree_acceptance_rates"] == [0.55] * 3 and auto["synthetic_tree_sibling_rates"] == [0.2] * 3
    assert "draft_tree_max_batch_size" not in bench.speculative_config([2, 2, 1], "code", True, None)
    assert bench.classes([2, 2, 1], ["prose", "code"], [0.2, 0.4], synthetic=True, auto=True) == [
        ("prose", 0.2, None)]  # the engine's rates are the class: its chain steps' too
    assert bench.engine_name("tree221", "prose", sibling=0.2) == "tree221-auto-prose-s0.2"
    lengths = bench.staggered_lengths(64, 128)
    assert lengths == sorted(lengths) and lengths[0] == 8 and lengths[-1] == 512
    assert sum(lengths) / 64 == pytest.approx(2 * 128, rel=0.02)


def test_report_gives_auto_over_the_best_fixed_shape_of_its_class(tmp_path):
    def engine(name, widths, points, shape_choice="fixed"):
        (tmp_path / f"{name}.json").write_text(json.dumps(
            {"engine": name, "widths": widths, "shape_choice": shape_choice, "points": points}))

    engine("tree221", [2, 2, 1], [point("code", 0.4, 1, 110.0, 10.0, 3.6), point("code", 0.2, 1, 104.0, 10.0, 3.5),
                                  point("code", 0.4, 8, 560.0, 14.0, 3.6), point("code", 0.4, "staggered-64", 900.0,
                                                                                  None, 3.6)])
    engine("k3-code", [1, 1, 1], [point("code", None, 1, 100.0, 10.0, 3.4), point("code", None, 8, 600.0, 13.0, 3.4),
                                  point("code", None, "staggered-64", 950.0, None, 3.4)])
    engine("tree221-auto-code-s0.4", [2, 2, 1], [point("code", 0.4, 1, 108.0, 10.0, 3.6),
                                                 point("code", 0.4, 8, 594.0, 13.0, 3.4),
                                                 point("code", 0.4, "staggered-64", 1000.0, None, 3.5)], "auto")
    assert bench.main(["report", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "report.json").read_text())
    assert [r["tree"] for r in report["rows"]] == ["tree221"] * 3  # auto and staggered points stay out of these
    one, eight, staggered = report["auto_rows"]
    assert one["tree_tokens_per_s"] == 110.0 and one["over_best_fixed"] == pytest.approx(108 / 110)
    assert eight["over_best_fixed"] == pytest.approx(594 / 600)
    assert staggered["batch"] == "staggered-64" and staggered["over_best_fixed"] == pytest.approx(1000 / 950)
    assert "| tree221-auto-code-s0.4 | code s0.4 | staggered-64 | 1000 / 900 / 950 | 1.05 |" in (
        tmp_path / "report.md").read_text()


def test_expected_gain_is_the_trees_expected_length_over_the_chains():
    # code-like rank-0 rates, sibling 0.4: depth 1 accepts 0.917 + 0.083 * 0.4, depth 2 0.913 + 0.087 * 0.4, depth 3
    # (width 1) 0.774; the chain 0.917, 0.913, 0.774 (its expected length 3.402)
    c = bench.PROFILES["code"]
    d1, d2 = c[0] + (1 - c[0]) * 0.4, c[1] + (1 - c[1]) * 0.4
    tree = 1 + d1 + d1 * d2 + d1 * d2 * c[2]
    chain = 1 + c[0] + c[0] * c[1] + c[0] * c[1] * c[2]
    assert bench.expected_gain([2, 2, 1], "code", 0.4) == pytest.approx(tree / chain)
    assert bench.expected_gain([1, 1, 1], "prose", 0.4) == pytest.approx(1.0)  # a chain gains nothing from siblings


def test_break_even_ends():
    assert bench.break_even_sibling([2, 2, 1], "code", 1.0, 1.0) == 0.0  # the tree pays at any sibling rate
    assert bench.break_even_sibling([2, 2, 1], "code", 3.6, 3.0) is None  # a step three times slower never pays


def test_wrapper_runs_the_chosen_engines_and_skips_by_time(tmp_path):
    path = logging_python3_path(tmp_path)
    out = tmp_path / "out"
    env = dict(os.environ, PATH=path, ENGINES="tree3221 k4-prose",
               SHAPE="qwen35-35b-a3b", LAYERS="8", BATCHES="1 8", CALL_LIMIT_S="600", MIN_ENGINE_S="240")
    subprocess.run(["bash", "bench/e2e/run_tree_real_shapes.sh", str(out)], cwd=ROOT, env=env, check=True,
                   capture_output=True, timeout=60)
    log = (out / "log.txt").read_text()
    assert "=== tree3221 rc=0" in log and "=== k4-prose rc=0" in log and "=== report rc=0" in log
    (archive,) = out.glob("logs-*.tar.gz")
    subprocess.run(["tar", "xzf", str(archive), "-C", str(tmp_path)], check=True)
    command = (tmp_path / "logs" / "k4-prose.log").read_text()
    assert ("engine --name k4 --strategy reconstruct --profiles prose --shape qwen35-35b-a3b --layers 8 --batches 1 8"
            in command)
    assert "--attention-backend" not in command  # vLLM picks (FLASH_ATTN on Hopper)
    env.update(ENGINES="k1-code-store_all", ATTN_BACKEND="TRITON_ATTN")
    subprocess.run(["bash", "bench/e2e/run_tree_real_shapes.sh", str(tmp_path / "store_all")], cwd=ROOT, env=env,
                   check=True, capture_output=True, timeout=60)
    (archive,) = (tmp_path / "store_all").glob("logs-*.tar.gz")
    subprocess.run(["tar", "xzf", str(archive), "-C", str(tmp_path / "store_all")], check=True)
    command = (tmp_path / "store_all" / "logs" / "k1-code-store_all.log").read_text()
    assert "engine --name k1 --strategy store_all --profiles code" in command
    assert "--attention-backend TRITON_ATTN" in command
    env.update(ENGINES="tree221-store_all")
    refused = subprocess.run(["bash", "bench/e2e/run_tree_real_shapes.sh", str(tmp_path / "refused")], cwd=ROOT,
                             env=env, capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2 and "unknown engine tree221-store_all" in refused.stderr
    env.update(ENGINES="tree3221-auto", ATTN_BACKEND="")
    subprocess.run(["bash", "bench/e2e/run_tree_real_shapes.sh", str(tmp_path / "auto"), "--profiles", "prose",
                    "--staggered", "64"], cwd=ROOT, env=env, check=True, capture_output=True, timeout=60)
    (archive,) = (tmp_path / "auto").glob("logs-*.tar.gz")
    subprocess.run(["tar", "xzf", str(archive), "-C", str(tmp_path / "auto")], check=True)
    command = (tmp_path / "auto" / "logs" / "tree3221-auto.log").read_text()
    assert "engine --name tree3221 --strategy reconstruct --shape-choice auto --shape" in command
    assert command.rstrip().endswith("--profiles prose --staggered 64")
    env.update(CALL_LIMIT_S="200", ENGINES="tree221")
    subprocess.run(["bash", "bench/e2e/run_tree_real_shapes.sh", str(tmp_path / "short")], cwd=ROOT, env=env,
                   check=True, capture_output=True, timeout=60)
    assert "=== skipped tree221 (time" in (tmp_path / "short" / "log.txt").read_text()
