"""End-to-end fixtures: the project's tiny Qwen3.5 model and its prompts (built once per test session)."""

import pytest

from vllm_treewy.fixture import build_fixture, fixture_prompts

NUM_PROMPTS = 24


@pytest.fixture(scope="session")
def fixture_model(tmp_path_factory) -> str:
    return str(build_fixture(tmp_path_factory.mktemp("qwen35-tiny")))


@pytest.fixture(scope="session")
def prompts(fixture_model) -> list[list[int]]:
    from transformers import AutoTokenizer

    return fixture_prompts(AutoTokenizer.from_pretrained(fixture_model), NUM_PROMPTS)


@pytest.fixture(scope="session")
def max_tokens() -> list[int]:
    # Different lengths make requests finish at different steps, so later prompts prefill beside decodes.
    return [20 + (i * 7) % 17 for i in range(NUM_PROMPTS)]
