"""`bench/e2e/shape_choice_sim.py`: the production `AdaptiveShape` driven over step times of a written cost table
settles on the shape that pays (seconds)."""

from __future__ import annotations

import json

import pytest

from bench.e2e import shape_choice_sim as sim


def write_costs(folder, tree_ms: float, chain_ms: float):
    for name, profile_points in (("tree221", [("prose", 0.4, tree_ms)]), ("k3-prose", [("prose", None, chain_ms)])):
        points = [{"profile": p, "sibling_rate": s, "batch": b, "tokens_per_s": 1.0, "step_ms": ms * (1 + b / 64)}
                  for p, s, ms in profile_points for b in (1, 8)]
        (folder / f"{name}.json").write_text(json.dumps({"engine": name, "points": points}))


@pytest.mark.parametrize("tree_ms,best", [(10.0, "tree"), (20.0, "chain")])
def test_auto_settles_on_the_shape_that_pays(tmp_path, tree_ms, best):
    write_costs(tmp_path, tree_ms, 10.0)
    out = tmp_path / "out"
    assert sim.main(["--costs", str(tmp_path), "--tree", "tree221", "--profile", "prose", "--batches", "1", "8",
                     "--tokens", "96", "--staggered", "8", "--out", str(out)]) == 0
    rows = json.loads((out / "tree221-prose-s0.4.json").read_text())["rows"]
    for row in rows:
        fixed = {shape: row[shape]["tokens_per_s"] for shape in ("tree", "chain")}
        assert max(fixed, key=fixed.get) == best
        assert row["auto_over_best_fixed"] > 0.95, row
        drafted = row["auto"]["drafted"]
        assert drafted[best] > 3 * drafted["chain" if best == "tree" else "tree"], row
