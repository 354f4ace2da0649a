"""Reconstruct-on-commit in vLLM's V1 runner on CPU, against the no-speculation engine and against store_all."""

import pytest
from transformers import AutoConfig

from tests.e2e.conftest import SPEC_KS
from vllm_treewy.vllm_plugin.gdn.pseudo_value_buffer import BufferLayout

pytestmark = pytest.mark.e2e


@pytest.mark.parametrize("k", SPEC_KS)
def test_reconstruct_is_equivalent_to_no_speculation(e2e, k):
    name = f"reconstruct-k{k}"
    verdict = e2e.verdict(name)
    assert verdict.passed, verdict.summary()
    assert verdict.num_prompts >= 32
    assert e2e.run(name).acceptance.num_accepted_tokens > 0
    assert e2e.mixed_batches[name]["mixed_batches"] > 0, "no batch mixed prefills with speculative decodes"


@pytest.mark.parametrize("k", SPEC_KS)
def test_reconstruct_acceptance_matches_store_all(e2e, k):
    """Same drafts, same verification: per-position acceptance is equal unless a bf16 tie split the outputs."""
    reconstruct, store_all = e2e.run(f"reconstruct-k{k}"), e2e.run(f"store_all-k{k}")
    differing = [i for i, (a, b) in enumerate(zip(reconstruct.outputs, store_all.outputs)) if a != b]
    if not differing:
        assert reconstruct.acceptance.accepted_per_position == store_all.acceptance.accepted_per_position
        assert reconstruct.acceptance.num_drafts == store_all.acceptance.num_drafts
        return
    # Outputs split: every split prompt must sit at an excused divergence (a bf16 tie of the reference, or where
    # the exact model sides with the speculative run) in one of the two runs.
    excused = {d.prompt_index for name in (f"reconstruct-k{k}", f"store_all-k{k}") for d in e2e.verdict(name).excused}
    assert set(differing) <= excused, f"prompts {differing} split beyond a bf16 tie"


def test_slot_of_a_finished_request_is_reused_at_once(e2e):
    """Requests finish right after a speculative step and a new prefill takes the slot in the next step; the
    reconstruct runs above pass with that happening (a commit must never outlive its request's slot)."""
    for k in SPEC_KS:
        assert e2e.mixed_batches[f"reconstruct-k{k}"]["slot_reused_next_step"] > 0


def test_reconstruct_survives_preemption(e2e):
    run = e2e.run("reconstruct-preempted")
    assert run.num_preemptions > 0, "the workload did not preempt any request"
    assert e2e.verdict("reconstruct-preempted").passed, e2e.verdict("reconstruct-preempted").summary()


@pytest.mark.parametrize("k", SPEC_KS)
def test_gdn_state_blocks_per_request(e2e, fixture_model, k):
    """vLLM's own KV-cache config: one GDN state block per request with reconstruct, 1 + k with store_all; the
    reconstruct block also holds the pseudo-value buffer, and vLLM counts it."""
    reconstruct, store_all = e2e.run(f"reconstruct-k{k}").kv_cache, e2e.run(f"store_all-k{k}").kv_cache
    assert set(reconstruct.gdn_blocks_per_request) == {1}
    assert set(store_all.gdn_blocks_per_request) == {1 + k}
    config = AutoConfig.from_pretrained(fixture_model)
    config = getattr(config, "text_config", config)
    layout = BufferLayout.of_model(1, config.linear_num_key_heads, config.linear_num_value_heads,
                                   config.linear_key_head_dim, config.linear_value_head_dim, k)
    num_gdn_layers = config.layer_types.count("linear_attention")
    buffer_bytes_per_layer = layout.num_nodes * (layout.factor_width * 4 + layout.conv_dim * 2) + 4  # fp32, bf16, count
    assert reconstruct.gdn_buffer_bytes_per_request == num_gdn_layers * buffer_bytes_per_layer
    assert store_all.gdn_buffer_bytes_per_request == 0
    assert reconstruct.gdn_state_bytes_per_request < store_all.gdn_state_bytes_per_request
    assert reconstruct.max_concurrency > store_all.max_concurrency


def test_commit_does_not_read_what_verify_was_handed(e2e):
    """The GPU's CUDA graphs reuse the GDN op's input memory before the next step's commit runs (issue 9: 0/256
    identical outputs when the commit read it); overwriting those inputs right after each step must change nothing."""
    name = "reconstruct-inputs-overwritten"
    assert e2e.mixed_batches[name]["overwritten"] > 0
    assert e2e.verdict(name).passed, e2e.verdict(name).summary()
    assert e2e.run(name).outputs == e2e.run("reconstruct-k3").outputs


def test_no_state_is_kept_on_vllms_objects(e2e):
    """State that crosses vLLM's calls lives in vLLM's buffers or in the adapter's own objects (the GDN layers'
    `step_buffers` and `sampling_tables`), never in attributes added to vLLM's runner, metadata builders or
    scheduler: each engine of the suite is checked right after its generation (`GenerationRun.added_attributes`)."""
    assert {name: run.added_attributes for name, run in e2e.runs.items() if run.added_attributes} == {}


def test_the_added_attributes_check_finds_an_attribute_on_a_builder():
    """`attributes_added_to_vllm`'s worker half looks at the runner and every metadata builder, the drafter's too."""
    from types import SimpleNamespace

    from vllm_treewy.vllm_plugin.testing.equivalence import _runner_attributes_added

    builders = [SimpleNamespace(), SimpleNamespace(treewy_spec_slots=None)]
    drafter = SimpleNamespace(draft_attn_groups=[SimpleNamespace(metadata_builders=[SimpleNamespace(treewy_x=1)])])
    runner = SimpleNamespace(attn_groups=[[], [SimpleNamespace(metadata_builders=builders)]], drafter=drafter,
                             treewy_count_table=None)
    assert _runner_attributes_added(SimpleNamespace(model_runner=runner)) == [
        "runner.treewy_count_table", "builder[1][0][1].treewy_spec_slots", "drafter builder[0][0].treewy_x"]
