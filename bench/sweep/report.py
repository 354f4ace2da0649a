"""A grid's report: every point in one CSV, the reconstruct / store_all ratio table, and plots.

    python -m bench.sweep report bench/results/sweeps/cpu

Reads vLLM's per-point results (`raw/GRID/*/summary.json`: `vllm bench serve`'s figures, the sweep's serve and
bench parameters, and the server figures bench.sweep.point added) and writes beside them:

- `points.csv`: one row per (strategy, budget, workload, concurrency or arrival rate);
- `ratios.csv` and `ratios.md`: TreeWY Table 1's columns, reconstruct against store_all at the same point,
  geometric mean over the concurrency-swept workloads, per budget and concurrency (the bursty workload per
  arrival rate), each column oriented so that > 1 favours reconstruct; plus the acceptance-length agreement;
- `plots/`: output throughput and mean TPOT against concurrency (one row per budget, one column per workload,
  one line per strategy), and the Pareto fronts of output throughput against per-user speed.
"""

from __future__ import annotations

import csv
import json
import math
from collections import defaultdict
from pathlib import Path

from bench.sweep.workloads import workload_axis

STRATEGY_ORDER = ("no_spec", "store_all", "reconstruct")
# (column, reconstruct's metric over store_all's: "R/S", or the inverse: "S/R"), as in TreeWY Table 1.
RATIO_COLUMNS = (
    ("tput", "output_throughput", "R/S"),
    ("KV red.", "server_peak_kv_cache_usage", "S/R"),
    ("p99 TTFT", "p99_ttft_ms", "S/R"),
    ("mean TPOT", "mean_tpot_ms", "S/R"),
    ("b", "server_peak_running_requests", "R/S"),
)
POINT_FIELDS = (
    "strategy", "budget", "workload", "axis", "concurrency", "request_rate", "burstiness", "num_prompts",
    "completed", "failed", "duration", "output_throughput", "total_token_throughput",
    "median_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "median_tpot_ms", "p99_tpot_ms",
    "server_peak_running_requests", "max_concurrent_requests", "server_peak_waiting_requests",
    "server_preemptions", "server_peak_kv_cache_usage", "server_mean_kv_cache_usage",
    "server_kv_cache_max_concurrency", "spec_decode_acceptance_length", "spec_decode_acceptance_rate",
)  # fmt: skip


def strategy_of(run: dict) -> str:
    spec = run.get("speculative_config")
    if isinstance(spec, str):
        spec = json.loads(spec)
    if not spec:
        return "no_spec"
    return spec.get("mamba_state_commit", "store_all")


def budget_of(run: dict, budgets: list[dict]) -> str:
    """The grid budget whose serve parameters this run was started with."""
    for budget in budgets:
        if all(run.get(k) == v for k, v in budget["serve_params"].items()):
            return budget["name"]
    raise ValueError(f"run matches no budget of the grid: {[b['serve_params'] for b in budgets]}")


def load_points(out: Path) -> tuple[list[dict], dict]:
    """One flat record per measured point (runs of a point averaged), and the grid record of command.json."""
    record = json.loads((out / "command.json").read_text())
    grid = record["grid"]
    points = []
    for summary in sorted((out / "raw").rglob("summary.json")):
        runs = json.loads(summary.read_text())
        if not runs:
            continue
        first = runs[0]
        if first.get("profile"):  # a profiled point (bench.sweep.run.profiled_point) is not a measurement
            continue
        axis = workload_axis(first["workload"])
        point = {
            "strategy": strategy_of(first),
            "budget": budget_of(first, grid["budgets"]),
            "workload": first["workload"],
            "axis": axis,
            "concurrency": first.get("max_concurrency"),
            "request_rate": first.get("request_rate"),
            "burstiness": first.get("burstiness"),
        }
        for name in POINT_FIELDS[len(point):]:
            values = [r[name] for r in runs if isinstance(r.get(name), (int, float))]
            point[name] = sum(values) / len(values) if values else None
        per_position = [r.get("spec_decode_per_position_acceptance_rates") or [] for r in runs]
        for i in range(max(map(len, per_position), default=0)):
            values = [p[i] for p in per_position if len(p) > i]
            point[f"acceptance_pos{i}"] = sum(values) / len(values)
        point["result_dir"] = str(summary.parent.relative_to(out))
        points.append(point)
    return points, record


def failures(out: Path) -> list[str]:
    found = []
    for path in sorted((out / "raw").rglob("*failure.json")):
        data = json.loads(path.read_text())
        found.append(f"{path.relative_to(out)}: {data.get('error_type')}: {str(data.get('error'))[:300]}")
    return found


def write_points_csv(points: list[dict], path: Path) -> None:
    fields = list(POINT_FIELDS) + sorted({k for p in points for k in p if k.startswith("acceptance_pos")})
    fields.append("result_dir")
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        for p in sorted(points, key=_point_order):
            writer.writerow({k: p.get(k) for k in fields})


def _point_order(p: dict):
    x = p["concurrency"] if p["axis"] == "concurrency" else _as_float(p["request_rate"])
    return (p["budget"], p["workload"], p["axis"], x or 0, STRATEGY_ORDER.index(p["strategy"]))


