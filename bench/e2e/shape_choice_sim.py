"""`draft_tree_max_batch_size: "auto"` against the fixed tree and the chain of its depth, SIMULATED on the CPU: the
scheduler's own `AdaptiveShape` (`vllm_plugin.trees.adaptive_shape`, the production object) driven by stand-in
scheduler outputs, with step times taken from a measured `tree_real_shapes` run and acceptance drawn from the
synthetic model. A prediction from measured costs, not a measurement: it says what the choice does with the costs
a device showed (how fast it settles, what exploring costs, where it switches), before the device run judges it.

Model. A step of B requests verifying a shape takes that shape's measured decode step time at B (`--costs`: the tree
engine's point of the class, the chain engine of the profile; linear between measured batch sizes, the nearest end
outside them), advancing the clock `AdaptiveShape` reads. Each request then accepts drafts by the synthetic model
(`spec_decode.synthetic_acceptance`'s rates: per depth the rank-0 rate of the profile and the sibling rate; a chain
continues at depth d with the rank-0 rate, the tree with 1 - (1 - r_d)(1 - s_d) ** (w_d - 1)) and emits them plus the
bonus, up to its length. Requests decode from the start (no prefill steps: the same for every policy). Policies: the
tree at every step, the chain at every step, "auto". Per batch B: B requests of `--tokens` tokens each, tokens/s over
the whole run; and the staggered workload (`--staggered N`: `tree_real_shapes.staggered_lengths`), whose batch shrinks.

    python3 -m bench.e2e.shape_choice_sim --costs bench/results/tree_real_shapes/qwen35_27b_l16 \\
        --tree tree221 --profile prose --sibling 0.4 --out OUT
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from bench.e2e.tree_real_shapes import CATALOG, PROFILES, engine_name, staggered_lengths
from vllm_treewy.tree import DraftTree

POLICIES = ("tree", "chain", "auto")


def step_times(costs_dir: Path, tree: str, profile: str, sibling: float) -> dict[str, tuple[list, list]]:
    """Per shape, (batch sizes, decode step ms) of the measured run: the tree engine's points of the class, the chain
    engine's of the profile."""
    widths = CATALOG[tree]
    found = {}
    for shape, name, keep in (("tree", tree, lambda p: p["sibling_rate"] == sibling),
                              ("chain", engine_name(f"k{len(widths)}", profile), lambda p: True)):
        run = json.loads((costs_dir / f"{name}.json").read_text())
        points = sorted((p["batch"], p.get("decode_step_ms") or p["step_ms"]) for p in run["points"]
                        if isinstance(p["batch"], int) and p["profile"] == profile and keep(p))
        if not points:
            raise SystemExit(f"{costs_dir}/{name}.json has no {profile} points (sibling {sibling} for the tree)")
        found[shape] = tuple(map(list, zip(*points)))
    return found


def continuation_rates(widths: list[int], profile: str, sibling: float) -> dict[str, np.ndarray]:
    from vllm_treewy.spec_decode.acceptance_estimate import tree_continuation

    rank0 = np.array(PROFILES[profile][:len(widths)])
    return {"tree": tree_continuation(rank0, np.full_like(rank0, sibling), widths), "chain": rank0}


def simulate(policy: str, lengths: list[int], widths: list[int], times, rates, max_num_seqs: int,
             seed: int) -> dict:
    """Runs the requests of `lengths` to the end under `policy` twice, the first unmeasured (for "auto": what a
    long-running server has learned, as the device bench's auto points do); the second's tokens/s and the steps
    each shape was drafted."""
    from vllm_treewy.vllm_plugin.trees.adaptive_shape import AdaptiveShape

    clock = SimpleNamespace(now=0.0)
    adaptive = AdaptiveShape(widths, max_num_seqs, lambda: clock.now) if policy == "auto" else None
    run(policy, lengths, widths, times, rates, max_num_seqs, (seed, 0), clock, adaptive)
    return run(policy, lengths, widths, times, rates, max_num_seqs, (seed, 1), clock, adaptive)


