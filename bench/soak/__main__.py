"""Soak `vllm serve` (the README's reconstruct chain and [2,2,1] tree commands, prefix caching on) with a seeded mix of
accepted, refused, dropped and aborted requests, then check that nothing leaked or broke (`bench.soak.checks`).

    python3 -m bench.soak --out OUT [--strategies chain tree] [--requests 400] [--duration-s 300]
        [--concurrency 16] [--max-tokens 8] [--parallel] [--deadline-s S] [-- EXTRA vllm serve ARGS]

Writes OUT/summary.json (every strategy's counts by kind, result and action, 4xx by reason, preemptions, metrics and
checks) and OUT/<strategy>/server.log; exits 1 if a check fails. `--parallel` starts every strategy's server at once
(one device call on the GPU); `--deadline-s` bounds the whole run: a soak stops starting requests early enough to
leave its checks `CHECK_RESERVE_S`. `--gpu` adds the gpu-vllm site's arguments (bench/e2e/gpu_site.py) and a fixed KV
budget (`--kv-cache-memory-bytes`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

from bench.soak import checks
from bench.soak.driver import drive, greedy_tokens
from bench.soak.mix import WEIGHTS, MixContext, plan
from bench.soak.server import ENGINE_DEAD_MARKERS, free_port, running_server, serve_command, server_env

CHECK_RESERVE_S = 60
IDLE_TIMEOUT_S = 60
REPLAY_PROMPTS = 3
REPLAY_TOKENS = 8
DEPTH = 3  # the README's chain (k = 3) and tree ([2,2,1]) both draft 3 deep


def refusal_reasons(outcomes) -> dict:
    """4xx answers grouped by kind, status and message (what docs/requests.md tabulates)."""
    groups = Counter((o.kind, o.status, o.reason[:1500]) for o in outcomes if o.result == "refused")
    return [{"kind": k, "status": s, "message": m, "count": c} for (k, s, m), c in sorted(groups.items())]


def soak_strategy(strategy: str, args, extra_args: tuple[str, ...], deadline: float) -> dict:
    from transformers import AutoTokenizer

    from vllm_treewy.fixture import fixture_prompts

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    prompts = fixture_prompts(tokenizer, 64)
    out_dir = Path(args.out) / strategy
    port = free_port()
    command = serve_command(args.model, strategy, port, args.max_model_len,
                            speculative_extra=args.speculative_extra, extra_args=extra_args)
    summary: dict = {"strategy": strategy, "command": command}
    result_checks: dict = {}
    env = server_env(args.extra_env)
    with running_server(command, port, out_dir / "server.log", env) as server:
        server.wait_healthy(args.start_timeout_s)
        summary["start_s"] = round(server.started_s, 1)
        replay_prompts = prompts[:REPLAY_PROMPTS]
        before = asyncio.run(greedy_tokens(server.base_url, args.model, replay_prompts, REPLAY_TOKENS))
        ctx = MixContext(args.model, prompts, args.max_model_len, args.max_tokens, args.p_disconnect, args.p_abort,
                         tuple(args.skip_kinds))
        planned = plan(args.requests, args.seed, ctx)
        duration = min(args.duration_s, deadline - time.monotonic() - CHECK_RESERVE_S)
        soak_start = time.monotonic()
        outcomes = asyncio.run(drive(server.base_url, planned, args.concurrency, max(duration, 1)))
        summary["soak_s"] = round(time.monotonic() - soak_start, 1)
        idle, readings = checks.wait_idle(server, IDLE_TIMEOUT_S)
        result_checks["kv_usage_zero"] = {"passed": idle, "detail": readings}
        after = asyncio.run(greedy_tokens(server.base_url, args.model, replay_prompts, REPLAY_TOKENS))
        result_checks["greedy_replay_identical"] = {
            "passed": before == after, "detail": {"before": before, "after": after} if before != after else {}}
        time.sleep(2)  # the engine core's last counters reach /metrics with its next stats
        samples = server.metrics()
        ok, detail = checks.spec_metrics(samples, DEPTH, tree=strategy == "tree")
        result_checks["spec_metrics_consistent"] = {"passed": ok, "detail": detail}
        summary["preemptions"] = checks.metric_sum(samples, checks.PREEMPTIONS)
        summary["finished_by_reason"] = {s.labels.get("finished_reason"): s.value for s in samples
                                         if s.name == "vllm:request_success_total"}
        result_checks["server_alive"] = {"passed": server.alive() and server.healthy(), "detail": {}}
        log = server.log_text()
        summary["engine_lines"] = [line[:300] for line in log.splitlines() if any(
            m in line for m in ("Maximum concurrency", "KV cache size", "num_gpu_blocks", "draft tree of depth"))]
        dead = [line[:300] for line in log.splitlines() if any(m in line for m in ENGINE_DEAD_MARKERS)]
        result_checks["no_engine_errors"] = {"passed": not dead, "detail": {"lines": dead[:20]}}
    failed = [o for o in outcomes if o.result == "failed"]
    result_checks["no_failed_requests"] = {"passed": not failed, "detail": [vars(o) for o in failed[:20]]}
    unexplained = [o for o in outcomes if o.result == "refused" and not o.names_param]
    result_checks["refusals_say_why"] = {"passed": not unexplained, "detail": [vars(o) for o in unexplained[:20]]}
    summary.update(
        requests=len(outcomes),
        by_kind=dict(Counter(o.kind for o in outcomes)),
        by_result=dict(Counter(o.result for o in outcomes)),
        by_action=dict(Counter(o.action for o in outcomes)),
        aborts=sum(o.result == "aborted" for o in outcomes),
        disconnects=sum(o.result == "disconnected" for o in outcomes),
        refusals=refusal_reasons(outcomes),
        checks=result_checks,
        passed=all(c["passed"] is not False for c in result_checks.values()),
    )
    return summary


def gpu_args(kv_cache_memory_bytes: int, out: Path) -> tuple[tuple[str, ...], dict]:
    """The gpu-vllm site's engine arguments and the drafter's attention backend (bench/e2e/gpu_site.py); puts the
    plugin's entry point where the servers find it (the site imports the project from the source tree)."""
    from bench.e2e import gpu_site

    gpu_site.seed_model_info_cache()
    metadata = gpu_site.plugin_metadata_dir(out / "plugin-metadata")
    if metadata is not None:
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(metadata), os.environ.get("PYTHONPATH")) if p)
    site = {**gpu_site.ENGINE, **gpu_site.attention_site()}  # the attention backend: vLLM's pick unless named
    args = tuple(a for name, value in site.items() for a in (f"--{name.replace('_', '-')}", str(value)))
    args += ("--kv-cache-memory-bytes", str(kv_cache_memory_bytes))
    return args, dict(gpu_site.SPECULATIVE)


