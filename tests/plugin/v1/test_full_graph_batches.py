"""Under reconstruct, a batch vLLM would take for a uniform decode but that holds a prompt chunk of the decode's
length is kept out of the FULL CUDA graphs (`vllm_plugin/v1/full_graph_batches.py`)."""

from types import SimpleNamespace

import numpy as np
import pytest

from vllm_treewy.vllm_plugin.v1.full_graph_batches import _keeping_prompt_chunks_out_of_full_graphs


def fake_runner(drafts_per_row: list[int], strategy: str = "reconstruct", query_len: int = 4):
    return SimpleNamespace(speculative_config=SimpleNamespace(mamba_state_commit=strategy),
                           uniform_decode_query_len=query_len,
                           num_decode_draft_tokens=SimpleNamespace(np=np.array(drafts_per_row + [-1, -1])))


@pytest.mark.parametrize("query_len", [4, 5])  # a chain of 3 drafts; a [2, 1] tree's 1 + N = 5 block
@pytest.mark.parametrize("case, drafts, num_tokens, forced", [
    ("every row verifies drafts", "all", "uniform", None),
    ("a prompt chunk of the decode's length", "one prompt", "uniform", False),
    ("not uniform", "one prompt", "one less", None),
])
def test_a_prompt_chunk_of_decode_length_stays_out_of_full_graphs(query_len, case, drafts, num_tokens, forced):
    calls = []
    wrapped = _keeping_prompt_chunks_out_of_full_graphs(
        lambda self, num_tokens, num_reqs, tokens_np, max_tokens, **kw: calls.append(kw))
    rows = [query_len - 1, query_len - 1] if drafts == "all" else [query_len - 1, -1]
    tokens = 2 * query_len - (num_tokens == "one less")
    wrapped(fake_runner(rows, query_len=query_len), num_tokens=tokens, num_reqs=2, num_scheduled_tokens_np=None,
            max_num_scheduled_tokens=query_len)
    assert calls[-1].get("force_uniform_decode") is forced


def test_dummy_runs_and_store_all_are_left_as_vllm_has_them():
    calls = []
    wrapped = _keeping_prompt_chunks_out_of_full_graphs(
        lambda self, num_tokens, num_reqs, tokens_np, max_tokens, **kw: calls.append(kw))
    wrapped(fake_runner([3, -1]), 8, 2, None, 4, force_uniform_decode=True)  # capture: vLLM's choice stands
    assert calls[-1]["force_uniform_decode"] is True
    wrapped(fake_runner([3, -1], strategy="store_all"), 8, 2, None, 4)
    assert "force_uniform_decode" not in calls[-1]
