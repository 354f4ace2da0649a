"""Each speculative request's accepted count, recorded in its GDN slot right after sampling.

The next step's commit needs the node each slot accepted. vLLM's own per-row count (`num_accepted_tokens`) is not
enough: a running request that a step leaves unscheduled (its token budget spent) leaves vLLM's persistent batch,
and vLLM re-adds it with a count of 1 (`GPUModelRunner._update_states`, `InputBatch.add_request`), so a commit
that read it would rebuild the state at the wrong node (`tests/plugin/test_step_metadata.py`). The slot does not
move, so the count state of the pseudo-value buffer (in vLLM's KV cache) keeps it until the request's next step:
1 + the accepted node's index in the verified block (chains: vLLM's accepted count; draft trees: written by the
tree sampler). Device work right after vLLM's own update, no host sync.
"""

from __future__ import annotations

import functools

import torch

from vllm_treewy.vllm_plugin.config import draft_tree_of, reconstructs_mamba_state
from vllm_treewy.vllm_plugin.patch_points import RUNNER_AFTER_SAMPLING


def gdn_slot_counts(runner, rows: torch.Tensor | slice):
    """(count state, state slots of the batch `rows`: an index tensor or a slice) per KV-cache group of reconstruct
    GDN layers: the count lives in the group's first layer, the one its GDN metadata builder reads
    (`step_metadata.verified_node_counts`)."""
    from vllm.v1.kv_cache_interface import MambaSpec

    layers = runner.compilation_config.static_forward_context
    num_reqs = runner.input_batch.num_reqs
    for group_id, group in enumerate(runner.kv_cache_config.kv_cache_groups):
        if not isinstance(group.kv_cache_spec, MambaSpec):
            continue
        # One state block per request under reconstruct (no prefix caching): column 0 is the slot.
        layer = layers[group.layer_names[0]]
        if getattr(layer, "reconstructs_state", False):
            slots = runner.input_batch.block_table[group_id].get_device_tensor(num_reqs)[rows, 0]
            yield layer.verified_node_counts(), slots


def record_chain_accepted_counts(runner, num_reqs: int) -> None:
    """After vLLM counted this step's accepted tokens per row (its `num_reqs` rows): the speculative rows' counts into
    their slots (rows that verified no drafts, e.g. prefills, keep their slot's count). Device tensors only: no host
    sync."""
    speculative = runner.num_decode_draft_tokens.gpu[:num_reqs] >= 0  # this step's rows that verified drafts
    accepted = runner.num_accepted_tokens.gpu[:num_reqs]
    for counts, slots in gdn_slot_counts(runner, slice(0, num_reqs)):
        counts[slots] = torch.where(speculative, accepted.to(counts.dtype), counts[slots])


def _recording_accepted_counts(original):
    @functools.wraps(original)
    def update_states_after_model_execute(self, output_token_ids, scheduler_output):
        original(self, output_token_ids, scheduler_output)
        config = self.speculative_config
        if reconstructs_mamba_state(config) and draft_tree_of(config) is None:
            record_chain_accepted_counts(self, output_token_ids.size(0))

    update_states_after_model_execute.records_accepted_counts = True
    return update_states_after_model_execute


def install() -> None:
    if not getattr(RUNNER_AFTER_SAMPLING.resolve(), "records_accepted_counts", False):
        RUNNER_AFTER_SAMPLING.replace(_recording_accepted_counts(RUNNER_AFTER_SAMPLING.resolve()))
