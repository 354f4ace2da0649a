"""Prefix caching of GDN states (vLLM's `mamba_cache_mode="align"`, its default for Qwen3.5 whenever prefix caching is
on, as it is by default on GPU) with reconstruct (MTP chains and draft trees), store_all and no speculation, in real
vLLM 0.32 on the H200, all engines at once in one device call (`bench/e2e/run_gpu_prefix_caching.sh`).

Engines (one process each, started at once with a fixed KV budget; `--kv-cache-memory-bytes` skips vLLM's memory
profiling, which the others' allocations would disturb; tokens/s are not measured):
- `spec --strategy reconstruct|store_all|none`: MTP k = 3 (or none) with vLLM's default prefix caching (its default
  retention: the prompts' replay boundaries), on the runner vLLM picks (Model Runner V2 on CUDA, reconstruct with
  prefix caching included since issue 35), or forced onto V1 with `--runner v1` (VLLM_USE_V2_MODEL_RUNNER=0; the run's
  name ends in `-v1`). Each run records the runner vLLM picked and the runner class that ran it.
  `--tree-widths 2 2 1` (reconstruct only: the plugin refuses store_all trees on GPU, and this parser refuses them
  with exit 2): the MTP draft tree of those widths instead of the chain (`draft_tree_widths`, num_speculative_tokens
  = its depth; CUDA graphs at 1 + its N nodes tokens per request; the run's name says `-tree221` instead of `-k3`),
  on the long-context copy of the fixture's blurred-MTP variant (`--blurred-mtp`, which the script passes to tree
  runs: the target weights are the fixture's, only the MTP head is less sure, so the trees branch; the reference's
  plain copy judges it). With `--dense` a tree runs the two-turn chats below.
  The shared-prefix workload: 64 requests over 8 prefixes of 15,000 tokens (past two attention blocks of every engine:
  5,000-7,000 tokens with the fp32 state, so hits happen; the long-context fixture copy, 16,384 positions), each with
  its own suffix, 48 greedy tokens, at B = 1 (16 requests, one at a time), 8 (64, eight at a time) and 64 (all at
  once), the prefix cache reset before each B. Records the outputs, vLLM's `vllm:prefix_cache_hits` / `_queries` per
  B and each request's cached tokens, the KV report (GDN pages per request) and the runner.
- `spec --strategy reconstruct --dense`: reconstruct keeping every boundary state (`prefix_cache_retention_interval`
  None): two turns of 8 chats whose first turn's prompt ends 1-8 tokens before the first boundary of this engine's
  block size and decodes past the second, so that the second turn (prompt + the first turn's output + 64 tokens)
  resumes from the GDN state reconstruct wrote at a boundary while decoding (its `boundary_states` kernel).
- `reference`: no speculation, prefix caching off, raw logits: the same batches, then it judges every run that
  arrives (tie-aware: a divergence passes within one bf16 step of the reference's top two logits, or where the fp64
  fixture, on the GPU, does not prefer the reference's token by more), generating each dense run's two turns'
  references from that run's own prompts. The verdict passes when every reconstruct run (chain or tree) passes, ran
  without an error, counted prefix-cache hits in each batch of more than 8 requests and, on the runner vLLM picked,
  ran on `--expect-reconstruct-runner` (default V2), and all `--expect` runs arrived; `runners` in the report lists
  each run's runner, `trees` each tree run's widths.
- `serve-check`: the README's first `vllm serve` command (`--tree`: its second, the [2,2,1] tree; README_SPECS holds
  both, as the README writes them, tests/bench_scripts check that) with prefix caching left to vLLM (on), the site's
  backends and a 4 GiB KV budget: one greedy completion and one chat completion at temperature 0.8, then /metrics
  (per-position accepted drafts, drafts, accepted tokens, tree fallbacks, prefix-cache hits and queries) into the
  output JSON and the summary line.

    python3 bench/e2e/gpu_prefix_caching.py spec --strategy reconstruct --runs R --dtype float16 ...
    python3 bench/e2e/gpu_prefix_caching.py reference --runs R --expect 4 --out report.json --dtype float16 ...
    python3 bench/e2e/gpu_prefix_caching.py spec --strategy reconstruct --tree-widths 2 2 1 --blurred-mtp --runs R ...
    python3 bench/e2e/gpu_prefix_caching.py serve-check [--tree] --out serve.json ...  # the README's `vllm serve`
    ... --dry-run  # any role: checks and prints the parsed arguments (spec: also its run name, speculative config
                   # and tokens per request; serve-check: its command), starts nothing (DRY_RUN=1 in the script)

The runs are fp16 (activations): fp16 rounds 8x finer than bf16, so the batch shape stays within the verdict's one
bf16 step at B = 64 and a divergence beyond it is a wrong state (bench/results/gpu_vllm_e2e/README.md).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import traceback
import urllib.request
from dataclasses import asdict
from pathlib import Path

from bench.e2e import gpu_site, gpu_v2_chains
from bench.e2e.gpu_v2_chains import engine_facts
from bench.e2e.gpu_vllm_e2e import (LONG_CONTEXT_POSITIONS, add_common_args, device_facts, engine_kwargs,
                                long_context_model, prompts_and_model, tree_model, verdict_record)
from bench.soak.server import README_SPECS  # the README's two `vllm serve` commands' speculative configs

K = 3
PREFIXES, PREFIX_TOKENS, MAX_TOKENS = 8, 15000, 48
BATCHES = {1: 16, 8: 64, 64: 64}  # B -> requests, B at a time
TURNS, NEXT_TURN_TOKENS, SECOND_TOKENS = 8, 64, 16
RUNS_WAIT_S = 400  # the reference's longest wait for the runs (from its start), leaving time to judge them


def corpus(prompts, length: int) -> list[int]:
    tokens = [t for p in prompts for t in p]
    return (tokens * (1 + length // len(tokens)))[:length]


def shared_prefix_workload(tokens: list[int], prefix_tokens: int, num_requests: int) -> list[list[int]]:
    """Prompts i = 0, 1, ...: prefix i % 8 (8 cuts of `prefix_tokens`, 997 apart) + suffix i (16-63 tokens from
    elsewhere)."""
    prefixes = [tokens[997 * j: 997 * j + prefix_tokens] for j in range(PREFIXES)]
    base = 997 * PREFIXES + prefix_tokens
    return [prefixes[i % PREFIXES] + tokens[base + 61 * i: base + 61 * i + 16 + (7 * i) % 48]
            for i in range(num_requests)]


def prefix_cache_counts(llm) -> tuple[int, int]:
    metrics = {m.name: m for m in llm.get_metrics()}
    return tuple(int(metrics[f"vllm:prefix_cache_{n}"].value) if f"vllm:prefix_cache_{n}" in metrics else 0
                 for n in ("hits", "queries"))


def generate(llm, prompts, max_tokens: int):
    from vllm_treewy.vllm_plugin.testing.equivalence import greedy_params

    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy_params(max_tokens), use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs], [o.num_cached_tokens or 0 for o in outputs]


def run_batches(llm, prompts, batches: dict[int, int], max_tokens: int, caching: bool) -> dict:
    """Per B: the outputs of `batches[B]` requests submitted B at a time, each request's cached tokens and the hit
    rate vLLM counted (the prefix cache reset first)."""
    results = {}
    for b, n in batches.items():
        if caching:
            llm.reset_prefix_cache()
        hits, queries = prefix_cache_counts(llm)
        start = time.perf_counter()
        outputs, cached = [], []
        for first in range(0, n, b):
            out, hit = generate(llm, prompts[first: first + b], max_tokens)
            outputs += out
            cached += hit
        hits_after, queries_after = prefix_cache_counts(llm)
        results[str(b)] = {"outputs": outputs, "cached_tokens": cached, "prefix_cache_hits": hits_after - hits,
                           "prefix_cache_queries": queries_after - queries,
                           "hit_rate": (hits_after - hits) / max(queries_after - queries, 1),
                           "seconds": time.perf_counter() - start}
        print(f"  batch {b}: {n} requests, hit rate {results[str(b)]['hit_rate']:.3f} "
              f"({hits_after - hits:,} of {queries_after - queries:,} tokens), "
              f"{sum(c > 0 for c in cached)} requests hit", flush=True)
    return results


def two_turns(llm, tokens: list[int], block: int) -> dict:
    """The dense run's chats: first turns end 1..TURNS tokens before `block` and decode block + 64 tokens; second
    turns are each first turn's prompt + output + NEXT_TURN_TOKENS more."""
    first = [tokens[131 * i: 131 * i + block - 1 - i] for i in range(TURNS)]
    out1, cached1 = generate(llm, first, block + 64)
    second = [p + o + tokens[50000 + 89 * i: 50000 + 89 * i + NEXT_TURN_TOKENS] for i, (p, o) in enumerate(zip(first,
                                                                                                           out1))]
    out2, cached2 = generate(llm, second, SECOND_TOKENS)
    past = sum(c > len(p) for c, p in zip(cached2, first))
    print(f"  two turns: {past} of {TURNS} second turns resumed past their first turn's prompt {cached2}", flush=True)
    return {"block": block, "first": first, "first_outputs": out1, "second": second, "second_outputs": out2,
            "second_cached_tokens": cached2, "resumed_past_first_prompt": past}


