"""python -m bench.sweep {list, run GRID --out DIR, report DIR}: see bench/sweep/README.md."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="python -m bench.sweep", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("list", help="the grids and their sizes")
    run = sub.add_parser("run", help="run a grid through `vllm bench sweep serve`, then write its report")
    run.add_argument("grid")
    run.add_argument("--out", required=True, help="output directory; one holding results resumes")
    run.add_argument("--only", nargs="+",
                     help="run only these servers (names as `STRATEGY-BUDGET`), in this order")
    run.add_argument("--points", nargs="+",
                     help="run only these benchmark points (names as `WORKLOAD-cN` or `WORKLOAD-rRATE`; `NAME-profile`: "
                          "NAME's workload under vLLM's torch profiler, not a measurement), in this order")
    run.add_argument("--model-dir", help="where the model files go (default OUT/model); runs with other --out "
                     "that share it start warm: the model's path is part of vLLM's torch.compile cache key")
    run.add_argument("--port", type=int, help="server port on 127.0.0.1 (default: a free one)")
    run.add_argument("--dry-run", action="store_true", help="write the parameter files and print the commands")
    run.add_argument("--no-report", action="store_true")
    run.add_argument("--process-per-point", action="store_true",
                     help="run each point in its own process instead of one warm benchmark worker")
    report = sub.add_parser("report", help="(re)write the CSV, ratio table and plots of a grid's output")
    report.add_argument("out")
    args = parser.parse_args(argv)

    from bench.sweep.grids import GRIDS

    if args.command == "list":
        for grid in GRIDS.values():
            servers = len(grid.budgets) * len(grid.strategies)
            print(f"{grid.name}: {servers} servers, {grid.num_points} points: {grid.description}")
        return 0
    if args.command == "run":
        if args.grid not in GRIDS:
            parser.error(f"unknown grid {args.grid!r}; known: {', '.join(GRIDS)}")
        from bench.sweep.run import main as run_main

        return run_main(args, argv)
    from bench.sweep.report import write_report

    write_report(Path(args.out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
