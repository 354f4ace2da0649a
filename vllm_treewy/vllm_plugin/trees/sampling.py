"""What both runners' tree sampling shares after the draws: the walk's tables, the emitted row of each tree row, the
accepted path's K/V compaction and the accepted leaf into each GDN slot's count state. The V1 runner's sampling is
`v1.sampler` (vLLM's `Sampler`, one call or one per level), Model Runner V2's `v2.sampler` and `v2.acceptance`.
Device ops of shapes the host knows; no host sync.
"""

from __future__ import annotations

import functools

import torch

from vllm_treewy.kernels.bookkeeping import dispatch
from vllm_treewy.kernels.paged_kv_compaction_torch import compact_paged_kv_torch
from vllm_treewy.kernels.paged_kv_compaction_triton import compact_paged_kv_triton
from vllm_treewy.kernels.tree_acceptance_torch import output_rows
from vllm_treewy.spec_decode.acceptance import TreeAcceptance, UniformWalkTables
from vllm_treewy.spec_decode.synthetic_acceptance import NodeRateIndex
from vllm_treewy.vllm_plugin.trees.attention_cpu import compact_accepted_kv
from vllm_treewy.vllm_plugin.trees.step import PagedLayerCaches, TreeStep


def tree_output_rows(step: TreeStep, draft_tokens: torch.Tensor, acceptance: TreeAcceptance) -> torch.Tensor:
    """`[R, depth + 1]` rows `[path tokens..., bonus, -1...]` of the tree rows; `draft_tokens [R * N]` in node
    order."""
    return output_rows(draft_tokens.long().view(step.num_requests, step.tree.num_nodes), acceptance)


# The two tables below are built once per tree shape and device and kept for the process (a cache that never evicts:
# the acceptance's CUDA graphs read them by address, and a graph holds no reference to what it reads).
@functools.cache
def walk_tables(parents: tuple[int, ...], device: torch.device) -> UniformWalkTables:
    """A tree's walk tables on the device (read only)."""
    return UniformWalkTables.of(parents, device)


@functools.cache
def rate_index(parents: tuple[int, ...], device: torch.device) -> NodeRateIndex:
    """A tree's node rate index for synthetic acceptance on the device (read only)."""
    return NodeRateIndex.of(parents, device)


def paged_cache_groups(layers) -> list[tuple[torch.Tensor, list[torch.Tensor]]]:
    """The recorded TRITON_ATTN layers (`PagedLayerCaches`) as `(block_table, [kv_cache, ...])` per block table they
    share, in record order (the layers of one KV-cache group share their tree rows' table: `trees.attention`)."""
    groups: dict[int, tuple[torch.Tensor, list[torch.Tensor]]] = {}
    for layer in layers:
        if isinstance(layer, PagedLayerCaches):
            groups.setdefault(id(layer.block_table), (layer.block_table, []))[1].append(layer.kv_cache)
    return list(groups.values())


def commit_accepted_path(step: TreeStep, acceptance: TreeAcceptance) -> None:
    """Compacts the recorded full-attention layers' K/V along each accepted path: the paged layers (TRITON_ATTN,
    FLASH_ATTN) on CUDA in one `compact_paged_kv_triton` launch per layer, elsewhere in one `compact_paged_kv_torch`
    call per shared block table (the moves computed once for all its layers); the CPU layout per layer."""
    for block_table, kv_caches in paged_cache_groups(step.attention_layers):
        if dispatch.launches_triton(block_table):
            for kv_cache in kv_caches:
                compact_paged_kv_triton(kv_cache, block_table, acceptance.accepted_nodes, step.root_positions)
        else:
            compact_paged_kv_torch(kv_caches, block_table, acceptance.accepted_nodes, step.root_positions)
    for layer in step.attention_layers:
        if not isinstance(layer, PagedLayerCaches):
            compact_accepted_kv(layer.key_cache, layer.value_cache, layer.block_table, acceptance.accepted_nodes,
                                step.root_positions, isa=layer.isa)


def record_accepted_leaves(counts: torch.Tensor, slots: torch.Tensor, acceptance: TreeAcceptance) -> None:
    """A GDN layer's slot counts after acceptance: 1 + the verified-block index of the accepted leaf (1 = the root:
    nothing accepted), still > 0, so the slot's next step commits that node (`gdn.step_metadata`)."""
    counts[slots] = (acceptance.last_accepted_node + 2).to(counts.dtype)