def parse(argv):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--model", default=None, help="default: the project's fixture, built under OUT")
    parser.add_argument("--strategies", nargs="+", default=["chain", "tree"], choices=["chain", "tree"])
    parser.add_argument("--requests", type=int, default=400, help="at most this many requests per strategy")
    parser.add_argument("--duration-s", type=float, default=300, help="stop starting requests after this long")
    parser.add_argument("--deadline-s", type=float, default=None, help="the whole run's time bound")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--p-disconnect", type=float, default=0.12)
    parser.add_argument("--p-abort", type=float, default=0.12)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip-kinds", nargs="*", default=[], choices=sorted(WEIGHTS),
                        help="request kinds left out of the mix")
    parser.add_argument("--start-timeout-s", type=float, default=420)
    parser.add_argument("--parallel", action="store_true", help="every strategy's server at once")
    parser.add_argument("--gpu", action="store_true", help="the gpu-vllm site's backends, fixed KV budget")
    parser.add_argument("--kv-cache-memory-bytes", type=int, default=8 << 30)
    args, extra = parser.parse_known_args(argv)
    extra = [a for a in extra if a != "--"]
    args.speculative_extra, args.extra_env = {}, {}
    if args.gpu:
        site_args, args.speculative_extra = gpu_args(args.kv_cache_memory_bytes, Path(args.out))
        extra = [*site_args, *extra]
    return args, tuple(extra)


def main(argv=None) -> int:
    args, extra_args = parse(sys.argv[1:] if argv is None else argv)
    start = time.monotonic()
    deadline = start + (args.deadline_s or 10**9)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    if args.model is None:
        from vllm_treewy.fixture import build_fixture

        args.model = str(build_fixture(Path(tempfile.mkdtemp(prefix="soak-fixture-"))))
    results: dict[str, dict] = {}

    def run(strategy: str) -> None:
        try:
            results[strategy] = soak_strategy(strategy, args, extra_args, deadline)
        except Exception as e:  # a server that did not start or died: the summary says so
            results[strategy] = {"strategy": strategy, "passed": False, "error": f"{type(e).__name__}: {e}"[-4000:]}

    if args.parallel:
        threads = [threading.Thread(target=run, args=(s,)) for s in args.strategies]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    else:
        for s in args.strategies:
            run(s)
    summary = {"args": {k: v for k, v in vars(args).items()}, "extra_args": list(extra_args),
               "wall_s": round(time.monotonic() - start, 1), "strategies": [results[s] for s in args.strategies],
               "passed": all(results[s]["passed"] for s in args.strategies)}
    (Path(args.out) / "summary.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
    for r in summary["strategies"]:
        print(r["strategy"], "PASSED" if r["passed"] else "FAILED", json.dumps(
            {k: r.get(k) for k in ("requests", "by_result", "aborts", "disconnects", "preemptions", "start_s",
                                   "soak_s", "error")}), flush=True)
        for name, check in r.get("checks", {}).items():
            print(f"  {name}: {check['passed']}", flush=True)
    return 0 if summary["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
