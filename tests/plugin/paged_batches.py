"""Batches in a TRITON_ATTN layer cache and their fp64 reference attention, for the tree attention tests (on CPU
under the Triton interpreter, and on CUDA in `tests/gpu`). Plain torch: no hypothesis, no vLLM."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tests.plugin.attention_reference import masked_attention_fp64
from vllm_treewy.tree import DraftTree
from vllm_treewy.vllm_plugin.trees.attention_triton import split_kv_cache


def empty_cache(num_blocks, num_kv_heads, block_size, width, dtype, layout, fill=float("nan")) -> torch.Tensor:
    """A layer cache in vLLM's logical order `[num_blocks, num_kv_heads, block_size, width]`, stored in `layout`."""
    if layout == "HND":
        return torch.full((num_blocks, num_kv_heads, block_size, width), fill, dtype=dtype)
    return torch.full((num_blocks, block_size, num_kv_heads, width), fill, dtype=dtype).transpose(1, 2)


def scattered_block_table(num_requests, seq_lens, block_size, generator) -> tuple[torch.Tensor, int]:
    """Requests own shuffled, scattered blocks; one spare column (vLLM's table rows are wider than a request)."""
    blocks_needed = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(blocks_needed) + 3
    order = torch.randperm(num_blocks, generator=generator)
    table = torch.zeros(num_requests, max(blocks_needed) + 1, dtype=torch.int32)
    used = 0
    for r, count in enumerate(blocks_needed):
        table[r, :count] = order[used : used + count]
        used += count
    return table, num_blocks


@dataclass
class PagedBatch:
    """One step's batch in a TRITON_ATTN layer cache: requests of kind "tree" (the verified block of `tree`),
    "decode" (one token) or "prefill" (a chunk of `query_len` tokens), with dense copies for the reference."""

    tree: DraftTree
    kinds: list[str]
    context_lens: list[int]
    query_lens: list[int]
    query: torch.Tensor  # [T, Hq, hd]
    keys: list[torch.Tensor]  # per request [seq_len, Hkv, hd], as stored
    values: list[torch.Tensor]
    kv_cache: torch.Tensor  # logical [num_blocks, Hkv, block_size, 2 * hd]
    block_table: torch.Tensor  # [R, max_blocks] int32

    @property
    def head_size(self) -> int:
        return self.query.shape[-1]

    @property
    def seq_lens(self) -> torch.Tensor:
        return torch.tensor([c + q for c, q in zip(self.context_lens, self.query_lens)], dtype=torch.int32)

    @property
    def query_start_loc(self) -> torch.Tensor:
        return torch.tensor([0, *self.query_lens], dtype=torch.int32).cumsum(0, dtype=torch.int32)

    @property
    def tree_requests(self) -> torch.Tensor:
        return torch.tensor([r for r, kind in enumerate(self.kinds) if kind == "tree"], dtype=torch.long)

    @property
    def tree_token_indices(self) -> torch.Tensor:
        starts = self.query_start_loc.long()[self.tree_requests]
        return (starts[:, None] + torch.arange(1 + self.tree.num_nodes)).flatten()


def make_batch(tree, kinds, context_lens, prefill_lens, *, num_heads, num_kv_heads, head_size, block_size, dtype,
               layout, seed=0) -> PagedBatch:
    generator = torch.Generator().manual_seed(seed)
    block_len = 1 + tree.num_nodes
    query_lens = [block_len if kind == "tree" else 1 if kind == "decode" else prefill_lens[r]
                  for r, kind in enumerate(kinds)]
    seq_lens = [c + q for c, q in zip(context_lens, query_lens)]
    table, num_blocks = scattered_block_table(len(kinds), seq_lens, block_size, generator)
    kv_cache = empty_cache(num_blocks, num_kv_heads, block_size, 2 * head_size, dtype, layout)
    key_cache, value_cache = split_kv_cache(kv_cache, head_size)

    def normal(*shape):
        return torch.randn(shape, generator=generator).to(dtype)

    keys = [normal(s, num_kv_heads, head_size) for s in seq_lens]
    values = [normal(s, num_kv_heads, head_size) for s in seq_lens]
    for r, s in enumerate(seq_lens):
        positions = torch.arange(s)
        blocks = table[r].long()[positions // block_size]
        key_cache[blocks, positions % block_size] = keys[r]
        value_cache[blocks, positions % block_size] = values[r]
    return PagedBatch(tree, list(kinds), list(context_lens), query_lens, normal(sum(query_lens), num_heads, head_size),
                      keys, values, kv_cache, table)


def reference_attention(batch: PagedBatch, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """fp64, request by request, with an explicit boolean mask over the request's positions (`sinks`: per head)."""
    block = batch.tree.with_root()
    ancestor_or_self = block.ancestor_mask() | torch.eye(block.num_nodes, dtype=torch.bool)
    rows, start = [], 0
    for r, kind in enumerate(batch.kinds):
        context, query_len = batch.context_lens[r], batch.query_lens[r]
        committed = torch.ones(query_len, context, dtype=torch.bool)
        if kind == "tree":
            inside = ancestor_or_self
        else:  # causal (a one-token decode sees itself)
            inside = torch.ones(query_len, query_len, dtype=torch.bool).tril()
        mask = torch.cat([committed, inside], dim=1)
        rows.append(masked_attention_fp64(batch.query[start : start + query_len], batch.keys[r], batch.values[r],
                                          mask, sinks))
        start += query_len
    return torch.cat(rows)
