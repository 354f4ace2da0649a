"""The fixture keeps its GDN state in fp32 on every CPU, as Qwen3.5 checkpoints do (`mamba_ssm_dtype`).

vLLM 0.32 on CPU resets an "auto" SSM cache dtype to fp32 only where the CPU has AVX-512-BF16; elsewhere the
state stays bf16. Measured on this project's 2-core CI machine with vLLM's ISA probes answering False
(no AMX, no AVX-512-BF16), 32 prompts: with the bf16 state reconstruct k=3 split from the no-speculation engine by
two bf16 steps (prompt 2, token 21, logit gap 0.0625); with the state in fp32 it was within the tie rule. The same
2-3-step splits show on the H200 for every speculative engine, vLLM's store_all included, whenever the state is
bf16 (bench/results/gpu_vllm_e2e/README.md): rounding of a bf16 state, not a reconstruct bug.
"""

import pytest
import torch
from vllm.engine.arg_utils import EngineArgs

from vllm_treewy.fixture import build_fixture
from vllm_treewy.vllm_plugin.testing.equivalence import ENGINE_DEFAULTS


@pytest.fixture(scope="module")
def fixture_model(tmp_path_factory):
    return str(build_fixture(tmp_path_factory.mktemp("fixture")))


@pytest.mark.parametrize("avx512_bf16", [True, False])
def test_gdn_state_is_fp32_on_any_cpu(fixture_model, monkeypatch, avx512_bf16):
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: avx512_bf16)
    args = EngineArgs(model=fixture_model, **{k: v for k, v in ENGINE_DEFAULTS.items() if k != "seed"})
    config = args.create_engine_config()
    assert config.cache_config.mamba_ssm_cache_dtype == "float32"
