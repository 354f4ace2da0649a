"""min_tokens on tree rows: a node at depth d masks its request's stop tokens exactly when plain decoding would at
that position, i.e. while (committed output length + d) < min_tokens; the same for the root (d = 0), a non-tree
request's one row (d = 0) and the bonus (drawn at the accepted leaf's row).

vLLM 0.32 V1 keys this on the request's committed output (`MinTokensLogitsProcessor`: `apply` masks every row of a
request whose committed output is short, `apply_with_spec_decode` masks a chain's draft position i while
committed + i < min_tokens); V2 keys it on each row's position (`LogitBiasState`: masked while pos + 1 <
prompt_len + min_tokens), which the tree rows set to the root's + depth.

The "model": logits of the next token given the last one, the stop token EOS first and the last token's successor
second, by margins that make every row a point mass in float32 (greedy or random sampling draw the same token).
Plain decoding of a request with committed output length L and min_tokens M emits M - L successors, then EOS. Each
node's children carry its successor (first child) and EOS (second child, where the tree has one), so walks go
below the depth where EOS is first allowed, through nodes whose index in node order differs from their depth. What
every request must emit: `sampled_tree_acceptance_reference` over the exact per-depth distributions.

V1: vLLM's real `Sampler` and `MinTokensLogitsProcessor` (state from a `BatchUpdate`, as the persistent batch gives
it) through `v1.sampler.sample_with_trees`, on both paths (one call: greedy and random; levels: forced by a bad
word and by seeded generators), and the depth view of the processor row by row against vLLM's own chain mask
(`apply_with_spec_decode`, structured-output restore included). V2: one tree step of V2's real sampler, its
`LogitBiasState` kernel interpreted (`tests/plugin/vllm_interpreted`), with the positions the adapter's prepare_attn
hook writes.

Planted bugs must change some request's row: on V1 every row at its root's output length (what both paths did
before), a node at its index in the verified block, every row one token deeper; on V2 the depth positions not
written (root + block index) and every node at its root's position.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from vllm_treewy.spec_decode.tree_sampling import sampled_tree_acceptance_reference
from vllm_treewy.tree import DraftTree
from vllm_treewy.vllm_plugin.trees import min_tokens_at_depth
from vllm_treewy.vllm_plugin.v1 import sampler as v1_sampler
from vllm_treewy.vllm_plugin.trees.step import find_tree_step

VOCAB = 7
EOS = 5
NEVER = 6  # a token no row draws: the bad word that sends a batch down the level path
TREE = DraftTree.from_widths([2, 2, 1])  # depth 3; node j's index differs from its depth
# (committed output length, min_tokens, verifies a tree): min_tokens - length from 0 past the tree's depth, a
# request past its min_tokens, one-row requests on either side.
REQUESTS = ((3, 3, True), (4, 5, True), (2, 4, True), (5, 8, True), (1, 5, True), (2, 7, True), (6, 2, True),
            (3, 4, False), (2, 2, False))


def successor(token: int) -> int:
    return (token + 1) % EOS


def model_table() -> torch.Tensor:
    """`[VOCAB, VOCAB]` float32 logits after each token: EOS 400, the successor 200, the rest 0 (every other
    token's probability is exactly 0 in float32, before and after EOS is masked)."""
    table = torch.zeros(VOCAB, VOCAB)
    table[:, EOS] = 400.0
    for token in range(VOCAB):
        table[token, successor(token)] = 200.0
    return table


def plain_distribution(table: torch.Tensor, root: int, length: int, min_tokens: int):
    """`distribution_at(path)` of plain decoding: the row after the path's last token with EOS masked while the
    output length at that position (length + depth) is below min_tokens."""

    def distribution_at(path):
        logits = table[path[-1] if path else root].double().clone()
        if length + len(path) < min_tokens:
            logits[EOS] = float("-inf")
        return torch.softmax(logits, dim=-1)

    return distribution_at


def drafts_below(root: int) -> list[int]:
    """Node tokens: a first child carries its parent's successor, a second child EOS."""
    tokens, seen = [], {}
    for parent in TREE.parents:
        rank = seen.get(parent, 0)
        seen[parent] = rank + 1
        above = root if parent < 0 else tokens[parent]
        tokens.append(successor(above) if rank == 0 else EOS)
    return tokens


def expected_rows(roots: list[int]) -> list[list[int]]:
    """What plain decoding makes each request emit this step, `[path..., bonus, -1...]` (block_len wide)."""
    table, rows = model_table(), []
    for (length, min_tokens, tree), root in zip(REQUESTS, roots):
        if tree:
            drafts = drafts_below(root)
            path, bonus = sampled_tree_acceptance_reference(
                TREE.parents, drafts, plain_distribution(table, root, length, min_tokens), torch.Generator())
            emitted = [drafts[n] for n in path] + [bonus]
        else:
            emitted = [int(plain_distribution(table, root, length, min_tokens)([]).argmax())]
        rows.append(emitted + [-1] * (1 + TREE.num_nodes - len(emitted)))
    return rows


# -- V1 --------------------------------------------------------------------------------------------------------------
def min_tokens_processor(outputs: list[list[int]]):
    """vLLM's `MinTokensLogitsProcessor` holding the batch's requests as the persistent batch adds them (each
    request's output list by reference)."""
    from vllm.sampling_params import SamplingParams
    from vllm.v1.sample.logits_processor.builtin import MinTokensLogitsProcessor
    from vllm.v1.sample.logits_processor.interface import BatchUpdate

    processor = MinTokensLogitsProcessor(None, torch.device("cpu"), False)
    added = [(i, SamplingParams(min_tokens=min_tokens, stop_token_ids=[EOS]), [0], outputs[i])
             for i, (_, min_tokens, _) in enumerate(REQUESTS)]
    processor.update_state(BatchUpdate(batch_size=len(REQUESTS), removed=[], added=added, moved=[]))
    return processor


def v1_metadata(outputs, greedy: bool):
    from vllm.v1.sample.logits_processor import LogitsProcessors
    from vllm.v1.sample.metadata import SamplingMetadata

    n = len(REQUESTS)
    return SamplingMetadata(
        temperature=None if greedy else torch.ones(n), all_greedy=greedy, all_random=not greedy, top_p=None,
        top_k=None, generators={}, max_num_logprobs=None, no_penalties=True, prompt_token_ids=None,
        frequency_penalties=torch.zeros(n), presence_penalties=torch.zeros(n), repetition_penalties=torch.ones(n),
        output_token_ids=outputs, allowed_token_ids_mask=None, bad_words_token_ids={},
        logitsprocs=LogitsProcessors([min_tokens_processor(outputs)]))


def v1_step(roots: list[int]):
    """(logits, spec-decode metadata, tree step) of a V1 step: tree requests verify root + drafts, the others one
    token; every row's logits the table's row of its token."""
    tokens, num_drafts = [], []
    for (_, _, tree), root in zip(REQUESTS, roots):
        tokens += [root] + (drafts_below(root) if tree else [])
        num_drafts.append(TREE.num_nodes if tree else 0)
    num_drafts = np.array(num_drafts)
    query_start_loc = np.concatenate([[0], np.cumsum(num_drafts + 1)])
    step = find_tree_step(TREE, num_drafts, num_drafts, query_start_loc, np.full(len(REQUESTS), 50),
                          torch.device("cpu"))
    drafts = [t for (_, _, tree), root in zip(REQUESTS, roots) if tree for t in drafts_below(root)]
    spec = SimpleNamespace(cu_num_sampled_tokens=torch.from_numpy(query_start_loc[1:]).int(),
                           draft_token_ids=torch.tensor(drafts, dtype=torch.int32))
    return model_table()[torch.tensor(tokens)], spec, step


def v1_run(metadata_change, greedy: bool = False, expect: str = "every-node"):
    from vllm.v1.sample.sampler import Sampler

    roots = [i % EOS for i in range(len(REQUESTS))]
    outputs = [[0] * length for length, _, _ in REQUESTS]
    metadata = metadata_change(v1_metadata(outputs, greedy))
    assert v1_sampler._needs_level_path(metadata) == (expect == "levels")
    logits, spec, step = v1_step(roots)
    out, _, _ = v1_sampler.sample_with_trees(logits, spec, step, Sampler(), metadata)
    return out.tolist(), expected_rows(roots)


V1_BATCHES = {
    "every-node-greedy": dict(metadata_change=lambda m: m, greedy=True),
    "every-node-random": dict(metadata_change=lambda m: m),
    "levels-bad-word": dict(metadata_change=lambda m: dataclasses.replace(m, bad_words_token_ids={0: [[NEVER]]}),
                            expect="levels"),
    "levels-seeded": dict(metadata_change=lambda m: dataclasses.replace(
        m, generators={i: torch.Generator().manual_seed(i) for i in range(0, len(REQUESTS), 2)}), expect="levels"),
}


def test_the_batch_reaches_every_case():
    """The expected rows hold EOS after 0, 1, 2 and 3 successors and none at all (min_tokens past the tree), and
    walks pass nodes whose index in node order is not their depth."""
    rows = expected_rows([i % EOS for i in range(len(REQUESTS))])
    firsts = {row.index(EOS) if EOS in row else None for row in rows}
    assert {0, 1, 2, 3, None} <= firsts, rows
    assert any(row[: TREE.max_depth + 1].count(-1) == 0 for row in rows)  # a walk to a leaf


@pytest.mark.parametrize("batch", V1_BATCHES)
def test_v1_tree_rows_mask_stop_tokens_at_their_depth(batch):
    got, expected = v1_run(**V1_BATCHES[batch])
    assert got == expected, "\n".join(f"request {REQUESTS[i]}: got {g}, plain decoding {e}"
                                      for i, (g, e) in enumerate(zip(got, expected)) if g != e)


def test_a_depths_mask_is_vllms_chain_mask_at_that_position():
    """`MinTokensAtDepth(d)` on one row per request masks exactly what vLLM's rejection sampler masks at a chain's
    draft position d (`apply_with_spec_decode`), structured-output requests' restore included (a row the grammar
    leaves only stop tokens keeps them), on random logits with some rows all -inf but for the stop tokens."""
    from vllm.sampling_params import SamplingParams, StructuredOutputsParams
    from vllm.v1.sample.logits_processor.builtin import MinTokensLogitsProcessor
    from vllm.v1.sample.logits_processor.interface import BatchUpdate

    depth_limit, stops = 4, [EOS, NEVER]
    generator = torch.Generator().manual_seed(3)
    outputs = [[0] * length for length in (2, 5, 1, 3, 0, 7)]
    added = [(i, SamplingParams(min_tokens=min_tokens, stop_token_ids=stops,
                                structured_outputs=StructuredOutputsParams(regex="a+") if i % 2 else None),
              [0], outputs[i]) for i, min_tokens in enumerate((4, 6, 3, 3, 2, 9))]
    processor = MinTokensLogitsProcessor(None, torch.device("cpu"), False)
    processor.update_state(BatchUpdate(batch_size=len(outputs), removed=[], added=added, moved=[]))
    chain = torch.randn(len(outputs), depth_limit, VOCAB, generator=generator)
    only_stops = torch.rand(len(outputs), depth_limit, generator=generator) < 0.5
    chain[only_stops] = chain[only_stops].index_fill(-1, torch.tensor([0, 1, 2, 3, 4]), float("-inf"))
    vllms = processor.apply_with_spec_decode(chain.clone().flatten(0, 1), [depth_limit] * len(outputs))
    vllms = vllms.view_as(chain)
    for depth in range(depth_limit):
        ours = min_tokens_at_depth.at_depth(processor, depth).apply(chain[:, depth].clone())
        assert torch.equal(ours, vllms[:, depth]), depth
    assert bool(vllms.isneginf().any()) and bool((vllms[..., EOS].isfinite() & only_stops).any())


def _plant_at_depth(monkeypatch, planted):
    """`at_depth` replaced where both tree paths reach it (the module's own callers and v1.sampler's import)."""
    monkeypatch.setattr(min_tokens_at_depth, "at_depth", planted)
    monkeypatch.setattr(v1_sampler, "at_depth", planted)


def _root_length(monkeypatch):
    """Every row at its root's output length (vLLM's `apply` as it is: what both paths did before)."""
    _plant_at_depth(monkeypatch, lambda processor, depth: processor)


def _node_order_index(monkeypatch):
    """Node j - 1 at output length committed + j (its index in the verified block) instead of its depth."""
    monkeypatch.setattr(v1_sampler, "block_depths", lambda tree: np.arange(1 + tree.num_nodes))


def _one_deeper(monkeypatch):
    """Every row one token deeper than it is."""
    at_depth = min_tokens_at_depth.at_depth
    _plant_at_depth(monkeypatch, lambda processor, depth: at_depth(processor, depth + 1))


V1_PLANTED = {"root-length": _root_length, "node-order-index": _node_order_index, "one-deeper": _one_deeper}


@pytest.mark.parametrize(("bug", "batch"), [(bug, batch) for bug in V1_PLANTED
                                             for batch in ("every-node-random", "levels-bad-word")
                                             if not (bug == "node-order-index" and batch.startswith("levels"))])
def test_v1_planted_bug_fails(monkeypatch, bug, batch):
    """Each plant on both paths, node-order-index on the one-call path only (the level path has no block index:
    its rows' depth is the level)."""
    V1_PLANTED[bug](monkeypatch)
    got, expected = v1_run(**V1_BATCHES[batch])
    assert got != expected


# -- V2 --------------------------------------------------------------------------------------------------------------
PROMPT_LEN = 12
TREE_REQUESTS = [i for i, (_, _, tree) in enumerate(REQUESTS) if tree]


def v2_run(monkeypatch):
    """One V2 step of the tree requests (batch order reversed), through the adapter's prepare_attn and sample hooks:
    `(sampled rows by request, plain decoding's rows)`."""
    import vllm.v1.worker.gpu.buffer_utils as buffer_utils
    import vllm.v1.worker.gpu.sample.sampler as v2_sampler_module
    from vllm.sampling_params import SamplingParams
    from vllm.v1.worker.gpu.states import RequestState

    from tests.plugin.v2.test_sampling import (
        _vllm_config,
        run_v2_step,
        v2_kernels,
        v2_runner,
        v2_tree_batch,
    )
    from tests.plugin.vllm_interpreted import load_vllm_module

    monkeypatch.setattr(buffer_utils, "is_uva_available", lambda: False)
    # V2's min-tokens mask (`_bias_kernel`) and its staged writes of the stop tokens are Triton kernels: interpreted
    monkeypatch.setattr(v2_sampler_module, "LogitBiasState",
                        load_vllm_module("vllm.v1.worker.gpu.sample.logit_bias").LogitBiasState)
    monkeypatch.setattr(buffer_utils, "_apply_write_kernel",
                        load_vllm_module("vllm.v1.worker.gpu.buffer_utils")._apply_write_kernel)
    num_reqs, cpu = len(TREE_REQUESTS), torch.device("cpu")
    req_states = RequestState(num_reqs, PROMPT_LEN + 64, num_reqs * (1 + TREE.num_nodes), TREE.num_nodes, VOCAB, cpu)
    req_states.prompt_len.np[:num_reqs] = PROMPT_LEN
    req_states.prefill_len.np[:num_reqs] = PROMPT_LEN
    req_states.prefill_len.copy_to_uva()
    sampler = v2_sampler_module.Sampler(_vllm_config(), num_reqs, VOCAB, cpu, req_states,
                                        num_speculative_tokens=TREE.num_nodes)
    for i, request in enumerate(TREE_REQUESTS):
        _, min_tokens, _ = REQUESTS[request]
        sampler.add_request(i, SamplingParams(temperature=1.0, min_tokens=min_tokens, stop_token_ids=[EOS]))
    sampler.apply_staged_writes()
    roots = [request % EOS for request in TREE_REQUESTS]
    lengths = torch.tensor([REQUESTS[request][0] for request in TREE_REQUESTS])
    drafts = torch.tensor([drafts_below(root) for root in roots])
    idx_mapping = torch.arange(num_reqs).flip(0)
    # the root, the last emitted token, sits at the committed length's position: prompt + output - 1
    batch = v2_tree_batch(torch.tensor(roots), drafts, PROMPT_LEN + lengths - 1, idx_mapping)
    with v2_kernels(monkeypatch, interpreted=False):
        output, _, _ = run_v2_step(v2_runner(sampler, TREE, model_table()), batch)
    sampled = torch.empty_like(output.sampled_token_ids)
    sampled[idx_mapping] = output.sampled_token_ids
    expected = expected_rows([request % EOS for request in range(len(REQUESTS))])
    return sampled.tolist(), [expected[request] for request in TREE_REQUESTS]


def _chain_positions(monkeypatch):
    """The depth positions not written: a node keeps V2's root + block index."""
    from vllm_treewy.vllm_plugin.v2 import runner as v2_tree_runner

    monkeypatch.setattr(v2_tree_runner, "override_positions", lambda positions, step: None)


def _root_position(monkeypatch):
    """Every node at its root's position."""
    from vllm_treewy.vllm_plugin.v2 import runner as v2_tree_runner

    def every_node_at_the_root(positions, step):
        block = step.token_indices.view(step.num_requests, step.block_len)
        positions[block] = positions[block[:, :1]]

    monkeypatch.setattr(v2_tree_runner, "override_positions", every_node_at_the_root)


def test_v2_tree_rows_mask_stop_tokens_at_their_depth(monkeypatch):
    got, expected = v2_run(monkeypatch)
    assert got == expected, "\n".join(f"request {REQUESTS[TREE_REQUESTS[i]]}: got {g}, plain decoding {e}"
                                      for i, (g, e) in enumerate(zip(got, expected)) if g != e)


@pytest.mark.parametrize("bug", ["chain-positions", "root-position"])
def test_v2_planted_position_bug_fails(monkeypatch, bug):
    {"chain-positions": _chain_positions, "root-position": _root_position}[bug](monkeypatch)
    got, expected = v2_run(monkeypatch)
    assert got != expected
