"""MTP draft trees ([2, 2, 1], reconstruct) with prefix caching of GDN states (vLLM's `mamba_cache_mode="align"`) on
vLLM's CPU backend (V1 runner), end to end: the chain workload of `test_prefix_caching` (a two-turn chat whose second
turn resumes from GDN states written at block boundaries while the first turn decoded) with the fixture's
blurred-MTP variant, whose head is right about half the time, so the accepted paths take other branches than the
first and a boundary node is often not the block index its depth would be in a chain.

Both turns are tie-aware equivalent to the no-speculation engine without prefix caching; the engine's own counters
show prefix-cache hits (`vllm:prefix_cache_hits`) and second turns resume past their first turn's prompt (vLLM
hashes a block that decoding reached only when a step ends next to it, so not every one does); every
checked boundary state the tree steps wrote (SSM state and conv window, every GDN layer; the deepest nodes' and two
at the root) is the fp64 model's state after the same tokens within bf16 rounding (the state after the block-index node instead of the path's is 25-70% off, as a
stale one is), and boundaries at the root and at drafts deeper on the path are among them. vLLM's KV report reserves
two GDN pages per request.
"""

from __future__ import annotations

import pytest
import torch

from tests.e2e.test_prefix_caching import STATE_TOLERANCE, _corpus_tokens, _generate
from vllm_treewy.fixture import blurred_mtp_variant
from vllm_treewy.fixture.exact import ExactModel
from vllm_treewy.kernels.boundary_states import boundary_rows
from vllm_treewy.vllm_plugin import prefix_caching
from vllm_treewy.vllm_plugin.testing.equivalence import (
    attributes_added_to_vllm,
    compare_tie_aware,
    engine,
    generate_greedy,
    kv_cache_report,
)

pytestmark = pytest.mark.e2e

# prompts ending 1 to 6 tokens before the second block boundary, 270 greedy tokens each: decoding crosses it and
# the next (a second turn resumes at a decoded boundary only where the block after it matches too: vLLM drops the
# last matching block under MTP)
NUM_PROMPTS, FIRST_TOKENS, NEXT_TURN_TOKENS, SECOND_TOKENS = 6, 270, 64, 16
PROMPT_STARTS = tuple(11 * i for i in range(NUM_PROMPTS))
# the fp64 model's forward over each boundary's tokens is the slow part: these many boundaries, the root's and the
# deepest nodes' first
CHECKED_BOUNDARIES = 8
TREE = {"method": "mtp", "num_speculative_tokens": 3, "mamba_state_commit": "reconstruct",
        "draft_tree_widths": [2, 2, 1]}
ENGINE = dict(max_model_len=1024, max_num_seqs=NUM_PROMPTS)


def _capturing_boundary_states(captured: list):
    """`prefix_caching.record_after_sampling`, which also keeps (request, tokens before the boundary, whether the
    boundary node is the root, every layer's state and conv window at the boundary's block) of each boundary it
    writes."""
    original = prefix_caching.record_after_sampling

    def record(runner, num_reqs, commit_counts=None, commit_ancestors=None):
        views, _, block_size = prefix_caching._runner_boundary_layers(runner)
        layers = [int(name.split("layers.")[1].split(".")[0]) for group in runner.kv_cache_config.kv_cache_groups
                  for name in group.layer_names
                  if getattr(runner.compilation_config.static_forward_context[name], "reconstructs_state", False)]
        counts = runner.num_accepted_tokens.gpu if commit_counts is None else commit_counts
        rows = boundary_rows(runner.seq_lens, runner.num_decode_draft_tokens.gpu, counts, num_reqs, block_size,
                             commit_ancestors)
        original(runner, num_reqs, commit_counts, commit_ancestors)
        for i, row in enumerate(rows.rows.tolist()):
            if int(rows.nodes[i]) < 0:
                continue
            dest_column = int(rows.dest_columns[i])
            blocks = [int(v.block_table[row, dest_column]) for v in views]
            captured.append((runner.input_batch.req_ids[row].split("-")[0], (dest_column + 1) * block_size,
                             int(rows.nodes[i]), int(rows.commits[i]),
                             [(layer, v.state[b].double(), v.conv_history[b].double())
                              for layer, v, b in zip(layers, views, blocks)]))

    return record


