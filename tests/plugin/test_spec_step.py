"""The per-step quantities the reconstruct GDN layers share: built once for a metadata object, then reused."""

import torch
from vllm.v1.attention.backends.gdn_attn import GDNAttentionMetadata

from vllm_treewy.vllm_plugin.spec_step import spec_step

from .test_gdn_layer_split import _mixed_batch_metadata


def test_one_step_is_derived_once_and_shared():
    metadata = _mixed_batch_metadata()
    step = spec_step(metadata, torch.device("cpu"))
    assert spec_step(metadata, torch.device("cpu")) is step
    assert step.slots.tolist() == [7, 9] and step.cu_nodes.tolist() == [0, 3, 6]
    assert step.parents.tolist() == [-1, 0, 1, -1, 0, 1]
    assert step.batch_rows.tolist() == [1, 3]
    # Where each draft node's factors go in the pseudo-value buffer: its request's slot, its index there.
    assert step.node_slots.tolist() == [7, 7, 7, 9, 9, 9]
    assert step.node_indices.tolist() == [0, 1, 2, 0, 1, 2]
    assert step.parents is step.parents  # computed once
    rest = step.rest_metadata
    assert rest.num_spec_decodes == 0 and rest.spec_sequence_masks is None and rest.num_actual_tokens == 4
    assert rest.non_spec_state_indices_tensor.tolist() == [5, 6]


def test_a_new_step_is_derived_again():
    first = spec_step(_mixed_batch_metadata(), torch.device("cpu"))
    only_spec = GDNAttentionMetadata(
        num_prefills=0, num_prefill_tokens=0, num_decodes=0, num_decode_tokens=0, num_spec_decodes=2,
        num_spec_decode_tokens=4, num_actual_tokens=4, spec_query_start_loc=torch.tensor([0, 2, 4]),
        spec_state_indices_tensor=torch.tensor([[3], [4]]), spec_sequence_masks=torch.tensor([True, True]),
    )
    step = spec_step(only_spec, torch.device("cpu"))
    assert step is not first
    assert step.batch_rows.tolist() == [0, 1] and step.parents.tolist() == [-1, 0, -1, 0]
    assert step.node_slots.tolist() == [3, 3, 4, 4] and step.node_indices.tolist() == [0, 1, 0, 1]