def run_name(args) -> str:
    """`none`, or STRATEGY-k3 / STRATEGY-tree221 (a tree's widths), then `-dense` and `-v1` where they apply."""
    if args.strategy == "none":
        name = "none"
    else:
        name = args.strategy + (f"-tree{''.join(map(str, args.tree_widths))}" if args.tree_widths else f"-k{K}")
    return name + ("-dense" if args.dense else "") + ("-v1" if args.runner == "v1" else "")


def _as_v2_chains_run(args) -> argparse.Namespace:
    """This run as `bench.e2e.gpu_v2_chains` names its shape (a chain of K drafts or the tree, no threshold)."""
    return argparse.Namespace(strategy=args.strategy, k=K, tree_widths=args.tree_widths, tree_max_batch_size=None,
                              attention_backend=args.attention_backend)


def speculative_config(args) -> dict | None:
    """MTP with the strategy, the chain of K drafts or the tree (`gpu_v2_chains.speculative_config`); None without
    speculation."""
    return None if args.strategy == "none" else gpu_v2_chains.speculative_config(_as_v2_chains_run(args))


def tokens_per_request(args) -> int:
    """The tokens one request verifies per decode step (the CUDA graphs' sizes per request): 1 without speculation,
    else `gpu_v2_chains.tokens_per_request`."""
    return 1 if args.strategy == "none" else gpu_v2_chains.tokens_per_request(_as_v2_chains_run(args))