@pytest.fixture(scope="module")
def tree_turns(fixture_model, tmp_path_factory):
    model = str(blurred_mtp_variant(fixture_model, tmp_path_factory.mktemp("blurred-mtp")))
    corpus = _corpus_tokens(model)
    captured = []
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(prefix_caching, "record_after_sampling", _capturing_boundary_states(captured))
        with engine(model, speculative_config=TREE, enable_prefix_caching=True, prefix_cache_retention_interval=None,
                    **ENGINE) as llm:
            mode = llm.llm_engine.vllm_config.cache_config.mamba_cache_mode
            report = kv_cache_report(llm)
            block = report.attention_block_size  # vLLM grows it to the GDN page: the GDN block size too
            first = [corpus[start: start + 2 * block - 1 - i] for i, start in enumerate(PROMPT_STARTS)]
            out1, _ = _generate(llm, first, FIRST_TOKENS)
            second = [p + o + corpus[900 + 7 * i: 900 + 7 * i + NEXT_TURN_TOKENS]
                      for i, (p, o) in enumerate(zip(first, out1))]
            out2, cached2 = _generate(llm, second, SECOND_TOKENS)
            metrics = {m.name: m.value for m in llm.get_metrics() if m.name.startswith("vllm:prefix_cache")}
            added = attributes_added_to_vllm(llm)
    exact = ExactModel(model)
    with engine(model, logprobs_mode="raw_logits", **ENGINE) as reference:
        verdicts = [compare_tie_aware(reference, prompts, generate_greedy(reference, prompts, [n] * NUM_PROMPTS),
                                      outputs, exact.next_token_logits)
                    for prompts, outputs, n in ((first, out1, FIRST_TOKENS), (second, out2, SECOND_TOKENS))]
    tokens = {str(i): p + o for i, (p, o) in enumerate(zip(first, out1))}
    return dict(mode=mode, report=report, block=block, first=first, cached2=cached2, metrics=metrics,
                verdicts=verdicts, captured=captured, tokens=tokens, exact=exact, added=added)


def test_tree_turns_equal_no_speculation_without_caching(tree_turns):
    assert tree_turns["mode"] == prefix_caching.ALIGN
    for verdict in tree_turns["verdicts"]:
        assert verdict.passed, verdict.summary()


def test_engine_reports_prefix_cache_hits_past_the_first_prompt(tree_turns):
    """The engine's counters show hits, and second turns resume past their first turn's prompt, at a block boundary
    that the first turn's tree steps reached while decoding (whose state they wrote)."""
    metrics = tree_turns["metrics"]
    assert metrics["vllm:prefix_cache_hits"] > 0 and metrics["vllm:prefix_cache_queries"] > 0, metrics
    past_prompt = [c for c, p in zip(tree_turns["cached2"], tree_turns["first"]) if c > len(p)]
    assert len(past_prompt) >= NUM_PROMPTS // 2, tree_turns["cached2"]
    assert all(c % tree_turns["block"] == 0 for c in tree_turns["cached2"])


def test_tree_boundary_states_are_the_models(tree_turns):
    """The boundary states the tree steps wrote at the deepest nodes and at the root, every GDN layer: the fp64
    model's state and conv window after the same tokens. Among them boundaries at the root and at nodes whose block index is not their depth (a path off
    the first branch, or past a first-level sibling)."""
    captured = tree_turns["captured"]
    assert {node == 0 for _, _, node, _, _ in captured} == {True, False}
    tree_nodes = [(node, commit) for _, _, node, commit, _ in captured if node > 0]
    # [2, 2, 1]'s node order: depth 1 = nodes 1, 2; depth 2 = 3..6; depth 3 = 7..10: only node 1 is its own depth
    assert any(node > 1 for node, _ in tree_nodes), captured and [c[1:4] for c in captured]
    model = tree_turns["exact"]._model
    at_root = [c for c in captured if c[2] == 0]
    checked = sorted((c for c in captured if c[2] > 0), key=lambda c: -c[2])[: CHECKED_BOUNDARIES - 2] + at_root[:2]
    for request, position, node, commit, states in checked:
        with torch.no_grad():
            cache = model(torch.tensor([tree_turns["tokens"][request][:position]]), use_cache=True).past_key_values
        for layer, state, conv in states:
            expected_state = cache.layers[layer].recurrent_states[0][0].transpose(-1, -2)
            expected_conv = cache.layers[layer].conv_states[0][0][:, -conv.shape[1]:]
            errors = (float((state - expected_state).norm() / expected_state.norm()),
                      float((conv - expected_conv).norm() / expected_conv.norm()))
            assert max(errors) <= STATE_TOLERANCE, (request, position, node, commit, layer, errors)


def test_no_state_is_kept_on_vllms_objects(tree_turns):
    assert tree_turns["added"] == []


def test_two_gdn_pages_per_request(tree_turns):
    assert set(tree_turns["report"].gdn_blocks_per_request) == {2}
