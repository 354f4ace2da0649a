"""vLLM's own store_all MTP path against the no-speculation engine: the yardstick for reconstruct.

Also proves the yardstick can fail: state-commit bugs planted into store_all must be rejected.
"""

import pytest

from tests.e2e.planted_bugs import count_mixed_batches, planted_state_commit_bug
from vllm_treewy.vllm_plugin.equivalence import compare_tie_aware, engine, generate_greedy, run_greedy

pytestmark = pytest.mark.e2e

SPEC_KS = (1, 2, 3)
PLANTED_BUGS = ("off_by_one", "no_rollback")
# Few concurrent sequences: prompts queue up and prefill while earlier ones are in speculative decode.
MAX_NUM_SEQS = 6


def _mtp(k: int) -> dict:
    return {"method": "mtp", "num_speculative_tokens": k}


@pytest.fixture(scope="module")
def runs(fixture_model, prompts, max_tokens):
    """All engines of this module, one after another (vLLM engines in one process must not overlap)."""
    results, mixed = {}, {}
    for k in SPEC_KS:
        with count_mixed_batches(mixed.setdefault(k, {})):
            results[k] = run_greedy(fixture_model, prompts, max_tokens, max_num_seqs=MAX_NUM_SEQS, speculative_config=_mtp(k))
    for bug in PLANTED_BUGS:
        with planted_state_commit_bug(bug):
            results[bug] = run_greedy(fixture_model, prompts, max_tokens, max_num_seqs=MAX_NUM_SEQS, speculative_config=_mtp(3))

    verdicts = {}
    with engine(fixture_model, logprobs_mode="raw_logits", max_num_seqs=MAX_NUM_SEQS) as reference:
        reference_outputs = generate_greedy(reference, prompts, max_tokens)
        for name, run in results.items():
            verdicts[name] = compare_tie_aware(reference, prompts, reference_outputs, run.outputs)
    return results, verdicts, mixed


@pytest.mark.parametrize("k", SPEC_KS)
def test_store_all_is_equivalent_to_no_speculation(runs, k):
    results, verdicts, mixed = runs
    assert verdicts[k].passed, verdicts[k].summary()
    assert results[k].acceptance.num_accepted_tokens > 0
    assert mixed[k]["mixed_batches"] > 0, "no batch mixed prefills with speculative decodes"


def test_fixture_mtp_acceptance_at_k3(runs):
    results, _, _ = runs
    acceptance = results[3].acceptance
    assert acceptance.acceptance_rate >= 0.30, acceptance
    assert len(acceptance.accepted_per_position) == 3


@pytest.mark.parametrize("bug", PLANTED_BUGS)
def test_planted_state_commit_bug_is_rejected(runs, bug):
    _, verdicts, _ = runs
    verdict = verdicts[bug]
    assert not verdict.passed, verdict.summary()
    # The fixture makes GDN state matter: most prompts see the bug, not a lucky few.
    assert len(verdict.failures) >= verdict.num_prompts // 2, verdict.summary()
