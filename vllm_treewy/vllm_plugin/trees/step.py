"""One step's draft-tree rows: which requests of the batch verify a whole tree, where their tokens sit, and the RoPE
positions of those tokens.

A tree row is a request whose scheduled drafts this step number N, the static tree's node count (vLLM's per-step
draft counts, never the query lengths: a prefill chunk may also have 1 + N tokens). Its 1 + N tokens are the
verified block (root, then the nodes in node order). vLLM gives token i of the block the position
num_computed + i, from which it derives the KV slot (distinct per node, as tree attention and the compaction
expect); the model must see num_computed + depth instead (root depth 0), so `override_positions` rewrites the
positions tensor after vLLM computed the slot mapping.

A `TreeStep` lives for one step (it rides on that step's metadata objects); full-attention layers record their
caches in it during the forward, for the accepted path's KV compaction after acceptance.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field

import numpy as np
import torch

from vllm_treewy.tree import DraftTree
from vllm_treewy.vllm_plugin.trees.attention_cpu import verified_block_ancestors


@dataclass
class AttentionLayerCaches:
    """What the compaction needs of one full-attention layer, recorded during its forward."""

    key_cache: torch.Tensor
    value_cache: torch.Tensor
    block_table: torch.Tensor  # [R, max_blocks] the tree rows' rows of the layer's block table
    isa: str


@dataclass
class PagedLayerCaches:
    """What the compaction needs of one TRITON_ATTN layer, recorded when the step's metadata is built (a FULL CUDA
    graph replays the forward without running Python)."""

    kv_cache: torch.Tensor  # vLLM's logical [num_blocks, num_kv_heads, block_size, 2 * head_size]
    block_table: torch.Tensor  # [R, max_blocks] the tree rows' rows of the layer's block table


@dataclass
class TreeStep:
    tree: DraftTree
    request_indices: torch.Tensor  # [R] int64 batch rows that verify a whole tree, ascending
    token_indices: torch.Tensor  # [R * (1 + N)] int64 the step's token index of every verified-block token
    query_start_loc: torch.Tensor  # [R + 1] int32 the tree rows' blocks back to back: 0, 1 + N, ...
    root_positions: torch.Tensor  # [R] int64 committed length before each root (= the root's position)
    parents: torch.Tensor  # [R * N] int32 the tree rows' local draft parents (-1: child of the root), packed
    cu_nodes: torch.Tensor  # [R + 1] int32 the tree rows' draft nodes back to back: 0, N, ...
    position_shifts: torch.Tensor  # [R * (1 + N)] int64 block index - depth of every verified-block token
    attention_layers: list[AttentionLayerCaches | PagedLayerCaches] = field(default_factory=list)
    # Every other request of the batch has a one-token query (no prefill chunk of more): vLLM's TRITON_ATTN launch
    # can take the tree as its qq_bias for the whole batch (`trees.attention_triton`).
    covers_batch: bool = False
    qq_bias: torch.Tensor | None = None  # TRITON_ATTN: the tree's `tree_qq_bias`, set with the step's metadata

    @functools.cached_property
    def block_ancestors(self) -> torch.Tensor:
        """`[R * (1 + N), depth + 1]` int32 (`verified_block_ancestors`): the CPU tree attention's mask, built at its
        first use (the TRITON_ATTN tree bias does not need it)."""
        return verified_block_ancestors(self.parents, self.cu_nodes, self.tree.max_depth)

    @property
    def num_requests(self) -> int:
        return self.request_indices.numel()

    @property
    def block_len(self) -> int:
        return 1 + self.tree.num_nodes

    @property
    def depth(self) -> int:
        return self.tree.max_depth


def block_depths(tree: DraftTree) -> np.ndarray:
    """`[1 + N]` depth of each verified-block token (root 0, node j: its depth in the draft tree)."""
    return np.asarray((0, *tree.depth), dtype=np.int64)


def find_tree_step(tree: DraftTree, num_decode_draft_tokens: np.ndarray, num_draft_tokens: np.ndarray,
                   query_start_loc: np.ndarray, num_computed_tokens: np.ndarray,
                   device: torch.device, chain_depth: int = 0) -> TreeStep | None:
    """The step's tree rows from vLLM's per-request counts (numpy, `[num_reqs]`): `num_decode_draft_tokens` (N for a
    decode that verifies N drafts, -1 for a prefill chunk), `num_draft_tokens` (scheduled drafts),
    `query_start_loc [num_reqs + 1]`, `num_computed_tokens`. None when no request verifies a tree. `chain_depth`:
    with `draft_tree_max_batch_size`, the depth D of the chains that steps without tree rows verify (vLLM's own
    chain path); 0 without. A step that holds part of a tree, or tree rows beside chain rows, raises
    (`trees.budget` keeps both out)."""
    num_nodes = tree.num_nodes
    chain_rows = (num_draft_tokens > 0) & (num_draft_tokens <= chain_depth)
    partial = (num_draft_tokens > 0) & (num_draft_tokens != num_nodes) & ~chain_rows
    if partial.any():
        # The tree shape is static: a verify of part of it would follow a different tree than the drafts'.
        raise RuntimeError(f"requests {np.flatnonzero(partial).tolist()} were scheduled "
                           f"{num_draft_tokens[partial].tolist()} drafts of a {num_nodes}-node draft tree")
    if chain_rows.any() and (num_draft_tokens == num_nodes).any():
        raise RuntimeError(f"requests {np.flatnonzero(chain_rows).tolist()} were scheduled chains of "
                           f"{num_draft_tokens[chain_rows].tolist()} drafts beside {num_nodes}-node draft trees")
    rows = np.flatnonzero(num_decode_draft_tokens == num_nodes)
    if rows.size == 0:
        return None
    block_len = 1 + num_nodes
    token_indices = (query_start_loc[rows][:, None] + np.arange(block_len)).reshape(-1)
    position_shifts = np.tile(np.arange(block_len) - block_depths(tree), rows.size)
    # The step's host values in one copy that does not wait for the device (a blocking copy per tensor would make
    # the host wait for the previous step's GPU work each time; so may a copy from pageable memory: pinned on CUDA).
    host = torch.from_numpy(np.concatenate(
        [rows, token_indices, num_computed_tokens[rows], position_shifts, tree.parents * rows.size]).astype(np.int64))
    if torch.device(device).type == "cuda":
        host = host.pin_memory()
    request_indices, token_indices, root_positions, position_shifts, parents = host.to(device, non_blocking=True).split(
        [rows.size, token_indices.size, rows.size, position_shifts.size, num_nodes * rows.size])
    parents = parents.to(torch.int32)
    cu_nodes = torch.arange(rows.size + 1, dtype=torch.int32, device=device) * num_nodes
    return TreeStep(
        tree=tree,
        request_indices=request_indices,
        token_indices=token_indices,
        query_start_loc=torch.arange(rows.size + 1, dtype=torch.int32, device=device) * block_len,
        root_positions=root_positions,
        parents=parents,
        cu_nodes=cu_nodes,
        position_shifts=position_shifts,
    )


def override_positions(positions: torch.Tensor, step: TreeStep) -> None:
    """Tree tokens' positions `num_computed + block index` (vLLM's, already used for the slot mapping) become
    `num_computed + depth`, in place."""
    positions[step.token_indices] -= step.position_shifts.to(positions.dtype)


@dataclass(frozen=True)
class TreeConstants:
    """One tree's static per-request tensors on a device, built once (host-to-device copies would wait for the
    device's queued work every step), and its uniform steps' batch-size-only tensors, built once per batch size."""

    parents: torch.Tensor  # [N] int32 local parents
    depths: torch.Tensor  # [1 + N] int64 depth of each verified-block token (root 0)
    parent_blocks: torch.Tensor  # [N] int64 verified-block index of each node's parent (root 0)
    uniform_steps: dict = field(default_factory=dict, compare=False, repr=False)  # R -> TreeStep (no roots)

    @classmethod
    def of(cls, tree: DraftTree, device) -> TreeConstants:
        return cls(torch.tensor(tree.parents, dtype=torch.int32, device=device),
                   torch.as_tensor(block_depths(tree), device=device),
                   torch.tensor(tree.parents, dtype=torch.int64, device=device) + 1)


def uniform_tree_step(tree: DraftTree, root_positions: torch.Tensor, constants: TreeConstants) -> TreeStep:
    """A step in which every request of the batch is a tree row, its verified block at query rows
    `r * (1 + N) ..` (`root_positions [R]` int64 on the device: each root's position). The MTP drafting levels run
    such steps (`v1.proposer`). Everything but the roots depends on R and the tree only: built at a batch
    size's first step, then shared (a new `TreeStep` per call, so each records its own layers)."""
    num_requests = root_positions.numel()
    template = constants.uniform_steps.get(num_requests)
    if template is None:
        template = constants.uniform_steps[num_requests] = _uniform_template(tree, num_requests, constants)
    return dataclasses.replace(template, root_positions=root_positions.long(), attention_layers=[])


def _uniform_template(tree: DraftTree, num_requests: int, constants: TreeConstants) -> TreeStep:
    device = constants.parents.device
    block_len = 1 + tree.num_nodes
    return TreeStep(
        tree=tree,
        request_indices=torch.arange(num_requests, device=device),
        token_indices=torch.arange(num_requests * block_len, device=device),
        query_start_loc=torch.arange(num_requests + 1, dtype=torch.int32, device=device) * block_len,
        root_positions=torch.zeros(num_requests, dtype=torch.long, device=device),
        parents=constants.parents.repeat(num_requests),
        cu_nodes=torch.arange(num_requests + 1, dtype=torch.int32, device=device) * tree.num_nodes,
        position_shifts=(torch.arange(block_len, device=device) - constants.depths).repeat(num_requests),
        covers_batch=True,
    )