def run_spec(args) -> int:
    import vllm_treewy.vllm_plugin as plugin
    from vllm_treewy.vllm_plugin.testing.equivalence import engine, kv_cache_report, read_acceptance

    plugin.register()  # in-process engine: this process is the only vLLM process
    model, prompts = tree_model(args)  # the fixture, or its blurred-MTP variant (same target weights)
    model = long_context_model(model)
    name = run_name(args)
    kwargs = engine_kwargs(args, tokens_per_request(args))
    kwargs.update(enable_prefix_caching=True, max_model_len=LONG_CONTEXT_POSITIONS)
    if args.strategy != "none":
        kwargs["speculative_config"] = speculative_config(args)
    if args.dense:
        kwargs["prefix_cache_retention_interval"] = None
    tokens = corpus(prompts, 60000)
    result = {"name": name, "strategy": args.strategy, "dense": args.dense, "tree_widths": args.tree_widths,
              "blurred_mtp": args.blurred_mtp, "model": model, "tokens_per_request": tokens_per_request(args)}
    start = time.perf_counter()
    try:
        with engine(model, **kwargs) as llm:
            config = llm.llm_engine.vllm_config
            result.update(engine_start_s=time.perf_counter() - start,
                          mamba_cache_mode=config.cache_config.mamba_cache_mode,
                          prefix_cache_retention_interval=config.cache_config.prefix_cache_retention_interval,
                          **engine_facts(llm), kv_cache=asdict(kv_cache_report(llm)))
            print(name, "started", json.dumps({k: v for k, v in result.items() if k != "kv_cache"}),
                  result["kv_cache"], flush=True)
            if args.dense:
                block = args.turn_block or result["kv_cache"]["attention_block_size"]
                result["two_turns"] = two_turns(llm, tokens, block)
            else:
                result["batches"] = run_batches(llm, shared_prefix_workload(tokens, args.prefix_tokens,
                                                                            max(args.batches.values())),
                                                args.batches, args.max_tokens, caching=True)
            acceptance = read_acceptance(llm)
            result["acceptance_rate"] = None if acceptance is None else acceptance.acceptance_rate
    except Exception:  # recorded for the reference's report (vLLM's CPU backend cannot run store_all with caching)
        result["error"] = traceback.format_exc()[-3000:]
        print(name, "FAILED", result["error"], flush=True)
    Path(args.runs).mkdir(parents=True, exist_ok=True)
    staging = Path(args.runs) / f"{name}.json.partial"
    staging.write_text(json.dumps(result))
    staging.rename(Path(args.runs) / f"{name}.json")  # whole: the reference reads runs as they arrive
    print(name, "done", flush=True)
    return 0