def _as_float(value) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        return math.nan


def geomean(values: list[float]) -> float | None:
    positive = [v for v in values if v is not None and v > 0 and math.isfinite(v)]
    if not positive:
        return None
    return math.exp(sum(math.log(v) for v in positive) / len(positive))


def _ratio(reconstruct: dict, store_all: dict, metric: str, direction: str) -> float | None:
    r, s = reconstruct.get(metric), store_all.get(metric)
    if r is None or s is None or r <= 0 or s <= 0:
        return None  # e.g. no KV usage sampled: leave the point out of the geomean rather than invent a ratio
    return r / s if direction == "R/S" else s / r


def ratio_rows(points: list[dict]) -> list[dict]:
    """Per (budget, axis, x): geomeans over workloads of reconstruct against store_all at the same point."""
    by_key = {(p["strategy"], p["budget"], p["workload"], p["axis"], _x(p)): p for p in points}
    groups = defaultdict(list)  # (budget, axis, x) -> [(store_all, reconstruct, no_spec or None)]
    for (strategy, budget, workload, axis, x), reconstruct in by_key.items():
        if strategy != "reconstruct":
            continue
        store_all = by_key.get(("store_all", budget, workload, axis, x))
        if store_all is None:
            continue
        groups[(budget, axis, x)].append((store_all, reconstruct, by_key.get(("no_spec", budget, workload, axis, x))))
    rows = []
    for (budget, axis, x), matched in sorted(groups.items(), key=lambda kv: (kv[0][0], kv[0][1], kv[0][2])):
        row = {"budget": budget, "axis": axis, "x": x, "workloads": len(matched)}
        for column, metric, direction in RATIO_COLUMNS:
            row[column] = geomean([_ratio(r, s, metric, direction) for s, r, _ in matched])
        row["preemptions S"] = sum(s.get("server_preemptions") or 0 for s, _, _ in matched)
        row["preemptions R"] = sum(r.get("server_preemptions") or 0 for _, r, _ in matched)
        with_no_spec = [(s, r, n) for s, r, n in matched if n is not None]
        row["S tput / no-spec"] = geomean([_ratio(s, n, "output_throughput", "R/S") for s, _, n in with_no_spec])
        row["R tput / no-spec"] = geomean([_ratio(r, n, "output_throughput", "R/S") for _, r, n in with_no_spec])
        differences = [abs(r["spec_decode_acceptance_length"] - s["spec_decode_acceptance_length"])
                       for s, r, _ in matched
                       if r.get("spec_decode_acceptance_length") and s.get("spec_decode_acceptance_length")]  # fmt: skip
        row["max |accept len R - S|"] = max(differences) if differences else None
        rows.append(row)
    return rows


def _x(p: dict):
    return p["concurrency"] if p["axis"] == "concurrency" else _as_float(p["request_rate"])


