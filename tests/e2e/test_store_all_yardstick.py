"""vLLM's own store_all MTP path against the no-speculation engine: the yardstick for reconstruct.

Also proves the yardstick can fail: state-commit bugs planted into store_all must be rejected.
"""

import pytest

from tests.e2e.conftest import PLANTED_BUGS, SPEC_KS

pytestmark = pytest.mark.e2e


@pytest.mark.parametrize("k", SPEC_KS)
def test_store_all_is_equivalent_to_no_speculation(e2e, k):
    name = f"store_all-k{k}"
    assert e2e.verdict(name).passed, e2e.verdict(name).summary()
    assert e2e.run(name).acceptance.num_accepted_tokens > 0
    assert e2e.mixed_batches[name]["mixed_batches"] > 0, "no batch mixed prefills with speculative decodes"


def test_fixture_mtp_acceptance_at_k3(e2e):
    acceptance = e2e.run("store_all-k3").acceptance
    assert acceptance.acceptance_rate >= 0.30, acceptance
    assert len(acceptance.accepted_per_position) == 3


@pytest.mark.parametrize("bug", PLANTED_BUGS)
def test_planted_state_commit_bug_is_rejected(e2e, bug):
    verdict = e2e.verdict(bug)
    assert not verdict.passed, verdict.summary()
    # The fixture makes GDN state matter: most prompts see the bug, not a lucky few.
    assert len(verdict.failures) >= verdict.num_prompts // 2, verdict.summary()


@pytest.mark.parametrize("name", ("reconstruct-k3", "store_all-k3"))
def test_teacher_forced_check_passes_sound_runs(e2e, name):
    """The bench's one-engine check (each greedy token against the prefill logits of its own prefix)."""
    verdict = e2e.teacher_forced[name]
    assert verdict.passed, verdict.summary()


@pytest.mark.parametrize("bug", PLANTED_BUGS)
def test_teacher_forced_check_rejects_planted_bugs(e2e, bug):
    verdict = e2e.teacher_forced[bug]
    assert len(verdict.failures) >= verdict.num_prompts // 2, verdict.summary()
