"""bench/e2e/run_gpu_prefix_caching.sh and bench/e2e/gpu_prefix_caching.py without an engine: a dry run (DRY_RUN=1) of the
default call checks and prints every process's arguments (the tree runs' speculative configs and CUDA-graph tokens
per request, both serve checks' commands); a store_all tree is refused with exit 2 before anything starts; the
serve check's specs are the README's commands verbatim; its /metrics parsing; the reference takes runs as they
arrive."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench.e2e import gpu_prefix_caching

ROOT = Path(__file__).resolve().parents[2]


def _script(tmp_path, **env_vars) -> subprocess.CompletedProcess:
    env = dict(os.environ, DRY_RUN="1", WORK=str(tmp_path / "work"),
               PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
               PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}", **env_vars)
    return subprocess.run(["bash", "bench/e2e/run_gpu_prefix_caching.sh", str(tmp_path / "out"), "--dtype", "float16"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def test_dry_run_of_the_default_call_prints_every_process(tmp_path):
    done = _script(tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    logs = {path.stem: path.read_text() for path in (tmp_path / "work" / "logs").glob("*.log")}
    assert set(logs) == {"reconstruct", "store_all", "none", "reconstruct-dense", "reconstruct-tree221",
                         "reconstruct-tree221-dense", "reference", "serve", "serve_tree"}, sorted(logs)
    runs = {}
    for text in logs.values():
        for line in text.splitlines():
            if line.startswith("spec run "):
                runs[line.split()[2]] = line
    assert set(runs) == {"reconstruct-k3", "store_all-k3", "none", "reconstruct-k3-dense", "reconstruct-tree221",
                         "reconstruct-tree221-dense"}
    for tree in ("reconstruct-tree221", "reconstruct-tree221-dense"):
        assert '"draft_tree_widths": [2, 2, 1]' in runs[tree] and '"num_speculative_tokens": 3' in runs[tree]
        assert runs[tree].endswith("tokens/request 11"), runs[tree]
    assert runs["reconstruct-k3"].endswith("tokens/request 4") and "draft_tree" not in runs["reconstruct-k3"]
    assert runs["none"].endswith("speculative_config null tokens/request 1")
    tree_args = json.loads(logs["reconstruct-tree221-dense"].split("spec arguments ", 1)[1].splitlines()[0])
    assert tree_args["blurred_mtp"] and tree_args["dense"] and tree_args["tree_widths"] == [2, 2, 1]
    assert tree_args["dtype"] == "float16" and tree_args["kv_cache_memory_bytes"] == 8 << 30
    chain_args = json.loads(logs["reconstruct"].split("spec arguments ", 1)[1].splitlines()[0])
    assert not chain_args["blurred_mtp"] and chain_args["tree_widths"] is None
    reference = json.loads(logs["reference"].split("reference arguments ", 1)[1].splitlines()[0])
    assert reference["expect"] == 6 and reference["expect_reconstruct_runner"] == "V2"
    commands = {}
    for name in ("serve", "serve_tree"):
        args = json.loads(logs[name].split("serve-check arguments ", 1)[1].splitlines()[0])
        commands[name] = (args, json.loads(logs[name].split("serve-check command ", 1)[1].splitlines()[0]))
    (chain, chain_command), (tree, tree_command) = commands["serve"], commands["serve_tree"]
    assert not chain["tree"] and tree["tree"] and chain["port"] != tree["port"]
    assert chain["out"].endswith("serve.json") and tree["out"].endswith("serve_tree.json")
    tree_spec = json.loads(tree_command[tree_command.index("--speculative-config") + 1])
    assert tree_spec["draft_tree_widths"] == [2, 2, 1] and tree_spec["mamba_state_commit"] == "reconstruct"
    assert "draft_tree_widths" not in chain_command[chain_command.index("--speculative-config") + 1]
    assert "--no-enable-prefix-caching" not in tree_command  # vLLM's default: on


@pytest.mark.parametrize("runs", ["store_all::221", "store_all:221", "none:221", "reconstruct:dnese",
                                  "reconstruct:221:321", "reconstruct:201"])
def test_a_bad_entry_exits_2_before_anything_starts(tmp_path, runs):
    done = _script(tmp_path, RUNS=f"reconstruct {runs}")
    assert done.returncode == 2, done.stdout + done.stderr
    assert f"RUNS entry {runs}" in done.stderr
    assert not (tmp_path / "work").exists() and not (tmp_path / "out").exists()
    if runs.startswith("store_all"):
        assert "reconstruct only" in done.stderr


def test_the_spec_parser_refuses_a_store_all_tree():
    done = subprocess.run([sys.executable, "bench/e2e/gpu_prefix_caching.py", "spec", "--strategy", "store_all",
                           "--tree-widths", "2", "2", "1", "--runs", "R", "--dry-run"], cwd=ROOT,
                          env=dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "--tree-widths with --strategy store_all" in done.stderr, done.stderr


def test_the_serve_specs_are_the_readmes_commands():
    readme = (ROOT / "README.md").read_text()
    for spec in gpu_prefix_caching.README_SPECS.values():
        assert f"'{json.dumps(spec, separators=(',', ':'))}'" in readme, spec


def test_serve_metrics_parse_counters_and_positions():
    text = "\n".join([
        "# HELP vllm:spec_decode_num_drafts_total drafts", "# TYPE vllm:spec_decode_num_drafts_total counter",
        'vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 12.0',
        'vllm:spec_decode_num_drafts_created{engine="0",model_name="m"} 1.7e9',
        'vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 20.0',
        'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="1"} 5.0',
        'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="0"} 9.0',
        'vllm:prefix_cache_hits_total{engine="0",model_name="m"} 0.0',
        'vllm:prefix_cache_queries_total{engine="0",model_name="m"} 40.0',
    ])
    metrics = gpu_prefix_caching.serve_metrics(text)
    assert metrics["vllm:spec_decode_num_drafts"] == 12.0 and metrics["vllm:spec_decode_num_accepted_tokens"] == 20.0
    assert metrics["vllm:spec_decode_num_accepted_tokens_per_pos"] == {0: 9.0, 1: 5.0}
    assert metrics["vllm:prefix_cache_hits"] == 0.0 and metrics["vllm:prefix_cache_queries"] == 40.0
    assert metrics["vllm:treewy_tree_fallbacks"] is None  # absent, not zero


def test_the_reference_takes_runs_as_they_arrive(tmp_path):
    (tmp_path / "a.json").write_text("{}")
    (tmp_path / "b.json.partial").write_text("{")  # still being written: not a run yet
    arriving = gpu_prefix_caching._arriving_runs(tmp_path, expect=2, deadline=time.monotonic() + 30)
    assert next(arriving) == tmp_path / "a.json"  # before the second has arrived
    (tmp_path / "b.json.partial").rename(tmp_path / "b.json")
    assert list(arriving) == [tmp_path / "b.json"]
    assert list(gpu_prefix_caching._arriving_runs(tmp_path, expect=3, deadline=time.monotonic())) == [
        tmp_path / "a.json", tmp_path / "b.json"]  # past the deadline: what has arrived
