"""The A3B grid before device time is spent: vLLM's KV-cache capacity computed on the CPU (`bench.sweep.capacity`)
reproduces what the H200 reported for the 27B shape, the grid's budgets bind where its README says, every server's
flags build vLLM's config with the plugin, `--only` / `--points` pick and order what a device call runs, and the
sweep keeps each server's start-up from its log."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.sweep.capacity import GiB, capacity
from bench.sweep.grids import GRIDS
from bench.sweep.models import SHAPES, write_shape_config
from bench.sweep.run import ServerStarts, plan_sweep


@pytest.mark.parametrize(("strategy", "kv_gib", "blocks", "concurrency"), [
    # bench/results/sweeps/h200-27b-core, gmu 0.6: vLLM's "Available KV cache memory" and its report
    ("store_all", 28.63, 551, 30.611),
    ("reconstruct", 29.53, 517, 64.625),
])  # fmt: skip
def test_capacity_reproduces_the_h200_reports_of_the_27b_shape(strategy, kv_gib, blocks, concurrency):
    got = capacity("qwen35-27b", strategy, int(kv_gib * GiB), max_model_len=4096)
    assert got.num_blocks == blocks
    assert got.max_concurrency == pytest.approx(concurrency, abs=1e-3)
    # the attention block sizes that H200 logged ("Setting attention block size to 800 / 880 tokens")
    assert got.attention_block_size == {"store_all": 800, "reconstruct": 880}[strategy]


STRATEGIES = ("no_spec", "store_all", "reconstruct")


def grid_capacities(grid) -> dict:
    """budget name -> strategy -> vLLM's capacity at the grid's budget, with the checks every MoE grid's budget
    passes: each request of the grid's lengths holds one attention block (vLLM's report is the workload's bound), and
    vLLM's FULL-graph check (max_num_seqs, 512, <= the Mamba blocks)."""
    by_budget = {}
    for budget in grid.budgets:
        kv = budget.serve_params["kv_cache_memory_bytes"]
        by_budget[budget.name] = {s: capacity(grid.model, s, kv, max_model_len=grid.max_model_len) for s in STRATEGIES}
        for cap in by_budget[budget.name].values():
            assert cap.attention_block_size >= grid.max_model_len
            assert cap.num_blocks >= 512, "vLLM's FULL-graph check: max_num_seqs (512) <= the Mamba blocks"
    return by_budget


def test_a3b_budgets_bind_store_all_where_the_grid_says():
    by_budget = grid_capacities(GRIDS["h200-a3b"])
    for caps in by_budget.values():
        assert caps["store_all"].gdn_blocks_per_request == 4 and caps["reconstruct"].gdn_blocks_per_request == 1
    binding, tight = by_budget["kv52GiB"], by_budget["kv16GiB"]
    assert binding["store_all"].max_concurrency < 256 <= 512 <= binding["reconstruct"].max_concurrency
    assert binding["no_spec"].max_concurrency >= 512
    assert tight["store_all"].max_concurrency < 64 and 128 < tight["reconstruct"].max_concurrency < 256
    # what grids.py and the README state
    assert round(binding["store_all"].max_concurrency, 1) == 177.8
    assert round(binding["reconstruct"].max_concurrency, 1) == 523.2


def test_qwen3_next_budgets_bind_store_all_as_the_a3b_grids_do():
    by_budget = grid_capacities(GRIDS["h200-next-a3b-20l"])
    binding, tight = by_budget["kv26GiB"], by_budget["kv8GiB"]
    assert binding["store_all"].max_concurrency < 256 and 256 < binding["reconstruct"].max_concurrency < 512
    assert tight["store_all"].max_concurrency < 64 and 128 < tight["reconstruct"].max_concurrency < 256
    # what grids.py states
    assert [round(binding[s].max_concurrency, 1) for s in STRATEGIES] == [645.2, 163.0, 479.5]
    assert [round(tight[s].max_concurrency, 1) for s in STRATEGIES] == [198.5, 50.2, 147.5]