def run(policy, lengths, widths, times, rates, max_num_seqs, seed, clock, adaptive) -> dict:
    """One pass over the requests. Each request draws its acceptance from its own generator (seeded by the run and
    its index: every policy sees the same draws, so their ratios are not the draws' noise)."""
    from vllm_treewy.spec_decode.acceptance_estimate import TREE, expected_lengths

    depth, num_nodes = len(widths), DraftTree.from_widths(widths).num_nodes
    began = clock.now
    rngs = [np.random.default_rng((*seed, r)) for r in range(len(lengths))]
    remaining = dict(enumerate(lengths))
    waiting = list(remaining)
    running: dict[int, int] = {}  # request -> drafts it holds
    finished: set[str] = set()
    drafted = {"tree": 0, "chain": 0}
    tokens = 0
    while running or waiting:
        while waiting and len(running) < max_num_seqs:
            running[waiting.pop(0)] = num_nodes if policy != "chain" else depth
        output = SimpleNamespace(
            num_scheduled_tokens={str(r): 1 + k for r, k in running.items()},
            scheduled_spec_decode_tokens={str(r): [-1] * k for r, k in running.items()},
            scheduled_new_reqs=[], num_spec_tokens_to_schedule=num_nodes if policy != "chain" else depth,
            finished_req_ids=finished)
        if adaptive is not None:
            adaptive.forget(finished)
            adaptive.choose(output)
        finished = set()
        next_drafts = output.num_spec_tokens_to_schedule
        drafted["tree" if next_drafts == num_nodes else "chain"] += 1
        batch = len(running)
        shapes = {r: "tree" if k == num_nodes else "chain" for r, k in running.items()}
        # a step holds one shape (trees.budget): the shape of the drafts most rows hold; the others' are dropped
        shape = max(("tree", "chain"), key=lambda s: sum(v == s for v in shapes.values()))
        clock.now += np.interp(batch, *times[shape]) / 1e3
        emitted = {}
        for r in running:
            accepted = 0
            if shapes[r] == shape:
                while accepted < depth and rngs[r].random() < rates[shape][accepted]:
                    accepted += 1
            emitted[r] = min(accepted + 1, remaining[r])
        if adaptive is not None:
            adaptive.observe(
                SimpleNamespace(scheduled_spec_decode_tokens={str(r): [-1] * running[r] for r in running
                                                              if shapes[r] == shape}),
                SimpleNamespace(req_id_to_index={str(r): i for i, r in enumerate(running)},
                                sampled_token_ids=[[0] * emitted[r] for r in running]))
        for r in list(running):
            tokens += emitted[r]
            remaining[r] -= emitted[r]
            if remaining[r] == 0:
                del running[r]
                finished.add(str(r))
            else:
                running[r] = next_drafts
    result = {"tokens_per_s": tokens / (clock.now - began), "seconds": clock.now - began, "drafted": drafted}
    if adaptive is not None:
        result["learned_tree_expected_length"] = float(expected_lengths(adaptive.table.engine_continuation())[TREE])
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--costs", required=True, help="a tree_real_shapes output folder (decode step times)")
    parser.add_argument("--tree", default="tree221", choices=[n for n, w in CATALOG.items() if max(w) > 1])
    parser.add_argument("--profile", default="code", choices=sorted(PROFILES))
    parser.add_argument("--sibling", type=float, default=0.4)
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 2, 4, 8, 16, 32, 64])
    parser.add_argument("--tokens", type=int, default=256, help="tokens a request generates (batch points)")
    parser.add_argument("--staggered", type=int, default=64, help="N requests of staggered_lengths(N, --tokens / 2)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    widths = CATALOG[args.tree]
    times = step_times(Path(args.costs), args.tree, args.profile, args.sibling)
    rates = continuation_rates(widths, args.profile, args.sibling)
    workloads = [(str(b), [args.tokens] * b, b) for b in args.batches]
    if args.staggered:
        workloads.append((f"staggered-{args.staggered}", staggered_lengths(args.staggered, args.tokens // 2),
                          args.staggered))
    rows = []
    for name, lengths, max_num_seqs in workloads:
        row = {"workload": name}
        for policy in POLICIES:
            row[policy] = simulate(policy, lengths, widths, times, rates, max_num_seqs, args.seed)
        best = max(row["tree"]["tokens_per_s"], row["chain"]["tokens_per_s"])
        row["auto_over_best_fixed"] = row["auto"]["tokens_per_s"] / best
        row["auto_over_worst_fixed"] = row["auto"]["tokens_per_s"] / min(row["tree"]["tokens_per_s"],
                                                                         row["chain"]["tokens_per_s"])
        rows.append(row)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"{args.tree}-{args.profile}-s{args.sibling}"
    (out / f"{stem}.json").write_text(json.dumps({"command": " ".join([sys.executable, *sys.argv]),
                                                  "args": vars(args), "step_times_ms": times, "rows": rows},
                                                 indent=1) + "\n")
    lines = [f"{stem} (costs: {args.costs})", "", "| workload | tokens/s tree / chain / auto | auto over best fixed | "
             "over worst | auto's steps drafting tree / chain |", "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['workload']} | {r['tree']['tokens_per_s']:.0f} / {r['chain']['tokens_per_s']:.0f} / "
                     f"{r['auto']['tokens_per_s']:.0f} | {r['auto_over_best_fixed']:.3f} | "
                     f"{r['auto_over_worst_fixed']:.3f} | {r['auto']['drafted']['tree']} / "
                     f"{r['auto']['drafted']['chain']} |")
    (out / f"{stem}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