def exact_logits_on(model: str):
    """The fp64 fixture's next-token logits, on the GPU where there is one (a 15,000-token context in fp64 on the
    host would take tens of seconds a divergence)."""
    import torch

    from vllm_treewy.fixture.exact import ExactModel

    exact = ExactModel(model)
    device = "cuda" if torch.cuda.is_available() else "cpu"

    @torch.no_grad()
    def next_token_logits(token_ids):
        nonlocal device
        if device == "cuda":
            try:
                module = exact._model.to(device)
                return module(torch.tensor([token_ids], device=device)).logits[0, -1].cpu()
            except Exception:  # a transformers kernel without fp64 on CUDA: the host from now on
                traceback.print_exc()
                exact._model.to("cpu")
                device = "cpu"
        return exact.next_token_logits(token_ids)

    return next_token_logits


def _arriving_runs(runs: Path, expect: int, deadline: float):
    """Each run's JSON as it arrives (each written whole: `run_spec` renames it into place), until `expect` have
    arrived or the deadline passes: the reference judges one run while the others still run."""
    seen: set[Path] = set()
    while True:
        new = sorted(path for path in runs.glob("*.json") if path not in seen)
        for path in new:
            seen.add(path)
            yield path
        if len(seen) >= expect or time.monotonic() >= deadline:
            return
        if not new:
            time.sleep(2)