def test_a10b_budgets_bind_store_all_where_the_grid_says():
    by_budget = grid_capacities(GRIDS["h200-a10b-16l"])
    binding, tight = by_budget["kv32GiB"], by_budget["kv16GiB"]
    assert binding["store_all"].max_concurrency < 128 and 256 < binding["reconstruct"].max_concurrency < 512
    assert tight["store_all"].max_concurrency < 64 and 128 < tight["reconstruct"].max_concurrency < 256
    # what grids.py states
    assert [round(binding[s].max_concurrency, 1) for s in STRATEGIES] == [500.2, 121.2, 364.0]
    assert [round(tight[s].max_concurrency, 1) for s in STRATEGIES] == [250.0, 60.6, 182.0]


@pytest.mark.parametrize(("grid_name", "architecture"), [
    ("h200-a3b", "Qwen3_5Moe"), ("h200-a10b-16l", "Qwen3_5Moe"), ("h200-next-a3b-20l", "Qwen3Next"),
    ("h200-a3b-16g", "Qwen3_5Moe"), ("h200-a3b-16g-triton", "Qwen3_5Moe")])
def test_every_moe_grid_server_builds_its_vllm_config(tmp_path, monkeypatch, grid_name, architecture):
    """Each server's `vllm serve` flags (the grid's, then its record's, as vLLM's sweep applies them) parse with
    vLLM's serve parser and build the engine config with the plugin: the budget, the speculative strategy, the cap.
    vLLM's CPU platform would replace the budget by VLLM_CPU_KVCACHE_SPACE, which the e2e harness sets when
    imported (by an earlier test of the same process): a server of the grid is started without it."""
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    import vllm_treewy.vllm_plugin as plugin
    from vllm.benchmarks.sweep.param_sweep import ParameterSweepItem
    from vllm.engine.arg_utils import EngineArgs
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    plugin.register()
    grid = GRIDS[grid_name]
    model = write_shape_config(tmp_path / "model", grid.model)
    seen = set()
    for record in grid.serve_params():
        cmd = ParameterSweepItem(record).apply_to_cmd(
            ["--model", str(model), *grid.serve_flags, "--load-format", "dummy", "--skip-tokenizer-init"])
        args = make_arg_parser(FlexibleArgumentParser()).parse_args(cmd)
        config = EngineArgs.from_cli_args(args).create_engine_config()
        assert config.model_config.architecture == f"{architecture}ForCausalLM"
        assert config.cache_config.kv_cache_memory_bytes == record["kv_cache_memory_bytes"]
        assert config.scheduler_config.max_num_seqs == 512 and config.model_config.max_model_len == 1024
        spec = config.speculative_config
        strategy = record["_benchmark_name"].split("-")[0]
        if strategy == "no_spec":
            assert spec is None
        else:
            assert spec.num_speculative_tokens == 3 and spec.draft_model_config.architecture == f"{architecture}MTP"
            assert spec.mamba_state_commit == strategy and spec.rejection_sample_method == "synthetic"
        assert max(args.compilation_config.cudagraph_capture_sizes) == 4 * 512
        # TRITON_ATTN where the grid names it (for both strategies and the drafter), else vLLM's pick
        backend = "TRITON_ATTN" if "--attention-backend" in grid.serve_flags else None
        assert getattr(config.attention_config.backend, "name", None) == backend
        if spec is not None:
            assert getattr(spec.attention_backend, "name", None) == backend
        seen.add(strategy)
    assert seen == set(grid.strategies)


def test_a3b_shapes_are_the_published_layers():
    a3b, a10b = SHAPES["qwen35-35b-a3b"], SHAPES["qwen35-122b-a10b-16l"]
    assert (a3b["num_hidden_layers"], a3b["hidden_size"], a3b["num_experts"], a3b["num_experts_per_tok"]) == \
        (40, 2048, 256, 8)
    assert (a3b["linear_num_key_heads"], a3b["linear_num_value_heads"], a3b["linear_key_head_dim"]) == (16, 32, 128)
    # the 122B shape keeps the 3 : 1 pattern (whole groups of four layers) and its own per-layer sizes
    assert a10b["num_hidden_layers"] % 4 == 0 and a10b["linear_num_value_heads"] == 64 and a10b["hidden_size"] == 3072


