"""Tree attention on vLLM's FLASH_ATTN backend (FlashAttention 3 on Hopper, FlashAttention 2 elsewhere): two passes
merged by log-sum-exp, in two launches per attention layer.

Every tree row of a step verifies the static tree: its verified block (root, then the N nodes in node order) sits at
KV positions committed_len + block index (`trees.step`); a block token sees every committed position and, among the
block, its ancestors and itself. FlashAttention has no per-token mask for that, so the tree rows' output is the merge
of two attentions over disjoint key sets:

1. the prefix pass: every query token over its request's committed prefix (`seqused_k` = seq_len - query_len, the
   `prefix_lengths`, computed once per step where the step's metadata gets the tree: `trees.attention`),
   non-causal, with vLLM's own paged kernel (`flash_attn_varlen_func(..., causal=False, return_softmax_lse=True)`,
   the call vLLM's decode-context-parallel path makes for its context pass; the AOT scheduler metadata is for the
   causal launch's lengths and is not passed); it returns the output `[T, H, D]` and log-sum-exp `[H, T]`;
2. the ancestor pass with the merge folded in (`kernels.tree_attention_ancestors_triton`; its torch twin on CPU):
   every query token over its ancestors and itself among the step's new K/V rows (the forward's `key` / `value`),
   its online softmax started from the prefix pass's output and log-sum-exp (softmax over the union of the two key
   sets is the two partial softmaxes weighted by their shares of the union's normaliser, e^{lse} each), the merged
   rows written straight into the forward's `output`.

A request with no committed key (a graph's padding requests) has an empty prefix: FlashAttention 3 writes +inf as
its log-sum-exp, which the ancestor pass reads as "no keys" (its output row is never read). Tokens at or past
`query_start_loc[-1]` (a graph's padding tokens) keep the output they held.

Two shapes of call (`trees.attention`): a batch whose requests are all tree rows or one-token decodes ("covering"
steps, every uniform decode batch of a CUDA-graph capture, the MTP drafter's levels) runs the two passes over the
whole batch instead of vLLM's causal launch (`tree_batch_attention`: per-token topology from the metadata's
`query_start_loc`, static shapes, no host sync, so a FULL CUDA graph captures it; a one-token query's ancestor pass
is itself alone, which is its causal attention); a batch with prefills runs vLLM's causal launch, then the two passes
over the tree rows alone overwrite their output (`tree_rows_attention`, eager: PIECEWISE graphs run attention
outside the graph).

The KV cache of a FLASH_ATTN layer in vLLM 0.32 is TRITON_ATTN's: logical `[num_blocks, num_kv_heads, block_size,
2 * head_size]`, attended as `kv_cache.transpose(1, 2).split(head_size, -1)` (`attention_triton.split_kv_cache`),
so the accepted path's compaction is `kernels.paged_kv_compaction_*` for both backends.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from vllm_treewy.kernels.tree_attention_ancestors_torch import tree_attention_ancestors_torch
from vllm_treewy.kernels.tree_attention_ancestors_triton import tree_attention_ancestors_triton
from vllm_treewy.tree import DraftTree
from vllm_treewy.vllm_plugin.trees.attention_cpu import verified_block_ancestors


def tree_block_ancestors(tree: DraftTree, device) -> torch.Tensor:
    """`[1 + N, max_depth + 1]` int32: row i the block indices of block token i's ancestors and itself (column 0:
    i; the root is 0), -1 padding. Built once per tree shape and device; a FULL CUDA graph keeps its address."""
    parents = torch.tensor(tree.parents, dtype=torch.int32)
    cu_nodes = torch.tensor([0, tree.num_nodes], dtype=torch.int32)
    return verified_block_ancestors(parents, cu_nodes, tree.max_depth).to(device)


def prefix_lengths(seq_lens: torch.Tensor, query_start_loc: torch.Tensor, out: torch.Tensor | None = None
                   ) -> torch.Tensor:
    """`[R]` int32: each request's committed prefix, seq_len - query_len, clamped at 0 (a graph's padding requests:
    seq_len 0 and an empty query). `seq_lens [R]` int32 and `query_start_loc [R + 1]` int32: vLLM's metadata rows.
    Into `out` (`[R]` int32) when given: a persistent buffer keeps the address a FULL CUDA graph reads (the hand-over
    computes it once per step for all of a metadata object's layers, `TreeRunState.prefix_lens`). Device ops, no host
    sync."""
    query_lens = query_start_loc[1:] - query_start_loc[:-1]
    if out is None:
        return torch.sub(seq_lens, query_lens).clamp_(min=0).to(torch.int32)
    return torch.sub(seq_lens, query_lens, out=out).clamp_(min=0)


def tree_batch_attention(
    prefix_attention: Callable,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    output: torch.Tensor,
    *,
    query_start_loc: torch.Tensor,
    prefix_lens: torch.Tensor,
    block_table: torch.Tensor,
    max_query_len: int,
    max_seq_len: int,
    block_ancestors: torch.Tensor,
    scale: float,
    prefix_kwargs: dict,
) -> torch.Tensor:
    """The two passes over a batch of requests' queries back to back (every request a tree row or a one-token
    decode: a covering step's whole batch, or a mixed step's gathered tree rows), the merged attention written into
    `output` (`[T, H, D]` or `[T, H * D]`, unit stride in its last axis, its own dtype) for tokens before
    `query_start_loc[-1]`; later rows (graph padding) keep what they held. Returns `output`.

    `query [T, H, D]`, `key`/`value [T, H_kv, D]`: the batch's queries and new K/V rows (already in the cache at
    positions seq_len - query_len + i); `query_start_loc [R + 1]`, `block_table [R, max_blocks]`: vLLM's metadata
    rows of those requests, `prefix_lens [R]` int32 their committed lengths (`prefix_lengths`);
    `max_query_len`/`max_seq_len`: Python-int bounds. A request whose query holds 1 + N tokens is a verified block of
    the tree `block_ancestors` (`tree_block_ancestors`); any other request must have a one-token query (or none).
    `prefix_attention`: FlashAttention's `flash_attn_varlen_func` contract (keywords; returns `(out [T, H, D],
    lse [H, T])`), called with `prefix_kwargs` added (version, descales, splits). Two launches (FlashAttention's,
    the ancestor pass's); the prefix pass's output and log-sum-exp are its only allocations. Static shapes, no host
    sync: capturable."""
    prefix_out, prefix_lse = prefix_attention(
        q=query, k=key_cache, v=value_cache, max_seqlen_q=max_query_len, cu_seqlens_q=query_start_loc,
        max_seqlen_k=max_seq_len, seqused_k=prefix_lens, softmax_scale=scale, causal=False, block_table=block_table,
        return_softmax_lse=True, **prefix_kwargs)
    ancestors_pass = tree_attention_ancestors_triton if query.is_cuda else tree_attention_ancestors_torch
    return ancestors_pass(query, key, value, query_start_loc, block_ancestors, prefix_out, prefix_lse, output, scale)


def tree_rows_attention(prefix_attention: Callable, query, key, value, key_cache, value_cache,
                        output: torch.Tensor, *, token_indices: torch.Tensor, request_indices: torch.Tensor,
                        tree_query_start_loc: torch.Tensor, prefix_lens: torch.Tensor, block_table, block_len: int,
                        max_seq_len: int, block_ancestors, scale: float, prefix_kwargs: dict) -> torch.Tensor:
    """Overwrites the tree rows' output (after vLLM's causal launch over a batch with prefills) with the two passes
    over the R tree rows alone: `token_indices [R * block_len]`, `request_indices [R]`, `tree_query_start_loc
    [R + 1]` as `TreeStep` holds them; `prefix_lens [R]` int32 the tree rows' committed lengths; `block_table`: the
    whole batch's. The passes run over the gathered rows into a temporary, then copied into the rows of `output`.
    Shapes follow the host-known R: eager only (mixed batches run attention outside CUDA graphs)."""
    num_tokens = token_indices.shape[0]
    merged = torch.empty(num_tokens, *query.shape[1:], dtype=output.dtype, device=output.device)
    tree_batch_attention(
        prefix_attention, query.index_select(0, token_indices), key.index_select(0, token_indices),
        value.index_select(0, token_indices), key_cache, value_cache, merged, query_start_loc=tree_query_start_loc,
        prefix_lens=prefix_lens, block_table=block_table.index_select(0, request_indices.long()),
        max_query_len=block_len, max_seq_len=max_seq_len, block_ancestors=block_ancestors, scale=scale,
        prefix_kwargs=prefix_kwargs)
    output.view(query.shape[0], -1).index_copy_(0, token_indices, merged.view(num_tokens, -1))
    return output
