"""bench/host/metadata_subclass.py times ways that all make the same metadata: vLLM's fields (the same objects) and
the adapter's at their defaults."""

import dataclasses

import torch
from vllm.v1.attention.backends.gdn_attn import GDNAttentionMetadata

from bench.host.metadata_subclass import main, ways
from vllm_treewy.vllm_plugin.gdn.step_metadata import ReconstructGDNAttentionMetadata, reconstruct_metadata


def test_every_way_makes_the_same_metadata():
    rows = torch.zeros(4, dtype=torch.int32)
    metadata = GDNAttentionMetadata(num_prefills=0, num_prefill_tokens=0, num_decodes=0, num_decode_tokens=0,
                                    num_spec_decodes=4, num_spec_decode_tokens=8, num_actual_tokens=8,
                                    spec_query_start_loc=rows, num_accepted_tokens=rows)
    ours = reconstruct_metadata(metadata)
    for name, make in ways(metadata, ours).items():
        made = make()
        assert type(made) is ReconstructGDNAttentionMetadata, name
        for field in dataclasses.fields(ReconstructGDNAttentionMetadata):
            assert getattr(made, field.name) is getattr(metadata, field.name, field.default), (name, field.name)


def test_the_script_runs():
    assert main(["--calls", "10", "--rounds", "1"]) == 0