def run_reference(args) -> int:
    from vllm_treewy.vllm_plugin.testing.equivalence import compare_tie_aware, engine, generate_greedy, kv_cache_report

    model, prompts = prompts_and_model(args.fixture_architecture)
    model = long_context_model(model)
    tokens = corpus(prompts, 60000)
    workload = shared_prefix_workload(tokens, args.prefix_tokens, max(args.batches.values()))
    report = {"command": args.command or " ".join([sys.executable, *sys.argv]), **device_facts(),
              "mode": "eager (enforce_eager), compiled ops" if args.eager else
              "default (torch.compile + CUDA graphs), compiled ops", "model_dtype": args.dtype,
              "ssm_cache_dtype": args.ssm_cache_dtype, "prefix_tokens": args.prefix_tokens,
              "max_tokens": args.max_tokens, "batches": {str(b): n for b, n in args.batches.items()}, "runs": {}}
    exact_logits = exact_logits_on(model)
    kwargs = engine_kwargs(args, 1)
    kwargs.update(enable_prefix_caching=False, max_model_len=LONG_CONTEXT_POSITIONS)
    deadline = time.monotonic() + args.runs_wait_s
    with engine(model, logprobs_mode="raw_logits", **kwargs) as reference:
        report["reference_kv_cache"] = asdict(kv_cache_report(reference))
        expected = run_batches(reference, workload, args.batches, args.max_tokens, caching=False)
        report["reference_seconds"] = {b: r["seconds"] for b, r in expected.items()}
        for path in _arriving_runs(Path(args.runs), args.expect, deadline):
            run = json.loads(path.read_text())
            entry = {k: v for k, v in run.items() if k not in ("batches", "two_turns")}
            if "batches" in run:
                entry["batches"] = {}
                for b, r in run["batches"].items():
                    n = args.batches[int(b)]
                    verdict = compare_tie_aware(reference, workload[:n], expected[b]["outputs"], r["outputs"],
                                                exact_logits)
                    entry["batches"][b] = {**{k: v for k, v in r.items() if k != "outputs"},
                                           "verdict": verdict_record(verdict)}
                    print(f"{run['name']} batch {b}: hit rate {r['hit_rate']:.3f}; {verdict.summary()}", flush=True)
            if "two_turns" in run:
                turns = run["two_turns"]
                entry["two_turns"] = {k: v for k, v in turns.items() if k in ("block", "second_cached_tokens",
                                                                               "resumed_past_first_prompt")}
                for key, prompts_key, outputs_key, n in (("first", "first", "first_outputs", turns["block"] + 64),
                                                         ("second", "second", "second_outputs", SECOND_TOKENS)):
                    ref = generate_greedy(reference, turns[prompts_key], [n] * len(turns[prompts_key]))
                    verdict = compare_tie_aware(reference, turns[prompts_key], ref, turns[outputs_key], exact_logits)
                    entry["two_turns"][f"{key}_turn_verdict"] = verdict_record(verdict)
                    print(f"{run['name']} {key} turn: {verdict.summary()}", flush=True)
            report["runs"][run["name"]] = entry
    report["gdn_pages_per_request"] = {name: e.get("kv_cache", {}).get("gdn_blocks_per_request")
                                       for name, e in report["runs"].items()}
    report["runners"] = {name: [e.get("model_runner"), e.get("runner_class")] for name, e in report["runs"].items()}
    report["trees"] = {name: e["tree_widths"] for name, e in report["runs"].items() if e.get("tree_widths")}
    report["expect_reconstruct_runner"] = args.expect_reconstruct_runner
    report["hit_rates"] = {name: {b: r["hit_rate"] for b, r in e.get("batches", {}).items()}
                           for name, e in report["runs"].items()}
    print("GDN pages per request:", report["gdn_pages_per_request"], flush=True)
    print("hit rates:", report["hit_rates"], flush=True)
    print("runners:", report["runners"], flush=True)
    print("trees:", report["trees"], flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    verdicts = [b["verdict"] for name, e in report["runs"].items() if name.startswith("reconstruct")
                for b in e.get("batches", {}).values()]
    verdicts += [v for name, e in report["runs"].items() if name.startswith("reconstruct")
                 for key, v in e.get("two_turns", {}).items() if key.endswith("_verdict")]
    hits = all(r["prefix_cache_hits"] > 0 for name, e in report["runs"].items() if name.startswith("reconstruct")
               for b, r in e.get("batches", {}).items() if args.batches[int(b)] > PREFIXES)
    picked = [e.get("model_runner") for name, e in report["runs"].items()
              if name.startswith("reconstruct") and not name.endswith("-v1") and "error" not in e]
    on_runner = args.expect_reconstruct_runner == "any" or all(r == args.expect_reconstruct_runner for r in picked)
    if not on_runner:
        print(f"reconstruct ran on {picked}, expected {args.expect_reconstruct_runner}", flush=True)
    failed = [name for name, e in report["runs"].items() if name.startswith("reconstruct") and "error" in e]
    if failed:
        print(f"reconstruct runs failed: {failed}", flush=True)
    if len(report["runs"]) < args.expect:
        print(f"only {len(report['runs'])} of {args.expect} runs arrived: {sorted(report['runs'])}", flush=True)
    ok = (bool(verdicts) and all(v["passed"] for v in verdicts) and hits and on_runner and not failed
          and len(report["runs"]) >= args.expect)
    print("RECONSTRUCT PASSES WITH PREFIX CACHING" if ok else "RECONSTRUCT FAILS", flush=True)
    return 0 if ok else 1


SERVE_METRICS = ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_accepted_tokens", "vllm:treewy_tree_fallbacks",
                 "vllm:prefix_cache_hits", "vllm:prefix_cache_queries")
PER_POSITION_METRIC = "vllm:spec_decode_num_accepted_tokens_per_pos"


def metric_total(metrics_text: str, name: str) -> float | None:
    """The sum of a Prometheus metric's samples over its labels (a counter's samples are `<name>_total`); None when
    /metrics has none."""
    values = [float(line.rsplit(" ", 1)[1]) for line in metrics_text.splitlines()
              if line.strip() and not line.startswith("#")
              and line.split("{", 1)[0].split(" ", 1)[0] in (name, f"{name}_total")]
    return sum(values) if values else None


def per_position(metrics_text: str, name: str) -> dict[int, float]:
    """A per-position counter's samples summed by their `position` label (position i: draft depth i + 1)."""
    counts: dict[int, float] = {}
    for line in metrics_text.splitlines():
        if line.startswith((f"{name}_total{{", f"{name}{{")) and 'position="' in line:
            labels, value = line.rsplit(" ", 1)
            position = int(labels.split('position="', 1)[1].split('"', 1)[0])
            counts[position] = counts.get(position, 0.0) + float(value)
    return dict(sorted(counts.items()))


