"""Reconstruct with prefix caching of GDN states (vLLM's `mamba_cache_mode="align"`) on vLLM's CPU backend, end to
end: a two-turn workload whose second turn resumes from GDN states that reconstruct wrote at block boundaries while
the first turn decoded.

vLLM's CPU backend cannot run its own MTP (store_all) with prefix caching: in align mode its V1 runner copies the
GDN states between blocks with fused Triton kernels (`precopy_mamba_align_fused_kernel`,
`postprocess_mamba_fused_kernel`) that the CPU wheel does not have ("'function' object is not subscriptable"). Under
reconstruct the plugin takes vLLM's per-request copy instead and writes the boundary states itself
(`vllm_plugin.gdn.prefix_caching`), so it runs here; prefix caching without speculation runs on CPU too.

The engine keeps every boundary state (`prefix_cache_retention_interval=None`): vLLM's default keeps only the prompts'
replay boundaries, which prefill writes. First turn: prompts ending 1 to 6 tokens before the second block boundary
(512), 300 greedy tokens each, so decoding crosses 512 and 768, at the verified root or at a draft. Second turn: each
first turn's prompt + its own output + more text (a chat's next turn), which hits the cache at a boundary the first
turn reached while decoding. Both turns are tie-aware equivalent to the no-speculation engine without prefix caching;
every boundary state reconstruct wrote (SSM state and conv window, every GDN layer) is the fp64 model's state after
the same tokens within bf16 rounding (a stale state is over ten times further off), and vLLM's KV report reserves
two GDN pages per request, as align mode does without speculation. Reconstruct draft trees run with it
(`test_prefix_caching_trees`); store_all trees stop the engine at start-up with one message.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoTokenizer

from vllm_treewy.fixture import fixture_prompts
from vllm_treewy.fixture.exact import ExactModel
from vllm_treewy.kernels.bookkeeping.boundary_states_torch import boundary_rows
from vllm_treewy.vllm_plugin.gdn import prefix_caching
from vllm_treewy.vllm_plugin.v1 import prefix_caching as v1_prefix_caching
from vllm_treewy.vllm_plugin.testing.equivalence import (
    attributes_added_to_vllm,
    compare_tie_aware,
    engine,
    generate_greedy,
    greedy_params,
    kv_cache_report,
)

pytestmark = pytest.mark.e2e

BLOCK = 256  # the fixture's GDN and attention block size on CPU (vLLM grows the attention block to a GDN page)
NUM_PROMPTS, FIRST_TOKENS, NEXT_TURN_TOKENS, SECOND_TOKENS = 6, 280, 64, 16
# where the prompts start in the corpus: 11 tokens apart, leaving out 44, where the 128th token is a near-tie beyond
# one bf16 step at this context length (the fp64 model prefers the reference's token by 0.039, one bf16 step is
# 0.031) that reconstruct resolves the other way, with prefix caching or without
PROMPT_STARTS = (0, 11, 22, 33, 55, 66)
MTP_K3 = {"method": "mtp", "num_speculative_tokens": 3, "mamba_state_commit": "reconstruct"}
ENGINE = dict(max_model_len=1024, max_num_seqs=NUM_PROMPTS)
# bf16 activations through 3 GDN layers put the boundary states 0.2-2% from the fp64 model's; a state one token
# stale, or of the node before, is 25-70% off
STATE_TOLERANCE = 0.05


def _corpus_tokens(model: str) -> list[int]:
    tokens = [t for p in fixture_prompts(AutoTokenizer.from_pretrained(model), 64) for t in p]
    return tokens * (1 + 2048 // len(tokens))


def _generate(llm, prompts, max_tokens):
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy_params(max_tokens), use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs], [o.num_cached_tokens for o in outputs]


def _capturing_boundary_states(captured: list):
    """`v1.prefix_caching.record_after_sampling`, which also keeps (request, tokens before the boundary, node, commit
    count, every layer's state and conv window at the boundary's block) of each boundary it writes (chains and, with
    their commit counts and table, draft trees)."""
    original = v1_prefix_caching.record_after_sampling

    def record(runner, num_reqs, commit_counts=None, commit_ancestors=None):
        views, _, block_size = prefix_caching.runner_boundary_layers(runner)
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


def _two_turns(model: str, speculative_config: dict, prompt_starts, first_tokens: int) -> dict:
    """The two-turn chats (module docstring) with `speculative_config` and every boundary state kept, each first
    prompt ending 1, 2, ... tokens before the second boundary of the engine's block, judged tie-aware against no
    speculation without caching; the boundary states written on the way (`_capturing_boundary_states`)."""
    corpus = _corpus_tokens(model)
    captured = []
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(v1_prefix_caching, "record_after_sampling", _capturing_boundary_states(captured))
        with engine(model, speculative_config=speculative_config, enable_prefix_caching=True,
                    prefix_cache_retention_interval=None, **ENGINE) as llm:
            mode = llm.llm_engine.vllm_config.cache_config.mamba_cache_mode
            report = kv_cache_report(llm)
            block = report.attention_block_size  # vLLM grows it to the GDN page: the GDN block size too
            first = [corpus[start: start + 2 * block - 1 - i] for i, start in enumerate(prompt_starts)]
            out1, _ = _generate(llm, first, first_tokens)
            second = [p + o + corpus[900 + 7 * i: 900 + 7 * i + NEXT_TURN_TOKENS]
                      for i, (p, o) in enumerate(zip(first, out1))]
            out2, cached2 = _generate(llm, second, SECOND_TOKENS)
            metrics = {m.name: m.value for m in llm.get_metrics() if m.name.startswith("vllm:prefix_cache")}
            added = attributes_added_to_vllm(llm)
    exact = ExactModel(model)
    with engine(model, logprobs_mode="raw_logits", **ENGINE) as reference:
        verdicts = [compare_tie_aware(reference, prompts, generate_greedy(reference, prompts, [n] * len(prompts)),
                                      outputs, exact.next_token_logits)
                    for prompts, outputs, n in ((first, out1, first_tokens), (second, out2, SECOND_TOKENS))]
    tokens = {str(i): p + o for i, (p, o) in enumerate(zip(first, out1))}
    return dict(mode=mode, report=report, block=block, first=first, cached2=cached2, metrics=metrics,
                verdicts=verdicts, captured=captured, tokens=tokens, exact=exact, added=added)


def _assert_boundary_states_are_the_models(turns: dict, boundaries) -> None:
    """Each of `boundaries` (`_capturing_boundary_states`' records), every GDN layer: the fp64 model's state and conv
    window after the same tokens, within STATE_TOLERANCE."""
    model = turns["exact"]._model
    for request, position, node, commit, states in boundaries:
        with torch.no_grad():
            cache = model(torch.tensor([turns["tokens"][request][:position]]), use_cache=True).past_key_values
        for layer, state, conv in states:
            # transformers keeps the state [HV, K, V] and the last w inputs
            expected_state = cache.layers[layer].recurrent_states[0][0].transpose(-1, -2)
            expected_conv = cache.layers[layer].conv_states[0][0][:, -conv.shape[1]:]
            errors = (float((state - expected_state).norm() / expected_state.norm()),
                      float((conv - expected_conv).norm() / expected_conv.norm()))
            assert max(errors) <= STATE_TOLERANCE, (request, position, node, commit, layer, errors)


@pytest.fixture(scope="module")
def two_turns(fixture_model):
    turns = _two_turns(fixture_model, MTP_K3, PROMPT_STARTS, FIRST_TOKENS)
    assert turns["block"] == BLOCK
    return turns


def test_turns_equal_no_speculation_without_caching(two_turns):
    assert two_turns["mode"] == prefix_caching.ALIGN
    for verdict in two_turns["verdicts"]:
        assert verdict.passed, verdict.summary()


def test_second_turn_resumes_from_a_boundary_reached_while_decoding(two_turns):
    """Most second turns hit the cache past their first turn's prompt (vLLM hashes a boundary block that decoding
    reached only when a step ends next to it, and drops the last matching block under MTP)."""
    past_prompt = [c for c, p in zip(two_turns["cached2"], two_turns["first"]) if c > len(p)]
    assert len(past_prompt) >= NUM_PROMPTS // 2, two_turns["cached2"]
    assert all(c % BLOCK == 0 for c in two_turns["cached2"])


def test_boundary_states_are_the_models(two_turns):
    """Every boundary state written while decoding, every GDN layer: the fp64 model's state and conv window after
    the same tokens. Boundaries at the verified root and at drafts are among them."""
    captured = two_turns["captured"]
    assert {node == 0 for _, _, node, _, _ in captured} == {True, False}
    _assert_boundary_states_are_the_models(two_turns, captured)


def test_no_state_is_kept_on_vllms_objects(two_turns):
    """The boundary tables live in the model's first GDN layer (`sampling_tables`), not on vLLM's runner; nothing is
    added to its metadata builders or scheduler either."""
    assert two_turns["added"] == []


def test_two_gdn_pages_per_request(two_turns):
    """vLLM reserves the running block and the previous step's per request and GDN group in align mode: as without
    speculation (store_all adds one per draft position)."""
    assert set(two_turns["report"].gdn_blocks_per_request) == {2}



def test_store_all_draft_trees_with_prefix_caching_are_refused(fixture_model):
    """Reconstruct trees run with prefix caching (`test_prefix_caching_trees`); store_all trees keep a state per
    node in blocks of their own, which align mode's copies do not follow."""
    tree = {**MTP_K3, "mamba_state_commit": "store_all", "draft_tree_widths": [2, 2, 1]}
    with pytest.raises(ValueError, match=r"draft_tree_widths with mamba_state_commit='store_all' and prefix caching"):
        with engine(fixture_model, speculative_config=tree, enable_prefix_caching=True):
            pass
