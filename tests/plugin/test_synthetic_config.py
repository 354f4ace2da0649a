"""Synthetic tree acceptance in the speculative config (`synthetic_tree_acceptance_rates`,
`synthetic_tree_sibling_rates`): one clear error per bad config at config creation, and a valid one off CPU sets
vLLM's own synthetic rates to those of the chain with the tree's rank-0 rates. Configs only (no engine): seconds."""

from __future__ import annotations

import pytest

from tests.plugin.test_config import assert_one_clear_error, engine_config, fixture_model, mtp  # noqa: F401

CODE_LIKE = [0.917, 0.837 / 0.917, 0.648 / 0.837]
TREE = dict(mamba_state_commit="reconstruct", draft_tree_widths=[2, 2, 1], rejection_sample_method="synthetic")


def synthetic_tree(**extra) -> dict:
    return mtp(**{**TREE, "synthetic_tree_acceptance_rates": CODE_LIKE, "synthetic_tree_sibling_rates": [0.4] * 3,
                  **extra})


@pytest.fixture
def on_cuda(monkeypatch):
    from vllm.platforms import current_platform
    from vllm.plugins import load_general_plugins

    load_general_plugins()  # the adapter's modules imported as on this machine, before the platform is faked
    monkeypatch.setattr(type(current_platform), "is_cpu", lambda self: False)
    monkeypatch.setattr(type(current_platform), "is_cuda", lambda self: True)


BAD = [
    ("rates-too-short", synthetic_tree(synthetic_tree_acceptance_rates=[0.9, 0.9]),
     r"synthetic_tree_acceptance_rates must be a list of 3 probabilities"),
    ("sibling-above-one", synthetic_tree(synthetic_tree_sibling_rates=[0.4, 1.2, 0.4]),
     r"synthetic_tree_sibling_rates entries must be in \[0, 1\]"),
    ("sibling-missing", synthetic_tree(synthetic_tree_sibling_rates=None),
     r"needs both synthetic_tree_acceptance_rates and synthetic_tree_sibling_rates"),
    ("tree-without-tree-rates", mtp(**TREE, synthetic_acceptance_length=2.5),
     r"needs synthetic_tree_acceptance_rates and synthetic_tree_sibling_rates"),
    ("not-synthetic", synthetic_tree(rejection_sample_method="standard"),
     r"need rejection_sample_method='synthetic' and a draft tree"),
    ("on-a-chain", mtp(mamba_state_commit="reconstruct", rejection_sample_method="synthetic",
                       synthetic_tree_acceptance_rates=CODE_LIKE, synthetic_tree_sibling_rates=[0.4] * 3),
     r"for chains use vLLM's synthetic_acceptance_rates"),
    ("vllm-rates-too", synthetic_tree(synthetic_acceptance_rates=[0.9, 0.8, 0.7]),
     r"leave synthetic_acceptance_rates and synthetic_acceptance_length unset"),
]


@pytest.mark.parametrize("spec,match", [c[1:] for c in BAD], ids=[c[0] for c in BAD])
def test_bad_synthetic_tree_config_fails_at_config_creation(fixture_model, on_cuda, spec, match):  # noqa: F811
    with pytest.raises(ValueError, match=f"(?s){match}") as excinfo:
        engine_config(fixture_model, spec)
    assert_one_clear_error(excinfo)


def test_synthetic_tree_is_refused_on_cpu(fixture_model):  # noqa: F811
    with pytest.raises(ValueError, match="(?s)synthetic tree acceptance runs on Model Runner V2") as excinfo:
        engine_config(fixture_model, synthetic_tree())
    assert_one_clear_error(excinfo)


def test_synthetic_tree_sets_vllms_chain_rates(fixture_model, on_cuda):  # noqa: F811
    spec = engine_config(fixture_model, synthetic_tree()).speculative_config
    assert spec.num_speculative_tokens == 10 and spec.synthetic_tree_sibling_rates == [0.4] * 3
    assert spec.synthetic_acceptance_rates == pytest.approx([0.917, 0.837, 0.648] + [0.0] * 7)
    # a rebuilt copy (the engine core's) arrives with N drafts and vLLM's padded rates, and builds again
    rebuilt = type(spec)(**{name: getattr(spec, name) for name in (
        "method", "num_speculative_tokens", "model", "mamba_state_commit", "draft_tree_widths",
        "rejection_sample_method", "synthetic_acceptance_rates", "synthetic_tree_acceptance_rates",
        "synthetic_tree_sibling_rates", "target_model_config", "target_parallel_config")})
    assert rebuilt.synthetic_acceptance_rates == spec.synthetic_acceptance_rates