def serve_metrics(metrics_text: str) -> dict:
    """What the serve check records from /metrics: SERVE_METRICS' totals and the per-position accepted drafts."""
    return {**{name: metric_total(metrics_text, name) for name in SERVE_METRICS},
            PER_POSITION_METRIC: per_position(metrics_text, PER_POSITION_METRIC)}


def serve_command(args, model: str, on_gpu: bool) -> list[str]:
    """`vllm serve MODEL --speculative-config '<README's spec>'` (the tree's with `--tree`) and, on the GPU, the
    gpu-vllm site's backends and a fixed KV budget (the GPU is shared); prefix caching left to vLLM."""
    spec = {**README_SPECS["tree" if args.tree else "chain"], **(gpu_site.SPECULATIVE if on_gpu else {})}
    backend = ["--attention-backend", gpu_site.ATTENTION_BACKEND] if gpu_site.ATTENTION_BACKEND else []
    site = [*backend, "--gdn-prefill-backend", gpu_site.ENGINE["gdn_prefill_backend"], "--kv-cache-memory-bytes",
            str(args.kv_cache_memory_bytes or 4 << 30)] if on_gpu else []
    return [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", model, "--speculative-config",
            json.dumps(spec), *site, "--gpu-memory-utilization", str(args.gpu_memory_utilization), "--port",
            str(args.port), "--max-num-seqs", "8", "--dtype", args.dtype]


def _post(port: int, path: str, body: dict) -> dict:
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    return json.loads(urllib.request.urlopen(request, timeout=60).read())


