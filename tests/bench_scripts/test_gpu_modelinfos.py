"""The model-info cache files the GPU scripts seed (bench/e2e/gpu_site.py) are what the installed vLLM computes for the
same model sources: the hash vLLM keys them by, and the inspected interfaces."""

import importlib.util
import json
from pathlib import Path

import pytest
from vllm.model_executor.models.registry import ModelRegistry, _ModelInfo

from bench.e2e.gpu_site import MODEL_INFOS, seed_model_info_cache

ARCHITECTURES = ("Qwen3_5ForCausalLM", "Qwen3_5MTP", "Qwen3_5MoeForCausalLM", "Qwen3_5MoeMTP", "Qwen3NextForCausalLM",
                 "Qwen3NextMTP")


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_seed_matches_the_installed_vllm(architecture):
    registered = ModelRegistry.models[architecture]
    seed = json.loads((MODEL_INFOS / registered._get_cache_filename()).read_text())
    source = Path(importlib.util.find_spec(registered.module_name).origin)
    assert seed["hash"] == registered._get_modelinfo_module_hash(source)
    computed = _ModelInfo.from_model_cls(registered.load_model_cls())
    assert seed["modelinfo"] == json.loads(json.dumps(computed.__dict__, default=list))


def test_seeding_copies_only_what_the_cache_lacks(tmp_path, monkeypatch):
    from vllm import envs

    monkeypatch.setattr(envs, "VLLM_CACHE_ROOT", str(tmp_path))
    assert seed_model_info_cache() == sorted(p.name for p in MODEL_INFOS.glob("*.json"))
    assert seed_model_info_cache() == []
