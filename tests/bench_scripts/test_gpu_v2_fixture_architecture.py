"""The GPU V2 scripts on the Qwen3-Next fixture, without an engine: FIXTURE_ARCH reaches every engine's fixture folder
(one per architecture) and the GDN state's dtype (`--ssm-cache-dtype`) every engine's kwargs, in both scripts'
DRY_RUN, and SHAPE_CONTROL the reference's control in smaller batches; the fixture is built as the architecture it
is named for. Two dry runs, one Python each (every engine's arguments parsed in it)."""

import os
import subprocess
import sys
from argparse import Namespace
from pathlib import Path

import pytest

from bench.e2e import gpu_vllm_e2e

ROOT = Path(__file__).resolve().parents[2]


def _dry_run(tmp_path, script: list[str], **env) -> dict[str, str]:
    """Engine name -> the line its DRY_RUN printed."""
    env = dict(os.environ, DRY_RUN="1", WORK=str(tmp_path / "work"), **env,
               PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
               PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    env.pop("ATTENTION_BACKEND", None)
    done = subprocess.run(["bash", *script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    return {line.split(" -> ")[0]: line for line in done.stdout.splitlines() if " -> " in line}


def test_the_trees_script_runs_the_qwen3_next_fixture_with_the_calls_state_dtype(tmp_path):
    lines = _dry_run(tmp_path, ["bench/e2e/run_gpu_v2_trees.sh", str(tmp_path / "out"), "--ssm-cache-dtype",
                                "bfloat16"], FIXTURE_ARCH="qwen3_next", ENGINES="k3-fp16 tree221-fp16",
                     SHAPE_CONTROL="1")
    assert set(lines) == {"k3-fp16", "tree221-fp16", "reference"}
    for name in ("k3-fp16", "tree221-fp16"):
        assert " model /tmp/fixture-qwen35-qwen3_next-blurred-mtp engine " in lines[name]
    assert " model /tmp/fixture-qwen35-qwen3_next engine " in lines["reference"]
    for line in lines.values():  # every engine, the reference too: fp16 activations, a bf16 GDN state
        assert "'mamba_ssm_cache_dtype': 'bfloat16'" in line and "'dtype': 'float16'" in line
    assert "reconstruct-k3-fp16 {'method': 'mtp', 'num_speculative_tokens': 3," in lines["k3-fp16"]
    assert "'draft_tree_widths': [2, 2, 1]" in lines["tree221-fp16"]
    assert lines["reference"].endswith("shape control True")  # a fixture whose fp16 floor no call has shown


def test_the_chains_script_keeps_qwen35_and_an_fp32_state_by_default(tmp_path):
    lines = _dry_run(tmp_path, ["bench/e2e/run_gpu_v2_chains.sh", str(tmp_path / "out"), "reconstruct:3 store_all:1:v1",
                                "--dtype", "float16"])
    assert set(lines) == {"reconstruct-k3", "store_all-k1-v1", "reference"}
    assert " model /tmp/fixture-qwen35 engine " in lines["reconstruct-k3"]
    assert " model /tmp/fixture-qwen35 engine " in lines["reference"]
    assert "'mamba_state_commit': 'store_all'" in lines["store_all-k1-v1"] and "tokens/request 2" in lines[
        "store_all-k1-v1"]
    assert all("'mamba_ssm_cache_dtype': 'float32'" in line for line in lines.values())


def test_the_fixture_is_built_as_its_architecture_in_its_own_folder(monkeypatch):
    import transformers

    import vllm_treewy.fixture as fixture

    built = []
    monkeypatch.setattr(gpu_vllm_e2e, "built_once", lambda path, build: (build(path), path)[1])
    monkeypatch.setattr(fixture, "build_fixture", lambda out, **kwargs: built.append(("build", out, kwargs)))
    monkeypatch.setattr(fixture, "blurred_mtp_variant", lambda base, out: built.append(("blur", base, out)))
    monkeypatch.setattr(fixture, "fixture_prompts", lambda tokenizer, n: [[1]] * n)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda path: path)

    model, prompts = gpu_vllm_e2e.tree_model(Namespace(fixture_architecture="qwen3_next", blurred_mtp=True))
    assert model == "/tmp/fixture-qwen35-qwen3_next-blurred-mtp" and len(prompts) == 256
    assert built == [("build", "/tmp/fixture-qwen35-qwen3_next", {"shape": "qwen35", "architecture": "qwen3_next"}),
                     ("blur", "/tmp/fixture-qwen35-qwen3_next", "/tmp/fixture-qwen35-qwen3_next-blurred-mtp")]
    built.clear()
    # a namespace without the option (bench/host/gpu_host_audit.py's) keeps the Qwen3.5 fixture
    assert gpu_vllm_e2e.tree_model(Namespace(blurred_mtp=False))[0] == "/tmp/fixture-qwen35"
    assert built == [("build", "/tmp/fixture-qwen35", {"shape": "qwen35", "architecture": "qwen3_5"})]


def test_an_unknown_architecture_is_refused_with_the_known_ones():
    with pytest.raises(ValueError, match="qwen3_5, qwen3_next"):
        gpu_vllm_e2e.fixture_dir("qwen3_moe")


def test_a_cpu_dry_run_keeps_the_state_dtype():
    args = Namespace(batch_sizes=[1, 8], ssm_cache_dtype="float32")
    assert gpu_vllm_e2e.engine_kwargs(args, 4, cuda=False) == {"max_num_seqs": 8, "mamba_ssm_cache_dtype": "float32"}
