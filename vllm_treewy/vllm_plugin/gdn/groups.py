"""The runner's GDN groups: the KV-cache groups of GDN layers (vLLM's `MambaSpec` groups), and the count state that
the first layer of each keeps (`gdn.step_metadata.counts_layer`). Both runners (V1 and Model Runner V2) read them
through the same fields: `compilation_config.static_forward_context` and `kv_cache_config.kv_cache_groups`.
"""

from __future__ import annotations

import torch
from vllm.v1.kv_cache_interface import MambaSpec

from vllm_treewy.kernels.triton import slot_counts
from vllm_treewy.vllm_plugin.gdn import sampling_tables


def counted_gdn_groups(runner):
    """(group id, count state) per KV-cache group of GDN layers that keep slot counts (reconstruct, store_all draft
    trees): the count lives in the group's first layer, the one its GDN metadata builder reads
    (`gdn.step_metadata.counts_layer`)."""
    layers = runner.compilation_config.static_forward_context
    for group_id, group in enumerate(runner.kv_cache_config.kv_cache_groups):
        if not isinstance(group.kv_cache_spec, MambaSpec):
            continue
        layer = layers[group.layer_names[0]]
        counts = layer.verified_node_counts() if getattr(layer, "keeps_slot_counts", False) else None
        if counts is not None:
            yield group_id, counts


def count_table_of(runner, groups) -> torch.Tensor:
    """The groups' `count_table`, one of the runner's `SamplingTables` (V1 or V2 runner): built again only where a
    count state or block table moved."""
    addresses = tuple((counts.data_ptr(), block_table.data_ptr()) for counts, block_table in groups)
    return sampling_tables.of_runner(runner).get("count", addresses, lambda: slot_counts.count_table(groups))