def test_the_qwen3_next_shape_is_its_published_layer_cut_to_20(tmp_path):
    """Qwen3-Next-80B-A3B's dims, cut to 20 layers: written as Qwen3NextForCausalLM with the 3 : 1 pattern, the fp32
    state left to the grid's flag (its checkpoints name none); its layers weigh what the A3B shape's do."""
    from transformers import AutoConfig

    full, cut = SHAPES["qwen3-next-80b-a3b"], SHAPES["qwen3-next-80b-a3b-20l"]
    assert (full["num_hidden_layers"], full["hidden_size"], full["num_experts"], full["num_experts_per_tok"]) == \
        (48, 2048, 512, 10)
    assert (full["linear_num_key_heads"], full["linear_num_value_heads"], full["linear_key_head_dim"]) == (16, 32, 128)
    assert {k: v for k, v in cut.items() if k != "num_hidden_layers"} == \
        {k: v for k, v in full.items() if k != "num_hidden_layers"} and cut["num_hidden_layers"] == 20
    config = AutoConfig.from_pretrained(write_shape_config(tmp_path, "qwen3-next-80b-a3b-20l"))
    assert config.architectures == ["Qwen3NextForCausalLM"] and not hasattr(config, "mamba_ssm_dtype")
    assert config.layer_types == (["linear_attention"] * 3 + ["full_attention"]) * 5
    assert config.rope_parameters["rope_theta"] == 5e6 and config.partial_rotary_factor == 0.25

    def expert_bytes(dims):  # bf16 routed experts, the bulk of an MoE layer
        return 2 * dims["num_experts"] * 3 * dims["hidden_size"] * dims["moe_intermediate_size"]

    a3b = SHAPES["qwen35-35b-a3b"]
    assert expert_bytes(cut) * 20 == expert_bytes(a3b) * a3b["num_hidden_layers"]


def test_only_orders_servers_and_points_filter(tmp_path):
    grid = GRIDS["h200-a3b-core"]
    plan = plan_sweep(grid, tmp_path / "out", only_servers=["reconstruct-kv52GiB", "store_all-kv52GiB"],
                      only_points=["generation_heavy-c512", "generation_heavy-c256"], dry_run=True)  # fmt: skip
    serve = json.loads((plan.out / "params" / "serve.json").read_text())
    bench = json.loads((plan.out / "params" / "bench.json").read_text())
    assert [r["_benchmark_name"] for r in serve] == ["reconstruct-kv52GiB", "store_all-kv52GiB"]
    assert [r["_benchmark_name"] for r in bench] == ["generation_heavy-c512", "generation_heavy-c256"]
    assert [r["num_prompts"] for r in bench] == [768, 384] and plan.num_points == 4
    with pytest.raises(SystemExit, match="no point named"):
        plan_sweep(grid, tmp_path / "out", only_points=["chat-c3"], dry_run=True)


