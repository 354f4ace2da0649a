"""bench/e2e/run_gpu_v2_trees.sh's engine catalog and the drivers' per-run settings, without an engine: each catalog
entry parses with the real driver's parser into the speculative config it names; a threshold run captures graphs of
both verified shapes; `--staggered` lengths shrink a batch while it runs."""

import os
import subprocess
import sys
from argparse import Namespace
from pathlib import Path

from bench.e2e import gpu_v2_chains
from bench.e2e.gpu_vllm_e2e import request_lengths

ROOT = Path(__file__).resolve().parents[2]


def test_catalog_entries_parse_into_their_configs(tmp_path):
    engines = ("tree221t8-fp16 tree221t8-bf16 tree221-bf16 k3-bf16 tree3221-bf16-t1 k4-bf16 tree4-fp16 k1-bf16 "
               "tree221-bf16-triton k3-fp16-store_all")
    env = dict(os.environ, DRY_RUN="1", ENGINES=engines,
               PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
               PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}", WORK=str(tmp_path / "work"))
    done = subprocess.run(["bash", "bench/e2e/run_gpu_v2_trees.sh", str(tmp_path / "out"), "--staggered"], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = {line.split(" -> ")[0]: line for line in done.stdout.splitlines() if " -> " in line}
    assert "reconstruct-tree221-t8-fp16" in lines["tree221t8-fp16"]
    assert "'draft_tree_max_batch_size': 8" in lines["tree221t8-bf16"] and "tokens/request (11, 4)" in lines["tree221t8-bf16"]
    assert "draft_tree_max_batch_size" not in lines["tree221-bf16"] and "tokens/request 11" in lines["tree221-bf16"]
    assert "tokens/request 4" in lines["k3-bf16"] and lines["reference"]
    # depth 4 beside its chain, sampled; depth 1 (the first pass's top 4) beside k = 1
    depth4 = lines["tree3221-bf16-t1"]
    assert "reconstruct-tree3221-bf16-t1" in depth4 and "tokens/request 34" in depth4
    assert "'num_speculative_tokens': 4" in lines["k4-bf16"] and "tokens/request 5" in lines["k4-bf16"]
    assert "'draft_tree_widths': [4]" in lines["tree4-fp16"] and "'num_speculative_tokens': 1" in lines["tree4-fp16"]
    assert "tokens/request 2" in lines["k1-bf16"]
    # vLLM picks the attention backend (FLASH_ATTN on the H200) unless an engine names TRITON_ATTN, apart by name
    assert "attention_backend" not in lines["tree221-bf16"]
    assert "reconstruct-tree221-bf16-triton_attn" in lines["tree221-bf16-triton"]
    assert "'attention_backend': 'TRITON_ATTN'" in lines["tree221-bf16-triton"]
    # a chain's store_all beside reconstruct on the same head: the engine's --strategy wins over the script's
    assert "store_all-k3-fp16" in lines["k3-fp16-store_all"]
    assert "'mamba_state_commit': 'store_all'" in lines["k3-fp16-store_all"]


def test_the_gpu_site_names_an_attention_backend_only_when_the_call_does():
    script = "from bench.e2e import gpu_site; print(gpu_site.ENGINE, gpu_site.SPECULATIVE)"
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    env.pop("ATTENTION_BACKEND", None)
    picked = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True)
    named = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=dict(env, ATTENTION_BACKEND="TRITON_ATTN"),
                           capture_output=True, text=True)
    assert picked.stdout.strip() == "{'gdn_prefill_backend': 'triton'} {}", picked.stderr
    assert named.stdout.strip() == "{'gdn_prefill_backend': 'triton'} {'attention_backend': 'TRITON_ATTN'}"


def test_a_threshold_run_is_named_apart_from_the_plain_tree():
    parse = gpu_v2_chains.build_parser().parse_args
    common = ["spec", "--strategy", "reconstruct", "--runs", "R", "--turn", "0", "--turns-dir", "T", "--engines", "2",
              "--tree-widths", "2", "2", "1", "--name-suffix", "bf16"]
    plain, threshold = parse(common), parse([*common, "--tree-max-batch-size", "0"])
    assert gpu_v2_chains.run_name(plain) == "reconstruct-tree221-bf16"  # what bench/e2e/tree_threshold pairs with chains
    assert gpu_v2_chains.run_name(threshold) == "reconstruct-tree221-t0-bf16"
    assert gpu_v2_chains.speculative_config(threshold)["draft_tree_max_batch_size"] == 0


def test_staggered_lengths_shrink_the_batch():
    assert request_lengths(Namespace(max_tokens=128, staggered=False), 4) == [128] * 4
    lengths = request_lengths(Namespace(max_tokens=128, staggered=True), 64)
    assert lengths[0] == 128 and min(lengths) >= 64 and len(set(lengths)) == 64  # every request ends at its own step
    assert lengths == sorted(lengths, reverse=True)


def test_sampled_entries_sample_with_one_seed_per_request_and_are_never_judged(tmp_path):
    """The catalog's -t1 engines time sampled passes (temperature 1.0, request i seeded i, the same in every pass
    and engine); the reference judges greedy runs of its dtype only."""
    env = dict(os.environ, DRY_RUN="1", ENGINES="tree221-bf16-t1 k3-bf16-t1",
               PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
               PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}", WORK=str(tmp_path / "work"))
    done = subprocess.run(["bash", "bench/e2e/run_gpu_v2_trees.sh", str(tmp_path / "out")], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "reconstruct-tree221-bf16-t1 " in done.stdout and "reconstruct-k3-bf16-t1 " in done.stdout

    from bench.e2e.gpu_vllm_e2e import generate

    class Recorder:
        def generate(self, prompts, params, use_tqdm):
            self.params = params
            return [Namespace(outputs=[Namespace(token_ids=[7] * p.max_tokens)]) for p in params]

    llm = Recorder()
    out = generate(llm, [[1, 2], [3]], [4, 2], Namespace(temperature=1.0, top_p=0.9))
    assert out == [[7] * 4, [7] * 2]
    assert [(p.temperature, p.top_p, p.seed, p.max_tokens, p.ignore_eos) for p in llm.params] == \
        [(1.0, 0.9, 0, 4, True), (1.0, 0.9, 1, 2, True)]

    args = Namespace(dtype="float16", batch_sizes=[1, 8])
    assert gpu_v2_chains.batches_to_judge({"dtype": "float16", "temperature": 0.0}, args) == [1, 8]
    assert gpu_v2_chains.batches_to_judge({"dtype": "float16", "temperature": 1.0}, args) == []
    assert gpu_v2_chains.batches_to_judge({"dtype": "bfloat16"}, args) == []
