"""MTP draft trees ([2, 2, 1], reconstruct) with prefix caching of GDN states (vLLM's `mamba_cache_mode="align"`) on
vLLM's CPU backend (V1 runner), end to end: the chain workload of `test_prefix_caching` (a two-turn chat whose second
turn resumes from GDN states written at block boundaries while the first turn decoded) with the fixture's
blurred-MTP variant, whose head is right about half the time, so the accepted paths take other branches than the
first and a boundary node is often not the block index its depth would be in a chain.

Both turns are tie-aware equivalent to the no-speculation engine without prefix caching; the engine's own counters
show prefix-cache hits (`vllm:prefix_cache_hits`) and second turns resume past their first turn's prompt (vLLM
hashes a block that decoding reached only when a step ends next to it, so not every one does); every checked
boundary state the tree steps wrote (SSM state and conv window, every GDN layer; the deepest nodes' and two at the
root) is the fp64 model's state after the same tokens within bf16 rounding (the state after the block-index node
instead of the path's is 25-70% off, as a stale one is), and boundaries at the root and at drafts deeper on the path
are among them. vLLM's KV report reserves two GDN pages per request. The flow and the checks are
`test_prefix_caching`'s (`_two_turns`, `_assert_boundary_states_are_the_models`).
"""

from __future__ import annotations

import pytest

from tests.e2e.test_prefix_caching import _assert_boundary_states_are_the_models, _two_turns
from vllm_treewy.fixture import blurred_mtp_variant
from vllm_treewy.vllm_plugin.gdn import prefix_caching

pytestmark = pytest.mark.e2e

# prompts ending 1 to 6 tokens before the second block boundary, 270 greedy tokens each: decoding crosses it and
# the next (a second turn resumes at a decoded boundary only where the block after it matches too: vLLM drops the
# last matching block under MTP)
NUM_PROMPTS, FIRST_TOKENS = 6, 270
PROMPT_STARTS = tuple(11 * i for i in range(NUM_PROMPTS))
# the fp64 model's forward over each boundary's tokens is the slow part: these many boundaries, the root's and the
# deepest nodes' first
CHECKED_BOUNDARIES = 8
TREE = {"method": "mtp", "num_speculative_tokens": 3, "mamba_state_commit": "reconstruct",
        "draft_tree_widths": [2, 2, 1]}


@pytest.fixture(scope="module")
def tree_turns(fixture_model, tmp_path_factory):
    model = str(blurred_mtp_variant(fixture_model, tmp_path_factory.mktemp("blurred-mtp")))
    return _two_turns(model, TREE, PROMPT_STARTS, FIRST_TOKENS)


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
    model's state and conv window after the same tokens. Among them boundaries at the root and at nodes whose block
    index is not their depth (a path off the first branch, or past a first-level sibling)."""
    captured = tree_turns["captured"]
    assert {node == 0 for _, _, node, _, _ in captured} == {True, False}
    tree_nodes = [(node, commit) for _, _, node, commit, _ in captured if node > 0]
    # [2, 2, 1]'s node order: depth 1 = nodes 1, 2; depth 2 = 3..6; depth 3 = 7..10: only node 1 is its own depth
    assert any(node > 1 for node, _ in tree_nodes), captured and [c[1:4] for c in captured]
    at_root = [c for c in captured if c[2] == 0]
    checked = sorted((c for c in captured if c[2] > 0), key=lambda c: -c[2])[: CHECKED_BOUNDARIES - 2] + at_root[:2]
    _assert_boundary_states_are_the_models(tree_turns, checked)


def test_no_state_is_kept_on_vllms_objects(tree_turns):
    assert tree_turns["added"] == []


def test_two_gdn_pages_per_request(tree_turns):
    assert set(tree_turns["report"].gdn_blocks_per_request) == {2}