def _fmt(value, digits: int = 2) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def write_ratios(rows: list[dict], points: list[dict], record: dict, fails: list[str], out: Path) -> None:
    columns = ["budget", "axis", "x", "workloads", *(c for c, _, _ in RATIO_COLUMNS), "preemptions S",
               "preemptions R", "S tput / no-spec", "R tput / no-spec", "max |accept len R - S|"]  # fmt: skip
    with (out / "ratios.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)

    grid = record["grid"]
    matched = [(s, r) for s in points for r in points
               if s["strategy"] == "store_all" and r["strategy"] == "reconstruct"
               and (s["budget"], s["workload"], s["axis"], _x(s)) == (r["budget"], r["workload"], r["axis"], _x(r))
               and s.get("spec_decode_acceptance_length") and r.get("spec_decode_acceptance_length")]  # fmt: skip
    differences = [abs(r["spec_decode_acceptance_length"] - s["spec_decode_acceptance_length"]) for s, r in matched]
    lines = [
        f"# Serving sweep `{grid['name']}`: reconstruct (R) vs store_all (S)",
        "",
        f"{grid['description']}. Command: `{record['command']}` ({record['date_utc']}).",
        *(f"Earlier call into the same output: `{call['command']}` ({call['date_utc']})."
          for call in record.get("earlier_calls", ())),
        *(f"Setting: {label}." for label in grid.get("labels", ())),
        f"Machine: {record['machine'].get('processor') or record['machine']['platform']}, "
        f"{record['machine']['cpu_count']} CPUs, load average (1/5/15 min) at start "
        f"{record['machine'].get('load_average_1_5_15min_at_start', 'not recorded')}.",
        "",
        "Each cell is a geometric mean over the workloads (`workloads` column) of one ratio per matched point "
        "(same budget, workload and concurrency or arrival rate); > 1 favours reconstruct: tput = R/S output "
        "throughput; KV red. = S/R peak KV-cache usage; p99 TTFT = S/R; mean TPOT = S/R; b = R/S peak running "
        "requests (server side). Preemptions are sums over the same points. `x` is the max concurrency, or for "
        "`request_rate` rows the bursty workload's arrival rate (req/s).",
        "",
        "| " + " | ".join(columns) + " |",
        "| " + " | ".join("---" for _ in columns) + " |",
        *("| " + " | ".join(_fmt(row.get(c)) for c in columns) + " |" for row in rows),
        "",
        f"Acceptance length, reconstruct vs store_all over {len(matched)} matched points: mean |difference| "
        f"{_fmt(sum(differences) / len(differences) if differences else None, 3)}, largest "
        f"{_fmt(max(differences) if differences else None, 3)}.",
        "",
        "Budgets: " + "; ".join(f"{b['name']} ({b['note']})" for b in grid["budgets"]) + ".",
    ]  # fmt: skip
    if fails:
        lines += ["", f"Failed points or servers ({len(fails)}):", *(f"- {f}" for f in fails)]
    (out / "ratios.md").write_text("\n".join(lines) + "\n")


def write_plots(points: list[dict], out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    plot_dir = out / "plots"
    plot_dir.mkdir(exist_ok=True)
    budgets = sorted({p["budget"] for p in points})
    written = []
    for axis, xlabel in (("concurrency", "max concurrency"), ("request_rate", "arrival rate (req/s), bursty")):
        axis_points = [p for p in points if p["axis"] == axis]
        workloads = sorted({p["workload"] for p in axis_points})
        if not axis_points:
            continue
        for metric, ylabel, name in (("output_throughput", "output tokens/s", "throughput"),
                                     ("mean_tpot_ms", "mean TPOT (ms)", "tpot")):  # fmt: skip
            fig, axes = plt.subplots(len(budgets), len(workloads), squeeze=False, sharex=True,
                                     figsize=(3.2 * len(workloads), 2.8 * len(budgets)))  # fmt: skip
            for i, budget in enumerate(budgets):
                for j, workload in enumerate(workloads):
                    ax = axes[i][j]
                    for strategy in STRATEGY_ORDER:
                        series = sorted((_x(p), p[metric]) for p in axis_points if p["budget"] == budget
                                        and p["workload"] == workload and p["strategy"] == strategy
                                        and p[metric] is not None)  # fmt: skip
                        if series:
                            ax.plot(*zip(*series), marker="o", label=strategy)
                    ax.set_xscale("log", base=2)
                    ax.set_title(f"{workload}, {budget}", fontsize=9)
                    if i == len(budgets) - 1:
                        ax.set_xlabel(xlabel)
                    if j == 0:
                        ax.set_ylabel(ylabel)
            axes[0][0].legend(fontsize=8)
            fig.tight_layout()
            path = plot_dir / f"{name}_vs_{axis}.png"
            fig.savefig(path, dpi=110)
            plt.close(fig)
            written.append(path)

    # Pareto, per budget and workload: per-user speed (1000 / mean TPOT) against output throughput over the
    # concurrency (or arrival-rate) sweep; each strategy's front joins the points none of its others beats on
    # both. Log x: short outputs on a starved CPU front end can stream in one chunk, with a TPOT near zero.
    workloads = sorted({p["workload"] for p in points})
    fig, axes = plt.subplots(len(budgets), len(workloads), squeeze=False,
                             figsize=(3.2 * len(workloads), 2.8 * len(budgets)))  # fmt: skip
    for i, budget in enumerate(budgets):
        for j, workload in enumerate(workloads):
            ax = axes[i][j]
            for strategy in STRATEGY_ORDER:
                xy = [(1000.0 / p["mean_tpot_ms"], p["output_throughput"]) for p in points
                      if p["budget"] == budget and p["workload"] == workload and p["strategy"] == strategy
                      and p["mean_tpot_ms"] and p["output_throughput"]]  # fmt: skip
                if not xy:
                    continue
                line = ax.plot(*zip(*pareto_front(xy)), marker="o", label=strategy)[0]
                ax.scatter(*zip(*xy), s=10, alpha=0.4, color=line.get_color())
            ax.set_xscale("log")
            ax.set_title(f"{workload}, {budget}", fontsize=9)
            if i == len(budgets) - 1:
                ax.set_xlabel("tokens/s per user")
            if j == 0:
                ax.set_ylabel("output tokens/s")
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    path = plot_dir / "pareto.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    written.append(path)
    return written


def pareto_front(xy: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Points not beaten on both coordinates (higher is better on both), by increasing x."""
    front = []
    for x, y in sorted(xy, key=lambda p: (-p[0], -p[1])):
        if not front or y > front[-1][1]:
            front.append((x, y))
    return sorted(front)


def write_report(out: Path) -> dict:
    out = Path(out)
    points, record = load_points(out)
    if not points:
        raise SystemExit(f"no measured point under {out / 'raw'}")
    fails = failures(out)
    write_points_csv(points, out / "points.csv")
    rows = ratio_rows(points)
    write_ratios(rows, points, record, fails, out)
    plots = write_plots(points, out)
    print(f"[report] {len(points)} points, {len(rows)} ratio rows, {len(fails)} failures: "
          f"{out / 'points.csv'}, {out / 'ratios.md'}, {len(plots)} plots in {out / 'plots'}", flush=True)  # fmt: skip
    return {"points": points, "ratios": rows, "failures": fails, "plots": plots}
