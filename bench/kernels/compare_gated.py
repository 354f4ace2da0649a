"""Before/after table of two `bench/kernels/gated_bench.py` runs (the same rows; a run of an older checkout's own bench, whose
records carry `config` where this one's carry `launch`): the step at the launch table's launch per chain (T, B,
state) and tree (widths, B, state) row, with the compiled store_all kernel and the per-node serial baseline where
the newer run has them.

    python3 bench/kernels/compare_gated.py BEFORE.json AFTER.json [--limit 1.03]

Exit status 1 when an AFTER row is slower than BEFORE's by more than --limit (a ratio)."""

import argparse
import json
import sys


def rows(path):
    """{key: record} of a run's timed rows at the default launch (no candidate)."""
    found = {}
    for r in json.load(open(path))["records"]:
        if "times_us" not in r or r.get("launch", r.get("config")) not in ("launch table", "launch default", "default"):
            continue
        key = ("tree " + r["gated_tree"], r["B"], r["state"]) if "gated_tree" in r else (f"T={r['T']}", r["B"],
                                                                                            r["state"])
        found[key] = r
    return found


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("before")
    parser.add_argument("after")
    parser.add_argument("--limit", type=float, default=1.03)
    args = parser.parse_args()
    before, after = rows(args.before), rows(args.after)
    print("| row | B | state | before (us) | after (us) | after / before | compiled store_all (us) | "
          "compiled / after | serial / after |")
    print("|---|---|---|---|---|---|---|---|---|")
    worst = 0.0
    for key in sorted(after, key=lambda k: (not k[0].startswith("T="), k[0], k[2], k[1])):
        new = after[key]["times_us"]["ours fused"]
        old = before.get(key, {}).get("times_us", {}).get("ours fused")
        ratio = new / old if old else None
        worst = max(worst, ratio or 0.0)
        compiled = after[key]["times_us"].get("compiled store_all")
        serial = after[key].get("serial_per_node_us")
        print(f"| {key[0]} | {key[1]} | {key[2]} | {old or ''} | {new} | {f'{ratio:.3f}' if ratio else ''} | "
              f"{compiled or ''} | {f'{compiled / new:.2f}x' if compiled else ''} | "
              f"{f'{serial / new:.2f}x' if serial else ''} |")
    missing = sorted(set(before) - set(after))
    if missing:
        print("rows only before:", missing)
    print(f"worst after / before: {worst:.3f} (limit {args.limit})")
    sys.exit(1 if worst > args.limit else 0)


if __name__ == "__main__":
    main()