def run_serve_check(args) -> int:
    """The README's `vllm serve` command (`--tree`: the second, a [2,2,1] tree), prefix caching left to vLLM (on):
    starts, answers one greedy completion and one chat completion at temperature 0.8, reports /metrics, stops."""
    model, _ = prompts_and_model(args.fixture_architecture)
    scratch = Path(args.out).parent / ("serve-tree-plugin-metadata" if args.tree else "serve-plugin-metadata")
    metadata = gpu_site.plugin_metadata_dir(scratch)
    env = dict(os.environ)
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, str(metadata or ""), env.get("PYTHONPATH", "")) if p)
    import torch

    command = serve_command(args, model, torch.cuda.is_available())  # else a dry run on vLLM's CPU backend
    log_path = Path(args.out).with_suffix(".log")
    result = {"command": command, "tree": args.tree, "started": False}
    start = time.monotonic()
    with open(log_path, "w") as log:
        server = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            while time.monotonic() - start < args.timeout_s and server.poll() is None:
                try:
                    urllib.request.urlopen(f"http://127.0.0.1:{args.port}/v1/models", timeout=2).read()
                    result.update(started=True, start_s=time.monotonic() - start)
                    break
                except OSError:
                    time.sleep(2)
            if result["started"]:
                result["completion"] = _post(args.port, "/v1/completions", {
                    "model": model, "prompt": "Beautiful is better than", "max_tokens": 16, "temperature": 0})
                result["chat"] = _post(args.port, "/v1/chat/completions", {
                    "model": model, "messages": [{"role": "user", "content": "Simple is better than complex."}],
                    "max_tokens": 32, "temperature": 0.8, "seed": 11})
                time.sleep(2)  # the engine core's last counters reach the front end's /metrics with its next stats
                metrics = urllib.request.urlopen(f"http://127.0.0.1:{args.port}/metrics", timeout=30).read().decode()
                result["metrics"] = serve_metrics(metrics)
        except Exception:
            result["error"] = traceback.format_exc()[-2000:]
        finally:
            result["exit_code_before_stop"] = server.poll()
            if server.poll() is None:
                os.killpg(server.pid, signal.SIGTERM)  # the server's own process group (start_new_session)
                try:
                    server.wait(30)
                except subprocess.TimeoutExpired:
                    os.killpg(server.pid, signal.SIGKILL)
                    server.wait()
    log_text = log_path.read_text()
    result["log_lines"] = [line[:300] for line in log_text.splitlines() if any(
        s in line for s in ("Mamba cache mode", "model runner", "Model Runner", "Maximum concurrency", "Error",
                            "mamba_state_commit", "draft_tree"))][-20:]
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    ok = result["started"] and "completion" in result and "chat" in result and "metrics" in result
    what = "SERVE TREE" if args.tree else "SERVE"
    print(f"{what} STARTS AND ANSWERS" if ok else f"{what} FAILS", "metrics", json.dumps(result.get("metrics")),
          json.dumps(result.get("log_lines")), flush=True)
    return 0 if ok else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command_name", required=True)
    spec = sub.add_parser("spec")
    add_common_args(spec)
    spec.add_argument("--strategy", required=True, choices=["reconstruct", "store_all", "none"])
    spec.add_argument("--dense", action="store_true", help="keep every boundary state; the two-turn chats")
    spec.add_argument("--runner", default="default", choices=["default", "v1"],
                      help="default: the runner vLLM picks (V2 on CUDA); v1: VLLM_USE_V2_MODEL_RUNNER=0")
    spec.add_argument("--tree-widths", type=int, nargs="+", default=None,
                      help="reconstruct only: the MTP draft tree of these widths (draft_tree_widths) instead of the "
                           f"chain of {K}")
    spec.add_argument("--blurred-mtp", action="store_true",
                      help="the fixture's blurred-MTP variant (same target weights; its head right about half the "
                           "time, so trees branch)")
    reference = sub.add_parser("reference")
    add_common_args(reference)
    reference.add_argument("--out", required=True)
    reference.add_argument("--expect", type=int, required=True, help="runs to wait for")
    reference.add_argument("--command", default=None)
    reference.add_argument("--expect-reconstruct-runner", default="V2", choices=["V1", "V2", "any"],
                           help="the runner every reconstruct run on vLLM's pick must report (not the -v1 runs)")
    serve = sub.add_parser("serve-check")
    add_common_args(serve, runs=False)
    serve.add_argument("--out", required=True)
    serve.add_argument("--port", type=int, default=8321)
    serve.add_argument("--timeout-s", type=float, default=420)
    serve.add_argument("--tree", action="store_true", help="the README's second command: the [2,2,1] draft tree")
    for p in (spec, reference, serve):  # every process of the shell script gets the same arguments
        p.add_argument("--prefix-tokens", type=int, default=PREFIX_TOKENS)
        p.add_argument("--batches", default=" ".join(f"{b}:{n}" for b, n in BATCHES.items()),
                       help="B:REQUESTS, space-separated (REQUESTS submitted B at a time)")
        p.add_argument("--turn-block", type=int, default=None,
                       help="the dense run's first turns end this many tokens in (default: the engine's block size)")
        p.add_argument("--runs-wait-s", type=float, default=RUNS_WAIT_S, help="the reference's wait for the runs")
        p.add_argument("--dry-run", action="store_true", help="check and print the arguments; start nothing")
    args = parser.parse_args()
    if args.command_name != "serve-check" and args.max_tokens == 128:  # add_common_args' default
        args.max_tokens = MAX_TOKENS
    args.batches = dict(tuple(map(int, pair.split(":"))) for pair in args.batches.split())
    args.batch_sizes = sorted(args.batches)
    if args.command_name == "spec" and args.tree_widths and args.strategy != "reconstruct":
        parser.error(f"--tree-widths with --strategy {args.strategy}: draft trees here are reconstruct's (the plugin "
                     "refuses store_all trees on GPU; 'none' drafts nothing)")
    if args.command_name == "spec" and args.tree_widths and any(w < 1 for w in args.tree_widths):
        parser.error(f"--tree-widths {args.tree_widths}: widths are positive")
    if args.dry_run:
        print(args.command_name, "arguments", json.dumps({k: v for k, v in vars(args).items()}, default=str),
              flush=True)
        if args.command_name == "spec":
            print(args.command_name, "run", run_name(args), "speculative_config", json.dumps(speculative_config(args)),
                  "tokens/request", tokens_per_request(args), flush=True)
        if args.command_name == "serve-check":
            print(args.command_name, "command", json.dumps(serve_command(args, "MODEL", on_gpu=True)), flush=True)
        return 0
    if getattr(args, "runner", "default") == "v1":
        os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "0"  # read when the engine's config is built
    return {"spec": run_spec, "reference": run_reference, "serve-check": run_serve_check}[args.command_name](args)


if __name__ == "__main__":
    sys.exit(main())
