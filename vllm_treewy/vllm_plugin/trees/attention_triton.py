"""Tree attention and accepted-path KV compaction on vLLM's TRITON_ATTN backend (the CUDA paged KV layout).

Every tree row of a step verifies the same static tree (`draft_tree_widths`): its verified block is the root (the
last accepted token) and the N draft nodes in node order, 1 + N query tokens at KV positions committed_len + block
index (`trees.step`). A block token must see every committed position and, among the block, its ancestors and
itself.

vLLM 0.32's `unified_attention` (`vllm/v1/attention/ops/triton_unified_attention.py`) still takes
`qq_bias`, a [Q, Q] additive bias among the query tokens, left from upstream's removed tree attention. What its
kernel does with it (read there, and checked by `tests/plugin/trees/test_attention_triton.py`, which runs vLLM's
own kernel under the Triton interpreter):

- the bias is one matrix for the whole launch, not one per request: query row `query_pos` of EVERY request (its
  index within the request's query) adds `qq_bias[query_pos, key_pos - context_len]` to its score of key position
  `key_pos`, for the keys inside the request's query (0 <= key_pos - context_len < qq_bias.stride(0)); the
  committed keys get nothing added. With 0 for ancestors-or-self and -inf elsewhere (`tree_qq_bias`), on top of
  vLLM's causal mask (a parent's block index is below its child's, so causal and ancestry agree on the ancestors),
  a tree row gets exactly tree attention;
- a request whose query is one token (a decode without drafts) reads only `qq_bias[0, 0]` = 0: unaffected;
- a prefill chunk would be masked as if it were a tree (and one longer than the bias reads rows past its end):
  a batch with prefills must not get the bias;
- the kernel loads bias rows for the padding rows of a request's last query block too (up to a block of query
  rows past 1 + N, unmasked loads), so the bias carries `QQ_BIAS_PAD_ROWS` zero rows below its 1 + N rows;
- the decode-only 3D (split-softmax) path never runs with a bias: a tree batch has max_query_len = 1 + N > 1.

So (`v1.runner`): a batch whose requests are all tree rows or one-token decodes ("covering" steps, and every
uniform decode batch of a CUDA-graph capture) passes the bias into vLLM's own launch; a batch with prefills runs
vLLM's causal launch, then `tree_rows_attention` recomputes the tree rows alone (one more launch of vLLM's kernel
over a batch of just the tree rows, with the bias) and overwrites their output, as the CPU path does.

The KV cache of a TRITON_ATTN layer is vLLM's logical `[num_blocks, num_kv_heads, block_size, 2 * head_size]`
(keys then values in the last axis; the physical stride order is the KV layout's, e.g. token-major for NHD), and
`TritonAttentionImpl.forward` attends over `kv_cache.transpose(1, 2).split(head_size, -1)`, two
`[num_blocks, block_size, num_kv_heads, head_size]` views (`split_kv_cache`). The compaction
(`kernels.paged_kv_compaction_*`) moves whole token rows of `kv_cache.transpose(1, 2)` (keys and values at once).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from vllm_treewy.tree import DraftTree

# Zero rows below the bias: the kernel reads bias rows for the padding rows of a request's last query block, at
# most BLOCK_M query rows past the block (BLOCK_M = max(16, next power of two of the query heads per KV head);
# 32 for vLLM's tuned large-head path). 64 covers up to 32 query heads per KV head.
QQ_BIAS_PAD_ROWS = 64


def tree_qq_bias(tree: DraftTree, device: torch.device | str | None = None,
                 pad_rows: int = QQ_BIAS_PAD_ROWS) -> torch.Tensor:
    """`[1 + N + pad_rows, 1 + N]` fp32 contiguous: row i of the verified block (root 0, node j at 1 + j) holds 0 at
    its ancestors and itself, -inf elsewhere; the pad rows are 0. Built once per tree shape and device; a FULL CUDA
    graph keeps its address."""
    block = tree.with_root()
    visible = block.ancestor_mask() | torch.eye(block.num_nodes, dtype=torch.bool)
    bias = torch.zeros(block.num_nodes + pad_rows, block.num_nodes, dtype=torch.float32)
    bias[: block.num_nodes].masked_fill_(~visible, float("-inf"))
    return bias.to(device)


def split_kv_cache(kv_cache: torch.Tensor, head_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The `(key_cache, value_cache)` views `[num_blocks, block_size, num_kv_heads, head_size]` that
    `TritonAttentionImpl.forward` makes of a layer's (unquantized) cache."""
    key_cache, value_cache = kv_cache.transpose(1, 2).split(head_size, dim=-1)
    return key_cache, value_cache


def tree_rows_attention(
    attention: Callable,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    output: torch.Tensor,
    *,
    token_indices: torch.Tensor,
    request_indices: torch.Tensor,
    tree_query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    block_len: int,
    max_seq_len: int,
    scale: float,
    qq_bias: torch.Tensor,
    k_descale: torch.Tensor | None = None,
    v_descale: torch.Tensor | None = None,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Overwrites the tree rows' output with tree attention: one launch of `attention` (vLLM's `unified_attention`)
    over a batch of the R tree rows alone, with the bias.

    `query [T, num_heads, head_size]` and `output` (`[T, num_heads, head_size]` or `[T, num_heads * head_size]`):
    the whole batch's; `token_indices [R * block_len]` int64: the tree rows' block tokens in it; `request_indices
    [R]` int64: their batch rows (into `seq_lens [num_reqs]` and `block_table [num_reqs, max_blocks]`, whose rows
    are vLLM's metadata); `tree_query_start_loc [R + 1]` int32: 0, block_len, 2 * block_len, ...; `qq_bias`:
    `tree_qq_bias` of the step's tree. `max_seq_len` bounds every tree row's seq_len (vLLM's metadata field).
    `softcap`, `sinks`: the layer's, as vLLM's own launch passes them. Shapes follow the host-known R: call it
    outside CUDA graphs (mixed batches run PIECEWISE, attention eager).
    """
    num_tokens, num_heads, head_size = query.shape
    rows = request_indices.long()
    tree_query = query.index_select(0, token_indices)
    tree_out = torch.empty_like(tree_query)
    num_rows = rows.numel()
    if k_descale is None:
        k_descale = torch.ones(num_rows, key_cache.shape[2], dtype=torch.float32, device=query.device)
    if v_descale is None:
        v_descale = k_descale
    attention(
        q=tree_query, k=key_cache, v=value_cache, out=tree_out, cu_seqlens_q=tree_query_start_loc,
        max_seqlen_q=block_len, seqused_k=seq_lens.index_select(0, rows), max_seqlen_k=max_seq_len,
        softmax_scale=scale, causal=True, window_size=(-1, -1), block_table=block_table.index_select(0, rows),
        softcap=softcap, q_descale=None, k_descale=k_descale, v_descale=v_descale, qq_bias=qq_bias, sinks=sinks,
    )
    output.view(num_tokens, num_heads * head_size).index_copy_(
        0, token_indices, tree_out.view(-1, num_heads * head_size).to(output.dtype))
    return output
