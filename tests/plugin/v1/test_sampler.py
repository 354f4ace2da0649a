"""The tree sampler's one-call path hands vLLM's sampler every logits row of the step with the per-request metadata
expanded to the rows (`v1.sampler._node_rows_metadata`), and picks its path by what the batch needs."""

from __future__ import annotations

import dataclasses

import torch

from vllm_treewy.vllm_plugin.v1 import sampler as v1_sampler

VOCAB = 5
# Request 0 verifies a tree of 2 nodes (rows 0-2), request 1 has one row (3), request 2 a tree again (rows 4-6).
SAMPLED_END = torch.tensor([3, 4, 7])
TREE_REQUESTS = torch.tensor([0, 2])
ROW_REQUESTS = torch.tensor([0, 0, 0, 1, 2, 2, 2])


class RequestBias:
    """A logits processor as vLLM's are written: row i of its logits is request i (adds 10 ** i to the row)."""

    calls = 0

    def is_argmax_invariant(self) -> bool:
        return False

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        assert logits.shape[0] == SAMPLED_END.numel()
        RequestBias.calls += 1
        logits += (10.0 ** torch.arange(logits.shape[0], dtype=logits.dtype))[:, None]
        return logits


def _metadata(processors):
    from vllm.v1.sample.logits_processor import LogitsProcessors
    from vllm.v1.sample.metadata import SamplingMetadata

    mask = torch.zeros(3, VOCAB, dtype=torch.bool)
    mask[1, 0] = True
    return SamplingMetadata(
        temperature=torch.tensor([0.5, 1.0, 0.7]), all_greedy=False, all_random=True,
        top_p=torch.tensor([0.9, 1.0, 0.8]), top_k=None, generators={}, max_num_logprobs=None, no_penalties=True,
        prompt_token_ids=None, frequency_penalties=torch.zeros(3), presence_penalties=torch.zeros(3),
        repetition_penalties=torch.ones(3), output_token_ids=[[], [], []], allowed_token_ids_mask=mask,
        bad_words_token_ids={}, logitsprocs=LogitsProcessors(processors))


def _columns():
    block_rows = (SAMPLED_END[TREE_REQUESTS] - 3)[:, None] + torch.arange(3)
    return v1_sampler._block_columns(SAMPLED_END - 1, block_rows, TREE_REQUESTS, [0, 1, 1])


def test_rows_know_their_request():
    assert torch.equal(v1_sampler._row_requests(SAMPLED_END, 7), ROW_REQUESTS)


def test_per_request_metadata_is_expanded_to_every_row():
    metadata = v1_sampler._node_rows_metadata(_metadata([]), lambda: ROW_REQUESTS, _columns)
    assert torch.equal(metadata.temperature, torch.tensor([0.5] * 3 + [1.0] + [0.7] * 3))
    assert torch.equal(metadata.top_p, torch.tensor([0.9] * 3 + [1.0] + [0.8] * 3))
    assert metadata.top_k is None
    assert metadata.allowed_token_ids_mask[:, 0].tolist() == [False] * 3 + [True] + [False] * 3
    assert not list(metadata.logitsprocs.all)


def test_a_logits_processor_runs_once_on_every_row_with_its_requests_state():
    """Once per verified-block column over one row per request: each row gets its own request's bias exactly once
    (request 1's one row is handed to the processor again in later columns and left as it was)."""
    RequestBias.calls = 0
    metadata = v1_sampler._node_rows_metadata(_metadata([RequestBias()]), lambda: ROW_REQUESTS, _columns)
    (wrapped,) = metadata.logitsprocs.non_argmax_invariant
    logits = wrapped.apply(torch.zeros(7, VOCAB))
    assert RequestBias.calls == 3  # 1 + N columns
    assert logits[:, 0].tolist() == [1.0] * 3 + [10.0] + [100.0] * 3
    assert torch.equal(logits, logits[:, :1].expand_as(logits))


def test_idle_builtin_processors_are_left_out():
    from vllm.v1.sample.logits_processor.builtin import MinPLogitsProcessor

    idle, used = object.__new__(MinPLogitsProcessor), object.__new__(MinPLogitsProcessor)
    idle.min_p_count, used.min_p_count = 0, 2
    assert v1_sampler._idle(idle) and not v1_sampler._idle(used) and not v1_sampler._idle(RequestBias())
    metadata = v1_sampler._node_rows_metadata(_metadata([idle]), lambda: ROW_REQUESTS, _columns)
    assert list(metadata.logitsprocs.all) == [idle]  # as it was: its apply returns the logits untouched


def test_the_path_follows_what_the_batch_needs():
    plain = _metadata([])
    assert not v1_sampler._needs_level_path(plain)
    assert v1_sampler._needs_level_path(dataclasses.replace(plain, generators={0: torch.Generator()}))
    assert v1_sampler._needs_level_path(dataclasses.replace(plain, no_penalties=False))
    assert v1_sampler._needs_level_path(dataclasses.replace(plain, bad_words_token_ids={1: [[3]]}))
    assert v1_sampler._needs_level_path(dataclasses.replace(plain, logprob_token_ids={0: [1, 2]}))
