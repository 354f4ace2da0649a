"""Draft trees against chains at real model shapes (dummy weights), with synthetic acceptance: tokens/s and step time
per batch size, and from them the tree / chain ratios and the break-even sibling rate.

One engine per process (a second `LLM` in one process fails on the GPU); `run_tree_real_shapes.sh` loops over engines
in one device call. An engine is a tree or a chain of the catalog (`ENGINES`), reconstruct (a chain may run store_all,
`--strategy`: reconstruct / store_all at the same shape, issue 51's k = 1 comparison), Model Runner V2 (what
vLLM picks on CUDA), vLLM's default compilation (FULL and piecewise graphs; decode batches padded to the measured batch
sizes' token counts), fp32 GDN state, the shape's layers cut with `--layers` (every layer's size kept: the step's cost
per layer is the real one). Acceptance is synthetic (dummy weights accept nothing): a tree engine takes its classes per
request (`SamplingParams.extra_args`, `vllm_plugin.trees.synthetic`: rank-0 and sibling conditional rates per depth),
so one engine serves every (profile, sibling rate) class; a chain uses vLLM's synthetic chain (engine-wide per-position
rates), so a chain engine serves one profile. Profiles (rank-0 conditional rates per depth):

- `code`: from the unconditional per-position rates 0.917 / 0.837 / 0.648 / 0.538 reported for a Qwen 27B MTP head
  (c_i = p_i / p_{i-1}, vLLM's conversion);
- `prose`: 0.55 at every depth.

Sibling rates (trees): 0.2 and 0.4 (`--sibling-rates`).

Each point (engine, profile, sibling rate, B): B requests of `--prompt-len` random token ids and `--max-tokens`
generated tokens (ignore_eos), all admitted at once; tokens/s = generated / seconds; step time = seconds / the
runner's steps (`gpu_v2_chains.counting_steps`, which also counts V2's FULL-graph replays by token count); acceptance
length from vLLM's spec-decode counters. Right after it, the same requests with one output token time the prefill
step (and a generate's fixed cost), so that the decode step time = (seconds - that) / (steps - its steps): the step
time proper, which a whole-generate mean overstates for whichever engine accepts more (fewer steps share the
prefill). `report` computes per B the tree / chain tokens/s, the step-time ratio (decode steps where both points have
them), and the break-even sibling rate (the sibling rate at which the tree's expected acceptance length,
`spec_decode.synthetic_acceptance.expected_accepted_nodes`, times the chain's step time over the tree's, equals the
chain's measured length), and the expected gain (the tree's expected acceptance length over the chain's under the
class's rates: the tokens/s ratio at equal step times, which a point's measured lengths miss by their sampling noise);
and per chain engine with a store_all twin of the same catalog name and profile, the
reconstruct / store_all tokens/s and step-time ratios (`report.md`'s second table).

`--shape-choice auto` (trees): `draft_tree_max_batch_size: "auto"`, the scheduler choosing the tree or the chain of
its depth each step (`vllm_plugin.trees.adaptive_shape`). Its chain steps take vLLM's synthetic chain, whose rates are
engine-wide, so an auto engine serves one class, the first profile and sibling rate, as its engine rates (no
per-request classes); each of its points is preceded by the same generate unmeasured (the step costs and acceptance a
long-running server has learned). `--staggered N` adds, per engine, a point of N requests whose lengths grow with
their index (request i generates ceil(4 max_tokens (i + 1) / N) tokens): the batch shrinks as they finish, crossing
batch sizes where different shapes pay. `report` then adds the table of auto against the best fixed shape of its class
(the tree engine's point of that class, the chain engine of that profile) per batch and for the staggered point.

On CPU (`--shape fixture`, the dry run): vLLM's CPU backend runs the V1 runner, which has no synthetic tree path and
whose sampler refuses synthetic chains, so acceptance is the fixture's real one and no class is sent; the flow, files
and report are what is checked.

    python3 -m bench.e2e.tree_real_shapes engine --name tree221 --shape qwen35-27b --layers 16 --out OUT
    python3 -m bench.e2e.tree_real_shapes report --out OUT
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import random
import sys
import time
from pathlib import Path

from vllm_treewy.spec_decode.synthetic_acceptance import expected_accepted_nodes
from vllm_treewy.tree import DraftTree

CODE_UNCONDITIONAL = [0.917, 0.837, 0.648, 0.538]
PROFILES = {
    "code": [p / q for p, q in zip(CODE_UNCONDITIONAL, [1.0, *CODE_UNCONDITIONAL[:-1]])],
    "prose": [0.55] * 4,
}
# name -> tree widths (a chain: all 1); the chain a tree is judged against has the tree's depth
CATALOG = {
    "tree221": [2, 2, 1], "tree322": [3, 2, 2], "tree2221": [2, 2, 2, 1], "tree3221": [3, 2, 2, 1],
    "k1": [1], "k3": [1, 1, 1], "k4": [1, 1, 1, 1],
}
STRATEGIES = ("reconstruct", "store_all")
BATCHES = (1, 2, 4, 8, 16, 32, 64)


def is_tree(widths) -> bool:
    return any(w > 1 for w in widths)


def engine_name(name: str, profile: str | None, strategy: str = "reconstruct", sibling: float | None = None) -> str:
    """A chain engine serves one profile: `k3-code`; a tree engine serves all: `tree221`; store_all adds its name:
    `k1-code-store_all`; an auto tree serves one class: `tree221-auto-code-s0.4`."""
    if sibling is not None:
        return f"{name}-auto-{profile}-s{sibling}"
    base = name if profile is None else f"{name}-{profile}"
    return base if strategy == "reconstruct" else f"{base}-{strategy}"


def speculative_config(widths: list[int], profile: str, synthetic: bool, backend: str | None,
                       strategy: str = "reconstruct", auto_sibling: float | None = None) -> dict:
    """The engine's speculative config; `auto_sibling`: a tree under `draft_tree_max_batch_size: "auto"` whose
    engine rates are the class (profile, that sibling rate)."""
    depth = len(widths)
    if is_tree(widths) and strategy != "reconstruct":
        raise ValueError(f"draft trees run under reconstruct only, not {strategy}")
    spec = {"method": "mtp", "num_speculative_tokens": depth, "mamba_state_commit": strategy}
    if is_tree(widths):
        spec["draft_tree_widths"] = widths
        if auto_sibling is not None:
            spec["draft_tree_max_batch_size"] = "auto"
    if backend is not None:
        spec["attention_backend"] = backend  # the drafter picks its own backend unless told
    if synthetic:
        rates = PROFILES[profile][:depth]
        spec["rejection_sample_method"] = "synthetic"
        if is_tree(widths):  # the engine's class; each request sends its own (not an auto tree's)
            spec.update(synthetic_tree_acceptance_rates=rates,
                        synthetic_tree_sibling_rates=[0.4 if auto_sibling is None else auto_sibling] * depth)
        else:  # vLLM's per-position unconditional rates
            unconditional, product = [], 1.0
            for rate in rates:
                product *= rate
                unconditional.append(product)
            spec["synthetic_acceptance_rates"] = unconditional
    return spec


def classes(widths, profiles, sibling_rates, synthetic: bool, auto: bool = False):
    """(profile, sibling rate, extra_args) per measured class of the engine."""
    if not synthetic:
        return [("real", None, None)]
    depth = len(widths)
    if not is_tree(widths):
        return [(profiles[0], None, None)]
    if auto:  # the engine's rates are the class
        return [(profiles[0], sibling_rates[0], None)]
    return [(profile, sibling, {"synthetic_tree_acceptance_rates": PROFILES[profile][:depth],
                                "synthetic_tree_sibling_rates": [sibling] * depth})
            for profile in profiles for sibling in sibling_rates]


def run_engine(args) -> int:
    widths = CATALOG[args.name]
    import vllm_treewy.vllm_plugin as plugin
    from bench.e2e import gpu_site
    from bench.e2e.gpu_v2_chains import counting_steps, engine_facts
    from bench.e2e.gpu_vllm_e2e import device_facts
    from vllm_treewy.vllm_plugin.testing.equivalence import (
        acceptance_since,
        engine,
        kv_cache_report,
        read_acceptance,
    )

    plugin.register()
    gpu_site.seed_model_info_cache()
    from vllm import SamplingParams
    from vllm.platforms import current_platform

    on_cuda = current_platform.is_cuda()
    synthetic = on_cuda  # CPU: the V1 runner (module docstring)
    auto = args.shape_choice == "auto"
    if auto and not is_tree(widths):
        raise SystemExit(f"--shape-choice auto needs a tree, got {args.name}")
    profile = args.profiles[0] if synthetic and (auto or not is_tree(widths)) else None
    auto_sibling = args.sibling_rates[0] if auto else None
    name = (engine_name(args.name, profile, args.strategy, auto_sibling) if synthetic or not auto
            else f"{args.name}-auto")  # the CPU dry run: real acceptance, no class
    tree = DraftTree.from_widths(widths)
    block_len = 1 + (tree.num_nodes if is_tree(widths) else len(widths))
    batches = sorted(args.batches)
    engine_kwargs = dict(max_num_seqs=max(batches), max_num_batched_tokens=max(8192, block_len * max(batches)),
                         max_model_len=(args.prompt_len + max([args.max_tokens, *staggered_lengths(
                                             args.staggered, args.max_tokens)]) + 2 * block_len),
                         gpu_memory_utilization=args.gpu_memory_utilization, mamba_ssm_cache_dtype="float32")
    backend = None
    if on_cuda:
        # vLLM's default compilation (FULL and piecewise graphs), decode batches padded to the measured ones; the
        # site's GDN prefill backend (`gpu_site`). The attention backend is vLLM's pick (FLASH_ATTN on Hopper) for
        # trees and chains alike unless the script's argument names one (both strategies on one backend compare
        # like with like).
        backend = args.attention_backend
        engine_kwargs.update(dict(gpu_site.ENGINE, **({"attention_backend": backend} if backend else {})),
                             enforce_eager=False,
                             compilation_config={"cudagraph_capture_sizes": [block_len * b for b in batches]})
    if args.shape == "fixture":
        from vllm_treewy.fixture import build_fixture

        model = build_fixture(Path(args.work) / "fixture")
        vocab = json.loads((model / "config.json").read_text())["vocab_size"]
        load = {}
    else:
        from bench.sweep.models import SHAPES, prepare_qwen35_shape

        model = prepare_qwen35_shape(Path(args.work) / f"{args.shape}-{args.layers or 'all'}", args.shape,
                                     args.layers).path
        vocab = SHAPES[args.shape]["vocab_size"]
        load = {"load_format": "dummy"}
    spec = speculative_config(widths, profile or args.profiles[0], synthetic, backend, args.strategy, auto_sibling)
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(3, vocab) for _ in range(args.prompt_len)]}
               for _ in range(max(batches))]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = {"engine": name, "widths": widths, "strategy": args.strategy, "shape_choice": args.shape_choice,
              "shape": args.shape, "layers": args.layers,
              "synthetic": synthetic, "speculative_config": spec, "command": " ".join([sys.executable, *sys.argv]),
              "args": vars(args), "device": device_facts(), "points": []}

    def save():  # after the start-up and every point: a run cut by its time limit keeps what it measured
        (out / f"{name}.json").write_text(json.dumps(result, indent=1) + "\n")

    start = time.perf_counter()
    try:
        with engine(str(model), skip_tokenizer_init=True, speculative_config=spec, **load, **engine_kwargs) as llm:
            result["engine_start_s"] = time.perf_counter() - start
            result["kv_cache"] = kv_cache_report(llm).__dict__
            result.update(engine_facts(llm))  # the runner vLLM picked, its compilation mode and FULL graphs
            save()
            llm.generate(prompts[: max(batches)], SamplingParams(max_tokens=8, ignore_eos=True, detokenize=False),
                         use_tqdm=False)  # warm-up at the largest batch
            engine_classes = classes(widths, args.profiles, args.sibling_rates, synthetic, auto)
            for profile_name, sibling, extra_args in engine_classes:
                for batch in batches:
                    params, first_token = (SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True,
                                                          detokenize=False, extra_args=extra_args)
                                           for tokens in (args.max_tokens, 1))
                    if auto:  # what a long-running server has learned at this batch size
                        llm.generate(prompts[:batch], params, use_tqdm=False)
                    before = read_acceptance(llm)
                    with counting_steps(llm) as counts:
                        began = time.perf_counter()
                        outputs = llm.generate(prompts[:batch], params, use_tqdm=False)
                        seconds = time.perf_counter() - began
                    after, steps = read_acceptance(llm), counts["steps"]
                    with counting_steps(llm) as first:  # after: a first generate at B pays one-time costs
                        began = time.perf_counter()
                        llm.generate(prompts[:batch], first_token, use_tqdm=False)
                        prefill_s = time.perf_counter() - began
                    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
                    decode_steps = steps - first["steps"]
                    point = {"profile": profile_name, "sibling_rate": sibling, "batch": batch, "seconds": seconds,
                             "output_tokens": generated, "tokens_per_s": generated / seconds, "steps": steps,
                             "step_ms": 1000 * seconds / max(steps, 1), "prefill_s": prefill_s,
                             "prefill_steps": first["steps"],
                             "decode_step_ms": (1000 * (seconds - prefill_s) / decode_steps
                                                if decode_steps > 0 and seconds > prefill_s else None),
                             "acceptance_length": acceptance_since(before, after).mean_acceptance_length,
                             "full_graph_replays": counts["full_graph_replays"]}
                    result["points"].append(point)
                    save()
                    decode = point["decode_step_ms"]
                    print(f"{name} {profile_name} sibling {sibling} B={batch}: {point['tokens_per_s']:,.0f} tokens/s, "
                          f"step {point['step_ms']:.2f} ms (decode {'-' if decode is None else f'{decode:.2f}'} ms), "
                          f"acceptance {point['acceptance_length']:.2f}", flush=True)
            if args.staggered:
                result["points"].append(staggered_point(llm, prompts, args.staggered, args.max_tokens,
                                                        engine_classes[0]))
                save()
            result["profiles"] = [profile_point(llm, prompts[:batch], args.max_tokens, name)
                                  for batch in args.profile_batch]  # the engine's own class (code, sibling 0.4)
            save()
    except Exception as error:  # a failed start-up or point is a result too
        result["error"] = f"{type(error).__name__}: {error}"[:2000]
        print(result["error"], flush=True)
    save()
    return 0 if "error" not in result else 1


def staggered_lengths(num_requests: int, max_tokens: int) -> list[int]:
    """Output lengths growing with the request's index (mean about 2 max_tokens): the batch shrinks as they finish."""
    return [-(-4 * max_tokens * (i + 1) // num_requests) for i in range(num_requests)]


def staggered_point(llm, prompts, num_requests: int, max_tokens: int, engine_class) -> dict:
    """One generate of `num_requests` requests of `staggered_lengths` in the engine's first class: tokens/s."""
    from vllm import SamplingParams

    from vllm_treewy.vllm_plugin.testing.equivalence import acceptance_since, read_acceptance

    profile_name, sibling, extra_args = engine_class
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, detokenize=False, extra_args=extra_args)
              for n in staggered_lengths(num_requests, max_tokens)]
    requests = (prompts * (-(-num_requests // len(prompts))))[:num_requests]
    before = read_acceptance(llm)
    began = time.perf_counter()
    outputs = llm.generate(requests, params, use_tqdm=False)
    seconds = time.perf_counter() - began
    acceptance = acceptance_since(before, read_acceptance(llm))
    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    point = {"profile": profile_name, "sibling_rate": sibling, "batch": f"staggered-{num_requests}",
             "seconds": seconds, "output_tokens": generated, "tokens_per_s": generated / seconds,
             "acceptance_length": acceptance.mean_acceptance_length}
    print(f"staggered {num_requests} {profile_name} sibling {sibling}: {point['tokens_per_s']:,.0f} tokens/s, "
          f"acceptance {point['acceptance_length']:.2f}", flush=True)
    return point


def profile_point(llm, prompts, max_tokens: int, name: str) -> dict:
    """One generate of `prompts` (the engine's default synthetic class) under the profiler: GPU kernel time by kind
    (`e2e_profile.summarize`) per output token and, with the runner's step count, per engine step."""
    from vllm import SamplingParams

    from bench.e2e.e2e_profile import print_summary, profile_call
    from bench.e2e.gpu_v2_chains import counting_steps

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, detokenize=False)
    with counting_steps(llm) as counts:
        summary = profile_call(lambda: sum(len(o.outputs[0].token_ids)
                                           for o in llm.generate(prompts, params, use_tqdm=False)))
    steps = max(counts["steps"], 1)
    per_step = summary["output_tokens"] / steps  # us per token -> us per step
    summary.update(batch=len(prompts), steps=counts["steps"],
                   wall_us_per_step=summary["wall_us_per_token"] * per_step,
                   gpu_busy_us_per_step=summary["gpu_busy_us_per_token"] * per_step,
                   us_per_step_by_kind={k: v["us_per_token"] * per_step for k, v in summary["kinds"].items()})
    print_summary(f"{name} B={len(prompts)}", summary)
    print(f"{name} B={len(prompts)} per step: {summary['wall_us_per_step']:.0f} us wall, "
          f"{summary['gpu_busy_us_per_step']:.0f} GPU busy; "
          + ", ".join(f"{k} {v:.0f}" for k, v in summary["us_per_step_by_kind"].items()), flush=True)
    return summary


# -- report ------------------------------------------------------------------------------------------------------

def break_even_sibling(widths: list[int], profile: str, chain_length: float, step_ratio: float) -> float | None:
    """The sibling rate s at which the tree's expected acceptance length / its step time equals the chain's measured
    length / its step time (`step_ratio` = tree step / chain step); None when no s in [0, 1] reaches it (0.0: the
    tree pays at any sibling rate)."""
    def gain(s: float) -> float:
        return expected_length(widths, profile, s) / step_ratio

    if gain(0.0) >= chain_length:
        return 0.0
    if gain(1.0) < chain_length:
        return None
    low, high = 0.0, 1.0
    for _ in range(40):
        mid = (low + high) / 2
        low, high = (mid, high) if gain(mid) < chain_length else (low, mid)
    return high


def expected_length(widths: list[int], profile: str, sibling_rate: float) -> float:
    """1 + the expected accepted nodes of the tree (or chain) `widths` under a profile's rank-0 rates and a sibling
    rate: the synthetic sampler's model (`expected_accepted_nodes`)."""
    depth = len(widths)
    rates = [PROFILES[profile][:depth], [sibling_rate] * depth]
    return 1 + expected_accepted_nodes(DraftTree.from_widths(widths).parents, rates)


def expected_gain(widths: list[int], profile: str, sibling_rate: float) -> float:
    """The tree's expected acceptance length over the chain's of its depth (`expected_length`): the tokens/s ratio
    the tree reaches where its step costs the chain's, and over a target ratio the step ratio that target allows."""
    return expected_length(widths, profile, sibling_rate) / expected_length([1] * len(widths), profile, 0.0)


def report(args) -> int:
    out = Path(args.out)
    runs = {}
    for path in sorted(out.glob("*.json")):
        data = json.loads(path.read_text())
        if "points" in data:
            runs[data["engine"]] = data
    rows = []
    for name, run in runs.items():
        widths = run["widths"]
        if not is_tree(widths) or run.get("shape_choice") == "auto":
            continue
        for point in run["points"]:
            if isinstance(point["batch"], str):  # the staggered point: the auto table's
                continue
            profile = point["profile"]
            chain = runs.get(engine_name(f"k{len(widths)}", None if profile == "real" else profile))
            match = [p for p in (chain or {}).get("points", []) if p["batch"] == point["batch"]]
            row = {"tree": name, "chain": chain["engine"] if chain else None, "profile": profile,
                   "sibling_rate": point["sibling_rate"], "batch": point["batch"],
                   "tree_tokens_per_s": point["tokens_per_s"], "tree_step_ms": point["step_ms"],
                   "tree_acceptance_length": point["acceptance_length"]}
            if match:
                c = match[0]
                step_ratio = step_time_ratio(point, c)
                row.update(chain_tokens_per_s=c["tokens_per_s"], chain_step_ms=c["step_ms"],
                           chain_acceptance_length=c["acceptance_length"], tree_decode_step_ms=point.get(
                               "decode_step_ms"), chain_decode_step_ms=c.get("decode_step_ms"),
                           tokens_per_s_ratio=point["tokens_per_s"] / c["tokens_per_s"], step_time_ratio=step_ratio,
                           break_even_sibling_rate=(break_even_sibling(widths, profile, c["acceptance_length"],
                                                                       step_ratio) if profile in PROFILES else None))
            if profile in PROFILES:
                row["expected_gain"] = expected_gain(widths, profile, point["sibling_rate"])
            rows.append(row)
    strategy_rows = strategy_ratios(runs)
    auto_rows = auto_ratios(runs)
    (out / "report.json").write_text(json.dumps({"rows": rows, "strategy_rows": strategy_rows, "auto_rows": auto_rows,
                                                 "engines": sorted(runs),
                                                 "errors": {n: r["error"] for n, r in runs.items() if "error" in r}},
                                                indent=1) + "\n")
    columns = ["tree", "chain", "profile", "sibling_rate", "batch", "tree_tokens_per_s", "chain_tokens_per_s",
               "tokens_per_s_ratio", "tree_step_ms", "chain_step_ms", "tree_decode_step_ms", "chain_decode_step_ms",
               "step_time_ratio", "tree_acceptance_length",
               "chain_acceptance_length", "expected_gain", "break_even_sibling_rate"]
    with open(out / "report.csv", "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=columns, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)

    def cell(value, digits=2):
        return "-" if value is None else f"{value:.{digits}f}" if isinstance(value, float) else str(value)

    lines = ["| tree | chain | profile | sibling | B | tokens/s tree / chain | ratio | step ms tree / chain | step "
             "ratio | acceptance tree / chain | expected gain | break-even sibling |", "|" + "---|" * 12]
    for r in rows:
        if r.get("tree_decode_step_ms") and r.get("chain_decode_step_ms"):  # the ratio's own step times
            r = dict(r, tree_step_ms=r["tree_decode_step_ms"], chain_step_ms=r["chain_decode_step_ms"])
        lines.append(f"| {r['tree']} | {r['chain']} | {r['profile']} | {cell(r['sibling_rate'])} | {r['batch']} | "
                     f"{cell(r['tree_tokens_per_s'], 0)} / {cell(r.get('chain_tokens_per_s'), 0)} | "
                     f"{cell(r.get('tokens_per_s_ratio'))} | {cell(r['tree_step_ms'])} / "
                     f"{cell(r.get('chain_step_ms'))} | {cell(r.get('step_time_ratio'))} | "
                     f"{cell(r['tree_acceptance_length'])} / {cell(r.get('chain_acceptance_length'))} | "
                     f"{cell(r.get('expected_gain'), 3)} | {cell(r.get('break_even_sibling_rate'))} |")
    if strategy_rows:
        lines += ["", "| chain | profile | B | tokens/s reconstruct / store_all | ratio | step ms reconstruct / store_all "
                  "| step ratio |", "|" + "---|" * 7]
        lines += [f"| {r['chain']} | {r['profile']} | {r['batch']} | {cell(r['reconstruct_tokens_per_s'], 0)} / "
                  f"{cell(r['store_all_tokens_per_s'], 0)} | {cell(r['tokens_per_s_ratio'])} | "
                  f"{cell(r['reconstruct_step_ms'])} / {cell(r['store_all_step_ms'])} | {cell(r['step_time_ratio'])} |"
                  for r in strategy_rows]
    if auto_rows:
        lines += ["", "| auto | class | B | tokens/s auto / tree / chain | auto over the best fixed |",
                  "|" + "---|" * 5]
        lines += [f"| {r['auto']} | {r['profile']} s{r['sibling_rate']} | {r['batch']} | "
                  f"{cell(r['auto_tokens_per_s'], 0)} / {cell(r.get('tree_tokens_per_s'), 0)} / "
                  f"{cell(r.get('chain_tokens_per_s'), 0)} | {cell(r.get('over_best_fixed'))} |" for r in auto_rows]
    (out / "report.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


def step_time_ratio(point: dict, other: dict) -> float:
    """`point`'s step time over `other`'s: their decode steps' where both points have them (points written before the
    prefill was timed have none), else the whole generates' mean steps."""
    if point.get("decode_step_ms") and other.get("decode_step_ms"):
        return point["decode_step_ms"] / other["decode_step_ms"]
    return point["step_ms"] / other["step_ms"]


def strategy_ratios(runs: dict) -> list[dict]:
    """Per chain engine that has a store_all twin (`engine_name(..., "store_all")`), per batch both measured: the
    reconstruct / store_all tokens/s and step-time ratios."""
    rows = []
    for name, run in runs.items():
        twin = runs.get(f"{name}-store_all")
        if is_tree(run["widths"]) or run.get("strategy", "reconstruct") != "reconstruct" or twin is None:
            continue
        for point in run["points"]:
            match = [p for p in twin["points"] if p["batch"] == point["batch"] and p["profile"] == point["profile"]]
            if match:
                other = match[0]
                rows.append({"chain": name, "profile": point["profile"], "batch": point["batch"],
                             "reconstruct_tokens_per_s": point["tokens_per_s"],
                             "store_all_tokens_per_s": other["tokens_per_s"],
                             "tokens_per_s_ratio": point["tokens_per_s"] / other["tokens_per_s"],
                             "reconstruct_step_ms": point["step_ms"], "store_all_step_ms": other["step_ms"],
                             "step_time_ratio": step_time_ratio(point, other)})
    return rows


def auto_ratios(runs: dict) -> list[dict]:
    """Per auto engine point (a batch, or the staggered one): its tokens/s against the fixed tree's point of the same
    class (the tree engine of its widths) and the chain's of its depth and profile, and over the better of the two."""
    rows = []
    by_widths = {tuple(r["widths"]): r for r in runs.values() if r.get("shape_choice", "fixed") == "fixed"}
    for name, run in runs.items():
        if run.get("shape_choice") != "auto":
            continue
        tree = by_widths.get(tuple(run["widths"]))
        for point in run["points"]:
            chain = runs.get(engine_name(f"k{len(run['widths'])}", point["profile"]))
            row = {"auto": name, "profile": point["profile"], "sibling_rate": point["sibling_rate"],
                   "batch": point["batch"], "auto_tokens_per_s": point["tokens_per_s"]}
            for key, other, same_class in (("tree", tree, True), ("chain", chain, False)):
                match = [p for p in (other or {}).get("points", []) if p["batch"] == point["batch"]
                         and p["profile"] == point["profile"]
                         and (not same_class or p["sibling_rate"] == point["sibling_rate"])]
                if match:
                    row[f"{key}_tokens_per_s"] = match[0]["tokens_per_s"]
            fixed = [row[k] for k in ("tree_tokens_per_s", "chain_tokens_per_s") if k in row]
            row["over_best_fixed"] = point["tokens_per_s"] / max(fixed) if fixed else None
            rows.append(row)
    return rows


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="role", required=True)
    run = sub.add_parser("engine", help="one engine's points")
    run.add_argument("--name", required=True, choices=sorted(CATALOG))
    run.add_argument("--strategy", default="reconstruct", choices=STRATEGIES, help="chains only: store_all too")
    run.add_argument("--shape", default="qwen35-27b", help="a shape of bench.sweep.models.SHAPES, or 'fixture'")
    run.add_argument("--layers", type=int, default=None, help="cut the shape to this many layers (a multiple of 4)")
    run.add_argument("--profiles", nargs="+", default=["code", "prose"], choices=sorted(PROFILES),
                     help="a chain engine serves the first")
    run.add_argument("--sibling-rates", nargs="+", type=float, default=[0.2, 0.4])
    run.add_argument("--batches", nargs="+", type=int, default=list(BATCHES))
    run.add_argument("--prompt-len", type=int, default=256)
    run.add_argument("--max-tokens", type=int, default=128)
    run.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    run.add_argument("--attention-backend", default=None, help="default: vLLM's pick, for the target and the drafter")
    run.add_argument("--shape-choice", default="fixed", choices=("fixed", "auto"),
                     help="trees: auto is draft_tree_max_batch_size 'auto' (one class: the first profile and sibling)")
    run.add_argument("--staggered", type=int, default=0,
                     help="N > 0: a point of N requests of growing lengths (staggered_lengths), the batch shrinking")
    run.add_argument("--profile-batch", nargs="*", type=int, default=[],
                     help="after the timed points, one profiled generate per batch size (kernel time by kind)")
    run.add_argument("--work", default="/tmp/tree-real-shapes", help="where the model directories are written")
    run.add_argument("--out", required=True)
    rep = sub.add_parser("report", help="ratios and break-even sibling rates from an output folder")
    rep.add_argument("--out", required=True)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    return run_engine(args) if args.role == "engine" else report(args)


if __name__ == "__main__":
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    raise SystemExit(main())