def test_server_starts_keep_each_start_up_from_the_log(tmp_path):
    starts = ServerStarts(tmp_path / "server_starts.json", "call-1")
    lines = [
        (0.0, None, "store_all-kv52GiB"),
        (1.0, "(EngineCore pid=7) INFO [monitor.py:62] [backbone] torch.compile took 34.15 s in total", None),
        (2.0, "(EngineCore pid=7) INFO [monitor.py:62] [eagle_head] torch.compile took 8.15 s in total", None),
        (3.0, "(EngineCore pid=7) INFO [monitor.py:91] [backbone] Initial profiling/warmup run took 86.37 s", None),
        (3.1, "(EngineCore pid=7) Triton autotuning for function chunk_fwd_kernel_o,", None),
        (3.2, "(EngineCore pid=7) with key as (16, 32, 128, 128, 'torch.bfloat16'),", None),
        (3.3, "(EngineCore pid=7) finished after 2.50s,", None),
        (3.4, "(EngineCore pid=7) best config selected: BK: 64, BV: 64, num_warps: 4, num_stages: 2;", None),
        (3.5, "(EngineCore pid=7) Triton autotuning for function solve_tril,", None),
        (3.6, "(EngineCore pid=7) with key as (16, 'torch.float32'),", None),
        (3.7, "(EngineCore pid=7) finished after 1.25s,", None),
        (3.8, "(EngineCore pid=7) Triton autotuning for function chunk_fwd_kernel_o,", None),
        (3.9, "(EngineCore pid=7) finished after 0.75s,", None),
        (4.0, "(EngineCore pid=7) INFO [kernel_warmup.py:189] JIT kernel warmup finished in 38.00s.", None),
        (5.0, "(EngineCore pid=7) INFO [gpu_model_runner.py:6581] Graph capturing finished in 15 secs, took 0.7 GiB",
         None),
        (6.0, "(EngineCore pid=7) INFO [core.py:395] init engine (profile, create kv cache, warmup model) took "
              "202.00 s (compilation: 42.30 s)", None),
        (7.5, "INFO:     Application startup complete.", None),
        (8.0, None, "reconstruct-kv52GiB"),
        (9.0, "(EngineCore pid=9) INFO [core.py:395] init engine (profile, create kv cache, warmup model) took "
              "63.26 s (compilation: 4.79 s)", None),
    ]  # fmt: skip
    for now, text, server in lines:
        starts.server(server, now) if server else starts.line(text, now)
    records = json.loads(Path(tmp_path / "server_starts.json").read_text())
    assert records == [{"server": "store_all-kv52GiB", "call": "call-1", "start_in_call": 1, "torch_compile_s": 34.15,
                        "eagle_head_torch_compile_s": 8.15, "profile_run_s": 86.37, "jit_warmup_s": 38.0,
                        "graph_capture_s": 15.0, "init_engine_s": 202.0, "ready_s": 7.5, "autotune_s": 4.5,
                        "autotune_kernels": {"chunk_fwd_kernel_o": 2, "solve_tril": 1}}]  # fmt: skip
    # a server that never got ready is not recorded; the next call appends to the same file
    again = ServerStarts(tmp_path / "server_starts.json", "call-2")
    again.server("reconstruct-kv52GiB", 0.0)
    again.line("INFO:     Application startup complete.", 120.0)
    records = json.loads(Path(tmp_path / "server_starts.json").read_text())
    assert [(r["call"], r["server"], r["start_in_call"], r["ready_s"]) for r in records] == [
        ("call-1", "store_all-kv52GiB", 1, 7.5), ("call-2", "reconstruct-kv52GiB", 1, 120.0)]


def test_a_profiled_point_arms_vllms_profiler_on_every_server_and_stays_out_of_the_report(tmp_path, monkeypatch):
    """`--points NAME-profile`: NAME's workload once more, one request per slot, with the benchmark's `--profile`;
    every server then starts with vLLM's torch profiler configured (its own trace directory, the step window), which
    vLLM's serve parser accepts; the report reads the measured point and skips the profiled one."""
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    from vllm.benchmarks.sweep.param_sweep import ParameterSweepItem
    from vllm.engine.arg_utils import EngineArgs
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from bench.sweep.report import load_points
    from bench.sweep.run import PROFILE_DELAY_STEPS, PROFILE_STEPS, write_command_record

    grid = GRIDS["h200-a3b"]
    plan = plan_sweep(grid, tmp_path / "out", only_servers=["store_all-kv16GiB", "reconstruct-kv16GiB"],
                      only_points=["generation_heavy-c256", "generation_heavy-c256-profile"], dry_run=True)  # fmt: skip
    serve = json.loads((plan.out / "params" / "serve.json").read_text())
    bench = json.loads((plan.out / "params" / "bench.json").read_text())
    measured, profiled = bench
    assert profiled["_benchmark_name"] == "generation_heavy-c256-profile" and profiled["profile"] is True
    assert "profile" not in measured and measured["num_prompts"] == 384 and profiled["num_prompts"] == 256
    assert {k: v for k, v in profiled.items() if k not in ("_benchmark_name", "profile", "num_prompts")} == \
        {k: v for k, v in measured.items() if k not in ("_benchmark_name", "num_prompts")}
    assert ParameterSweepItem(profiled).apply_to_cmd(["--model", "m"])[-1] == "--profile"
    dirs = {r["profiler_config"]["torch_profiler_dir"] for r in serve}
    assert dirs == {str(plan.out / "profiles" / r["_benchmark_name"]) for r in serve} and len(dirs) == 2
    model = write_shape_config(tmp_path / "model", grid.model)
    cmd = ParameterSweepItem(serve[0]).apply_to_cmd(
        ["--model", str(model), *grid.serve_flags, "--load-format", "dummy", "--skip-tokenizer-init"])
    profiler = EngineArgs.from_cli_args(make_arg_parser(FlexibleArgumentParser()).parse_args(cmd)) \
        .create_engine_config().profiler_config
    assert (profiler.profiler, profiler.delay_iterations, profiler.max_iterations, profiler.ignore_frontend) == \
        ("torch", PROFILE_DELAY_STEPS, PROFILE_STEPS, True)
    # without a profiled point no server is configured for it
    plain = plan_sweep(grid, tmp_path / "plain", only_points=["generation_heavy-c256"], dry_run=True)
    assert not any("profiler_config" in r for r in json.loads((plain.out / "params" / "serve.json").read_text()))

    write_command_record(plan, ["run", "h200-a3b"])
    environment = json.loads((plan.out / "command.json").read_text())["environment"]
    assert environment["TRITON_PRINT_AUTOTUNING"] == "1" and "PYTHONPATH" not in environment
    for point in bench:
        run = {**serve[0], **point, "workload": "generation_heavy", "output_throughput": 1.0}
        result = plan.out / "raw" / grid.name / point["_benchmark_name"] / "summary.json"
        result.parent.mkdir(parents=True)
        result.write_text(json.dumps([run]))
    points, _ = load_points(plan.out)
    assert [p["result_dir"] for p in points] == [f"raw/{grid.name}/generation_heavy-c256"]


