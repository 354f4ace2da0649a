"""Which runner prefix caching of GDN states brings (vLLM's `mamba_cache_mode="align"`): reconstruct with prefix caching
keeps to vLLM's choice of runner (V2's hooks write the boundary states there: tests/plugin/v2/test_prefix_caching.py)
except with pipeline parallelism, where vLLM's V2 feature check lists it with the reason and forcing V2 is refused
at start-up with one message; chains without prefix caching and vLLM's own MTP keep to vLLM's choice. Configs only,
no engine (draft trees with prefix caching: below, and tests/e2e/test_prefix_caching_trees.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from vllm_treewy.fixture import build_fixture

RECONSTRUCT = {"method": "mtp", "num_speculative_tokens": 3, "mamba_state_commit": "reconstruct"}
STORE_ALL = {"method": "mtp", "num_speculative_tokens": 3}


@pytest.fixture(scope="module")
def fixture_model(tmp_path_factory) -> str:
    return str(build_fixture(tmp_path_factory.mktemp("qwen35-tiny")))


def engine_config(model: str, speculative_config: dict, prefix_caching: bool):
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(model=model, dtype="bfloat16", enable_prefix_caching=prefix_caching, max_model_len=512,
                      speculative_config=dict(speculative_config)).create_engine_config()


def _prefix_caching_features(config) -> list[str]:
    return [f for f in config._get_v2_model_runner_unsupported_features() if "prefix caching" in f]


def _with_pipeline_parallelism(config, size: int):
    """The config's caching and speculation with `size` pipeline stages (a stand-in: vLLM's CPU backend does not
    build pipeline-parallel configs)."""
    return SimpleNamespace(cache_config=config.cache_config, speculative_config=config.speculative_config,
                           parallel_config=SimpleNamespace(pipeline_parallel_size=size), use_v2_model_runner=True)


def test_reconstruct_with_prefix_caching_is_not_listed_for_v2(fixture_model):
    from vllm_treewy.vllm_plugin.gdn.prefix_caching import v2_unsupported_with_prefix_caching

    config = engine_config(fixture_model, RECONSTRUCT, prefix_caching=True)
    assert config.cache_config.mamba_cache_mode == "align"
    assert _prefix_caching_features(config) == []
    assert _prefix_caching_features(engine_config(fixture_model, RECONSTRUCT, prefix_caching=False)) == []
    assert _prefix_caching_features(engine_config(fixture_model, STORE_ALL, prefix_caching=True)) == []
    # pipeline parallelism: listed, with the reason
    feature = v2_unsupported_with_prefix_caching(_with_pipeline_parallelism(config, 2))
    assert "reconstruct" in feature and "pipeline parallelism" in feature
    assert v2_unsupported_with_prefix_caching(_with_pipeline_parallelism(config, 1)) is None


def test_reconstruct_with_prefix_caching_runs_on_v2_but_not_with_pipeline_parallelism(fixture_model):
    """(vLLM's CPU backend has no Model Runner V2: the layer's check on a config that asks for it.)"""
    from vllm_treewy.vllm_plugin.gdn.layer import _check_prefix_caching

    config = engine_config(fixture_model, RECONSTRUCT, prefix_caching=True)
    _check_prefix_caching(_with_pipeline_parallelism(config, 1), False, reconstructs_state=True, keeps_slot_counts=True)
    with pytest.raises(ValueError, match=r"pipeline parallelism .* runs on the V1 model runner"):
        _check_prefix_caching(_with_pipeline_parallelism(config, 2), False,
                              reconstructs_state=True, keeps_slot_counts=True)
    _check_prefix_caching(config, False, reconstructs_state=True, keeps_slot_counts=True)  # V1: runs


def test_reconstruct_trees_with_prefix_caching_run_as_chains_do(fixture_model):
    """Reconstruct draft trees with prefix caching run on either runner (V1: `v1.accepted_counts`, V2:
    `v2.accepted_counts`
    write their boundary states), on V2 not with pipeline parallelism, as chains; store_all trees are refused."""
    from vllm_treewy.vllm_plugin.gdn.layer import _check_prefix_caching

    tree = {**RECONSTRUCT, "draft_tree_widths": [2, 2, 1]}
    config = engine_config(fixture_model, tree, prefix_caching=True)
    assert config.cache_config.mamba_cache_mode == "align"
    _check_prefix_caching(config, True, reconstructs_state=True, keeps_slot_counts=True)  # V1: runs
    _check_prefix_caching(_with_pipeline_parallelism(config, 1), True, reconstructs_state=True, keeps_slot_counts=True)
    with pytest.raises(ValueError, match=r"pipeline parallelism .* runs on the V1 model runner"):
        _check_prefix_caching(_with_pipeline_parallelism(config, 2), True,
                              reconstructs_state=True, keeps_slot_counts=True)
    with pytest.raises(ValueError, match=r"mamba_state_commit='store_all' and prefix caching"):
        _check_prefix_caching(config, True, reconstructs_state=False, keeps_slot_counts=True)
