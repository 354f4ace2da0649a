"""The sweep's own parts without a vLLM server: metric scraping and sampling, grids, workload files (read back by
vLLM's own dataset loaders), and the report's ratios."""

from __future__ import annotations

import http.server
import json
import math
import random
import threading

import pytest

from bench.sweep.grids import GRIDS, MiB
from bench.sweep.metrics import MetricsSampler, cache_config, metric_sum, parse_prometheus
from bench.sweep.point import split_args
from bench.sweep.report import geomean, pareto_front, ratio_rows
from bench.sweep.workloads import WORKLOADS, TextSource, write_workloads

EXPOSITION = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="1",model_name="m"} 2.0
vllm:num_preemptions_total{engine="0",model_name="m"} 7.0
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
vllm:cache_config_info{block_size="256",kv_cache_max_concurrency="3.2",num_gpu_blocks="32",engine="0"} 1.0
process_start_time_seconds 1.7e+09
"""


def test_parse_prometheus_sums_engines_and_reads_counters_and_labels():
    samples = parse_prometheus(EXPOSITION)
    assert metric_sum(samples, "vllm:num_requests_running") == 5.0
    assert metric_sum(samples, "vllm:num_preemptions") == 7.0  # exposed as a counter, `_total`
    assert metric_sum(samples, "vllm:num_requests_waiting") is None
    assert metric_sum(samples, "process_start_time_seconds") == 1.7e9
    config = cache_config(samples)
    assert config["kv_cache_max_concurrency"] == "3.2" and config["num_gpu_blocks"] == "32"


class _ChangingMetrics(http.server.BaseHTTPRequestHandler):
    """A /metrics endpoint whose running-request gauge climbs to 9 and falls back, with 4 preemptions."""

    scrapes = 0
    lock = threading.Lock()

    def do_GET(self):  # noqa: N802 (http.server's name)
        with self.lock:
            n = type(self).scrapes
            type(self).scrapes += 1
        running = [1, 4, 9, 6, 2][min(n, 4)]
        preemptions = 0 if n == 0 else 4
        body = (f'vllm:num_requests_running{{engine="0"}} {running}\n'
                f'vllm:num_requests_waiting{{engine="0"}} {max(running - 5, 0)}\n'
                f'vllm:kv_cache_usage_perc{{engine="0"}} {running / 10}\n'
                f'vllm:num_preemptions_total{{engine="0"}} {preemptions}\n'
                'vllm:cache_config_info{kv_cache_max_concurrency="6.5",num_gpu_blocks="40"} 1.0\n').encode()  # fmt: skip
        self.send_response(200)
        self.send_header("Content-Type", "text/plain")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def test_metrics_sampler_keeps_peaks_and_counter_deltas():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _ChangingMetrics)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        sampler = MetricsSampler(f"http://127.0.0.1:{server.server_address[1]}", interval_s=0.05)
        sampler.start()
        deadline = 200
        while _ChangingMetrics.scrapes < 5 and deadline:  # bounded: 200 x 20 ms
            threading.Event().wait(0.02)
            deadline -= 1
        sampler.stop()
    finally:
        server.shutdown()
    summary = sampler.summary()
    assert summary["server_peak_running_requests"] == 9
    assert summary["server_peak_waiting_requests"] == 4
    assert summary["server_peak_kv_cache_usage"] == pytest.approx(0.9)
    assert summary["server_preemptions"] == 4  # after minus before, not the server's lifetime total
    assert summary["server_kv_cache_max_concurrency"] == 6.5 and summary["server_kv_cache_blocks"] == 40
    assert summary["server_metrics_failed_scrapes"] == 0


def test_point_args_split_ours_from_vllm_bench_serve():
    ours, rest = split_args(["--worker-x", "--workload", "chat", "--metric-percentiles", "99", "--port", "1"])
    assert ours.workload == "chat"
    # A vLLM flag that shares a prefix with ours stays vLLM's.
    assert rest == ["--worker-x", "--metric-percentiles", "99", "--port", "1"]


def test_grids_start_each_strategy_at_each_budget():
    grid = GRIDS["cpu"]
    serve = grid.serve_params()
    assert [r["_benchmark_name"] for r in serve] == [
        f"{s}-{b.name}" for b in grid.budgets for s in ("no_spec", "store_all", "reconstruct")
    ]
    for record in serve:
        strategy = record["_benchmark_name"].split("-")[0]
        if strategy == "no_spec":
            assert "speculative_config" not in record
        else:
            assert record["speculative_config"] == {"method": "mtp", "num_speculative_tokens": 3,
                                                    "mamba_state_commit": strategy}  # fmt: skip
    assert {r["kv_cache_memory_bytes"] for r in serve} == {6 * MiB, 1 << 30}


def test_grid_points_sweep_concurrency_or_arrival_rate():
    grid = GRIDS["h200-27b"]
    fake = {w: type("D", (), {"axis": "request_rate" if w == "bursty" else "concurrency", "bench_params": {}})()
            for w in grid.workloads}  # fmt: skip
    points = grid.bench_params(fake)
    assert len(points) == 5 * 6 + 5 and grid.num_points == 2 * 3 * len(points)
    bursty = [p for p in points if p["workload"] == "bursty"]
    assert [p["request_rate"] for p in bursty] == [4.0, 8.0, 16.0, 32.0, 64.0]
    assert all(p["max_concurrency"] == 256 and p["burstiness"] == 0.5 for p in bursty)
    chat = [p for p in points if p["workload"] == "chat"]
    assert [p["max_concurrency"] for p in chat] == [1, 8, 32, 64, 128, 256]
    assert [p["num_prompts"] for p in chat] == [8, 16, 64, 128, 256, 512]  # 2 per slot within [8, 512]
    assert all(p["request_rate"] == "inf" for p in chat)


def test_h200_grid_is_qwen35_27b_with_synthetic_acceptance():
    from bench.sweep.models import QWEN35_27B as d

    gdn_layers = d["num_hidden_layers"] * 3 // 4
    state_bytes = gdn_layers * d["linear_num_value_heads"] * d["linear_key_head_dim"] * d["linear_value_head_dim"] * 4
    assert (d["hidden_size"], d["num_hidden_layers"], gdn_layers) == (5120, 64, 48)
    assert state_bytes == 144 * MiB  # fp32 GDN state per request; store_all at k = 3 holds four of these
    spec = GRIDS["h200-27b"].speculative_config("reconstruct")
    assert spec["rejection_sample_method"] == "synthetic" and spec["mamba_state_commit"] == "reconstruct"
    assert {b.serve_params["gpu_memory_utilization"] for b in GRIDS["h200-27b"].budgets} == {0.6, 0.9}


@pytest.fixture(scope="module")
def fixture_tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    from vllm_treewy.fixture import build_fixture

    return AutoTokenizer.from_pretrained(build_fixture(tmp_path_factory.mktemp("fixture")))


def test_workload_files_read_back_through_vllms_dataset_loaders(tmp_path, fixture_tokenizer):
    pytest.importorskip("pandas", reason="vLLM's custom / Spec-Bench / BurstGPT loaders need pandas (test extra)")
    from vllm.benchmarks.datasets import get_samples
    from vllm.utils.argparse_utils import FlexibleArgumentParser
    from vllm.benchmarks.serve import add_cli_args

    ids = fixture_tokenizer(" ".join(["Beautiful is better than ugly."] * 8))["input_ids"]
    source = TextSource(ids, fixture_tokenizer.decode)
    data = write_workloads(tmp_path, GRIDS["cpu"].lengths, source)
    assert set(data) == set(WORKLOADS)
    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    for name, workload in data.items():
        flags = []
        for key, value in workload.bench_params.items():
            flags += [f"--{key.replace('_', '-')}"] if value is True else [f"--{key.replace('_', '-')}", str(value)]
        args = parser.parse_args(["--model", "m", "--num-prompts", "16", *flags])
        samples = get_samples(args, fixture_tokenizer)
        assert len(samples) == 16, name
        lengths = GRIDS["cpu"].lengths
        for sample in samples:
            assert 1 <= sample.prompt_len and sample.expected_output_len >= 1, name
            assert sample.prompt_len + sample.expected_output_len <= lengths.max_total + 8, name  # re-tokenization
        if name == "summarize_heavy":
            assert min(s.prompt_len for s in samples) > 4 * max(s.expected_output_len for s in samples)
        if name == "generation_heavy":
            assert max(s.prompt_len for s in samples) < min(s.expected_output_len for s in samples)


def test_workload_files_are_deterministic(tmp_path):
    source = TextSource(list(range(50)), lambda ids: " ".join(map(str, ids)))
    write_workloads(tmp_path / "a", GRIDS["cpu"].lengths, source)
    write_workloads(tmp_path / "b", GRIDS["cpu"].lengths, source)
    for path in (tmp_path / "a").iterdir():
        assert path.read_bytes() == (tmp_path / "b" / path.name).read_bytes()


def _point(strategy, workload, c, tput, kv, ttft, tpot, running, accept, preempt=0):
    return {"strategy": strategy, "budget": "b", "workload": workload, "axis": "concurrency", "concurrency": c,
            "request_rate": "inf", "output_throughput": tput, "server_peak_kv_cache_usage": kv, "p99_ttft_ms": ttft,
            "mean_tpot_ms": tpot, "server_peak_running_requests": running, "server_preemptions": preempt,
            "spec_decode_acceptance_length": accept}  # fmt: skip


def test_ratio_rows_are_geomeans_oriented_so_above_one_favours_reconstruct():
    points = [
        _point("store_all", "chat", 8, 100.0, 0.8, 400.0, 20.0, 4, 2.5, preempt=3),
        _point("reconstruct", "chat", 8, 200.0, 0.2, 100.0, 10.0, 8, 2.4),
        _point("store_all", "balanced", 8, 100.0, 0.5, 100.0, 10.0, 8, 3.0),
        _point("reconstruct", "balanced", 8, 50.0, 0.5, 100.0, 10.0, 8, 3.0),
        _point("no_spec", "chat", 8, 50.0, 0.1, 50.0, 30.0, 8, None),
        _point("store_all", "chat", 32, 10.0, 0.9, 1.0, 1.0, 2, 2.0),  # no reconstruct partner: left out
    ]
    rows = ratio_rows(points)
    assert len(rows) == 1
    row = rows[0]
    assert row["x"] == 8 and row["workloads"] == 2
    assert row["tput"] == pytest.approx(math.sqrt(2.0 * 0.5))
    assert row["KV red."] == pytest.approx(math.sqrt(4.0 * 1.0))
    assert row["p99 TTFT"] == pytest.approx(math.sqrt(4.0))
    assert row["mean TPOT"] == pytest.approx(math.sqrt(2.0))
    assert row["b"] == pytest.approx(math.sqrt(2.0))
    assert (row["preemptions S"], row["preemptions R"]) == (3, 0)
    assert row["R tput / no-spec"] == pytest.approx(4.0) and row["S tput / no-spec"] == pytest.approx(2.0)
    assert row["max |accept len R - S|"] == pytest.approx(0.1)


def test_geomean_and_pareto_front():
    assert geomean([2.0, 8.0]) == pytest.approx(4.0)
    assert geomean([None, 0.0]) is None
    rng = random.Random(0)
    xy = [(rng.random(), rng.random()) for _ in range(200)]
    front = pareto_front(xy)
    for x, y in xy:
        assert any(fx >= x and fy >= y for fx, fy in front)
    for i, (x, y) in enumerate(front):
        assert not any(ox >= x and oy >= y and (ox, oy) != (x, y) for ox, oy in xy)
    assert [p[0] for p in front] == sorted(p[0] for p in front)
    assert json.dumps(front)  # plain floats: goes into the report as is


def test_core_h200_grid_is_a_slice_of_the_full_one():
    full, core = GRIDS["h200-27b"], GRIDS["h200-27b-core"]
    names = [r["_benchmark_name"] for r in core.serve_params()]
    assert names == [r["_benchmark_name"] for r in full.serve_params() if not r["_benchmark_name"].startswith("no_spec")]
    assert len(names) == 4 and core.num_points == 16
    fake = {"chat": type("D", (), {"axis": "concurrency", "bench_params": {}})()}
    assert [p["max_concurrency"] for p in core.bench_params(fake)] == [1, 8, 64, 256]
    assert core.speculative_config("reconstruct") == full.speculative_config("reconstruct")
    assert core.serve_flags == full.serve_flags and core.model == full.model