def test_stop_servers_ends_a_server_that_outlived_the_sweep_and_nothing_else(tmp_path):
    """A server cut in its start can outlive vLLM's sweep (H200, call 2 of bench/results/sweeps/h200-a3b-default):
    the driver ends every process running its own serve command (port included), with its process group."""
    import subprocess
    import sys
    import time

    from bench.sweep.run import server_pids, stop_servers

    serve_cmd = ["vllm", "serve", str(tmp_path / "model"), "--host", "127.0.0.1", "--port", "48999"]
    # a stand-in server: its arguments carry the serve command; its child stands for the engine core
    code = "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)']); " \
           "time.sleep(120)"
    server = subprocess.Popen([sys.executable, "-c", code, *serve_cmd[1:]], start_new_session=True)
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", "serve", "--port", "48998"],
                             start_new_session=True)
    try:
        time.sleep(1.0)
        assert server_pids(serve_cmd) == [server.pid]
        assert stop_servers(serve_cmd, grace_s=5.0) == [server.pid]
        assert server.wait(timeout=10) != 0 and server_pids(serve_cmd) == []
        group = [p for p in Path("/proc").iterdir() if p.name.isdigit() and _pgid(int(p.name)) == server.pid]
        assert group == [], "the engine core's stand-in survived"
        assert other.poll() is None, "another server's process was ended"
    finally:
        for proc in (server, other):
            proc.kill()
            proc.wait()


def _pgid(pid: int):
    """The process group of a live process (None for an ended one, a zombie included: its parent may be gone)."""
    import os

    try:
        if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
            return None
        return os.getpgid(pid)
    except (ProcessLookupError, FileNotFoundError):
        return None


def test_runs_with_their_own_out_share_one_model_dir(tmp_path):
    """`--model-dir`: two calls with their own `--out` serve the same model path (vLLM's compile cache key), so the
    second start is warm; without it each OUT holds its own model."""
    grid = GRIDS["h200-a3b"]
    shared = tmp_path / "model"
    first, second = (plan_sweep(grid, tmp_path / name, only_points=["generation_heavy-c256"], model_dir=shared,
                                dry_run=True) for name in ("c1", "c2"))  # fmt: skip
    assert first.serve_cmd == second.serve_cmd[:-1] + [first.serve_cmd[-1]]  # the same but for the port
    assert str(shared.resolve()) in first.serve_cmd and (shared / "config.json").exists()
    own = plan_sweep(grid, tmp_path / "c3", only_points=["generation_heavy-c256"], dry_run=True)
    assert str((tmp_path / "c3" / "model").resolve()) in own.serve_cmd
