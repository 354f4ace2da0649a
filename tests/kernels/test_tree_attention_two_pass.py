"""Two-pass tree attention (prefix pass over the paged cache + ancestor pass over the verified block, merged by
log-sum-exp) against one dense masked softmax over the union in fp64, on random trees, prefix lengths (0 included:
graph-padding rows), GQA head counts and fp32 / fp16 / bf16; the Triton ancestor kernel (interpreted on CPU) against
its torch twin (GQA groups of 1 to 6, head sizes up to 256, request counts at the search's bit-length edges); the
merge against one softmax over the union of two disjoint key sets. Seconds in all."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_treewy.kernels.attention_merge_torch import merge_attention_states_torch
from vllm_treewy.kernels.paged_prefix_attention_torch import paged_prefix_attention_torch
from vllm_treewy.kernels.tree_attention_ancestors_torch import tree_attention_ancestors_torch, tree_token_ancestors
from vllm_treewy.kernels.tree_attention_ancestors_triton import tree_attention_ancestors_triton
from vllm_treewy.kernels.tree_attention_reference import tree_attention_reference
from vllm_treewy.tree import DraftTree

# Output tolerance per dtype: the inputs are already in the dtype, so what is left is the output's rounding and the
# fp32 accumulation (half an ulp of values of magnitude ~1, times a small factor).
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
DTYPES = st.sampled_from([torch.float32, torch.float16, torch.bfloat16])


@st.composite
def trees(draw, max_nodes=7):
    """Local parents of a tree in node order (each parent precedes its child; -1: child of the root)."""
    num_nodes = draw(st.integers(1, max_nodes))
    return [draw(st.integers(-1, node - 1)) for node in range(num_nodes)]


def block_ancestor_table(parents) -> torch.Tensor:
    """`[1 + N, depth + 1]` int32: block indices of each block token's ancestors and itself, -1 padding."""
    chains = [[0]]
    for node, parent in enumerate(parents):
        chains.append([1 + node, *chains[1 + parent if parent >= 0 else 0]])
    width = max(map(len, chains))
    return torch.tensor([chain + [-1] * (width - len(chain)) for chain in chains], dtype=torch.int32)


def paged_batch(prefix_lens, block_len, num_kv_heads, head_size, block_size, dtype, generator):
    """A paged cache holding each request's prefix then its block at positions prefix_len + i, block tables over
    shuffled blocks (free slots hold NaN: nothing may read them), and the dense K/V per request."""
    blocks_per_request = [-(-(length + block_len) // block_size) for length in prefix_lens]
    num_blocks = sum(blocks_per_request) + 2
    key_cache = torch.full((num_blocks, block_size, num_kv_heads, head_size), float("nan"), dtype=dtype)
    value_cache = key_cache.clone()
    order = torch.randperm(num_blocks, generator=generator)
    width = max(blocks_per_request)
    block_table = torch.zeros(len(prefix_lens), width, dtype=torch.int32)
    dense = []
    used = 0
    for r, (length, count) in enumerate(zip(prefix_lens, blocks_per_request)):
        block_table[r, :count] = order[used : used + count].to(torch.int32)
        used += count
        keys = torch.randn(length + block_len, num_kv_heads, head_size, generator=generator).to(dtype)
        values = torch.randn(length + block_len, num_kv_heads, head_size, generator=generator).to(dtype)
        positions = torch.arange(length + block_len)
        blocks = block_table[r, positions // block_size].long()
        key_cache[blocks, positions % block_size] = keys
        value_cache[blocks, positions % block_size] = values
        dense.append((keys, values))
    return key_cache, value_cache, block_table, dense


def two_pass(query, key, value, key_cache, value_cache, block_table, prefix_lens, table, scale, ancestors_pass):
    """The two passes over R back-to-back verified blocks, merged: what the FLASH_ATTN hook computes, with the torch
    prefix pass."""
    num_requests, block_len = len(prefix_lens), table.shape[0]
    flat = [t.reshape(num_requests * block_len, *t.shape[2:]) for t in (query, key, value)]
    cu = torch.arange(num_requests + 1, dtype=torch.int32) * block_len
    prefix_out, prefix_lse = paged_prefix_attention_torch(
        flat[0], key_cache, value_cache, cu_seqlens_q=cu, seqused_k=torch.tensor(prefix_lens, dtype=torch.int32),
        block_table=block_table, max_seqlen_k=max(prefix_lens), scale=scale)
    suffix_out, suffix_lse = ancestors_pass(*flat, cu, table, scale)
    return merge_attention_states_torch(torch.empty_like(flat[0]), prefix_out, prefix_lse, suffix_out, suffix_lse)


@settings(max_examples=25, deadline=None)
@given(parents=trees(), prefix_lens=st.lists(st.integers(0, 21), min_size=1, max_size=3),
       kv_heads=st.sampled_from([1, 2]), group=st.sampled_from([1, 3]), dtype=DTYPES, seed=st.integers(0, 2**16))
def test_two_pass_equals_one_softmax_over_prefix_and_ancestors(parents, prefix_lens, kv_heads, group, dtype, seed):
    generator = torch.Generator().manual_seed(seed)
    block_len, head_size, scale = 1 + len(parents), 8, 0.4
    key_cache, value_cache, block_table, dense = paged_batch(prefix_lens, block_len, kv_heads, head_size, 4, dtype,
                                                             generator)
    query = torch.randn(len(prefix_lens), block_len, kv_heads * group, head_size, generator=generator).to(dtype)
    key = torch.stack([keys[length:] for (keys, _), length in zip(dense, prefix_lens)])
    value = torch.stack([values[length:] for (_, values), length in zip(dense, prefix_lens)])
    table = block_ancestor_table(parents)
    expected = tree_attention_reference(
        query, [keys[:length] for (keys, _), length in zip(dense, prefix_lens)],
        [values[:length] for (_, values), length in zip(dense, prefix_lens)], key, value, parents, scale)
    got = two_pass(query, key, value, key_cache, value_cache, block_table, prefix_lens, table, scale,
                   tree_attention_ancestors_torch)
    assert got.dtype == dtype
    torch.testing.assert_close(got.double().view_as(expected), expected, atol=TOLERANCE[dtype], rtol=0)


def test_two_pass_with_the_triton_ancestor_pass():
    """One case end to end with the Triton ancestor pass (interpreted on CPU), the [2, 2, 1] tree in fp16."""
    parents, prefix_lens, dtype = [-1, -1, 0, 1, 2], [0, 9, 5], torch.float16
    generator = torch.Generator().manual_seed(7)
    block_len, scale = 1 + len(parents), 0.4
    key_cache, value_cache, block_table, dense = paged_batch(prefix_lens, block_len, 2, 8, 4, dtype, generator)
    query = torch.randn(len(prefix_lens), block_len, 4, 8, generator=generator).to(dtype)
    key = torch.stack([keys[length:] for (keys, _), length in zip(dense, prefix_lens)])
    value = torch.stack([values[length:] for (_, values), length in zip(dense, prefix_lens)])
    expected = tree_attention_reference(
        query, [keys[:length] for (keys, _), length in zip(dense, prefix_lens)],
        [values[:length] for (_, values), length in zip(dense, prefix_lens)], key, value, parents, scale)
    got = two_pass(query, key, value, key_cache, value_cache, block_table, prefix_lens,
                   block_ancestor_table(parents), scale, tree_attention_ancestors_triton)
    torch.testing.assert_close(got.double().view_as(expected), expected, atol=TOLERANCE[dtype], rtol=0)


def assert_triton_equals_twin(parents, query_lens, padding, kv_heads, group, head_size, dtype, seed, scale=0.3):
    """The Triton ancestor pass against its torch twin on one batch: `query_lens` entries 0, 1 or "block"; `padding`
    tokens past the batch; the key / value rows strided as a fused QKV output."""
    generator = torch.Generator().manual_seed(seed)
    table = block_ancestor_table(parents)
    lengths = [table.shape[0] if length == "block" else length for length in query_lens]
    cu = torch.tensor([0, *lengths]).cumsum(0).to(torch.int32)
    num_tokens = int(cu[-1]) + padding
    if num_tokens == 0:
        return
    query = torch.randn(num_tokens, kv_heads * group, head_size, generator=generator).to(dtype)
    qkv = torch.randn(num_tokens, 3 * kv_heads, head_size, generator=generator).to(dtype)
    key, value = qkv[:, kv_heads : 2 * kv_heads], qkv[:, 2 * kv_heads :]
    expected_out, expected_lse = tree_attention_ancestors_torch(query, key, value, cu, table, scale)
    out, lse = tree_attention_ancestors_triton(query, key, value, cu, table, scale)
    assert out.dtype == dtype and out.shape == query.shape and lse.shape == (kv_heads * group, num_tokens)
    torch.testing.assert_close(out.float(), expected_out.float(), atol=TOLERANCE[dtype], rtol=0)
    torch.testing.assert_close(lse, expected_lse, atol=1e-5, rtol=1e-5)


@settings(max_examples=20, deadline=None)
@given(parents=trees(max_nodes=5), query_lens=st.lists(st.sampled_from([0, 1, "block"]), min_size=1, max_size=6),
       padding=st.integers(0, 2), kv_heads=st.sampled_from([1, 2]), group=st.sampled_from([1, 2, 3, 6]),
       head_size=st.sampled_from([12, 64, 256]), dtype=DTYPES, seed=st.integers(0, 2**16))
def test_triton_ancestor_pass_equals_its_twin(parents, query_lens, padding, kv_heads, group, head_size, dtype, seed):
    """Batches mixing verified blocks, one-token decodes, empty (padded) requests and padding tokens past the batch,
    as a FULL graph's replay of a covering batch has them; GQA groups of power-of-two and other sizes (one program
    holds a KV head's whole group, padded to a power of two), head sizes of one and other sizes."""
    assert_triton_equals_twin(parents, query_lens, padding, kv_heads, group, head_size, dtype, seed)


def test_triton_ancestor_pass_at_the_27b_attention_shape():
    """Qwen3.5-27B's full attention (24 query heads over 4 KV heads: groups of 6; head size 256) in bf16, the
    [2, 2, 1] tree, a batch of blocks, a decode, an empty request and graph padding."""
    parents = DraftTree.from_widths([2, 2, 1]).parents
    assert_triton_equals_twin(parents, ["block", "block", 1, "block", 0, "block"], 3, 4, 6, 256, torch.bfloat16,
                              seed=3, scale=256**-0.5)


@pytest.mark.parametrize("num_requests", [1, 2, 3, 4, 7, 8, 9, 16, 17])
def test_triton_ancestor_pass_request_search_at_power_of_two_edges(num_requests):
    """The request search over R requests: request counts at and past powers of two, every request
    found (blocks, decodes and empty requests interleaved, the last token of the last request included)."""
    kinds = ["block", 1, "block", 0]
    query_lens = [kinds[r % len(kinds)] for r in range(num_requests)]
    query_lens[-1] = "block"
    assert_triton_equals_twin([-1, 0, -1], query_lens, 1, 1, 3, 12, torch.float32, seed=num_requests)


def test_token_ancestors_of_blocks_one_token_rows_and_padding():
    """Tokens of a block get their block's ancestors shifted to the block's rows; a one-token query and the padding
    past the batch get themselves alone."""
    table = block_ancestor_table([-1, -1, 0])  # root 0; nodes 1, 2 children of the root; node 3 child of 1
    cu = torch.tensor([0, 4, 5, 5, 9], dtype=torch.int32)
    got = tree_token_ancestors(cu, 11, table)
    block = [[0, -1, -1], [1, 0, -1], [2, 0, -1], [3, 1, 0]]
    expected = [[a + 0 if a >= 0 else -1 for a in row] for row in block] + [[4, -1, -1]] + [
        [a + 5 if a >= 0 else -1 for a in row] for row in block] + [[9, -1, -1], [10, -1, -1]]
    assert got.tolist() == expected


@settings(max_examples=30, deadline=None)
@given(num_keys=st.integers(1, 12), split=st.integers(0, 12), heads=st.integers(1, 3), seed=st.integers(0, 2**16),
       empty_as=st.sampled_from([float("inf"), float("-inf")]))
def test_merge_equals_one_softmax_over_the_union(num_keys, split, heads, seed, empty_as):
    """Keys split into a prefix part (possibly empty: its log-sum-exp +inf as FlashAttention 3 writes it, or -inf)
    and a non-empty suffix part; the merged output is the softmax over all keys."""
    split = min(split, num_keys - 1)
    generator = torch.Generator().manual_seed(seed)
    scores = torch.randn(4, heads, num_keys, generator=generator, dtype=torch.float64) * 3
    values = torch.randn(4, heads, num_keys, 5, generator=generator, dtype=torch.float64)

    def partial(part):
        if part.stop - (part.start or 0) == 0:
            return torch.zeros(4, heads, 5), torch.full((heads, 4), empty_as)
        lse = torch.logsumexp(scores[..., part], dim=-1)
        out = torch.einsum("thk,thkd->thd", torch.softmax(scores[..., part], dim=-1), values[..., part, :])
        return out.float(), lse.transpose(0, 1).float()

    merged = merge_attention_states_torch(torch.empty(4, heads, 5), *partial(slice(0, split)),
                                          *partial(slice(split, num_keys)))
    expected = torch.einsum("thk,thkd->thd", torch.softmax(scores, dim=-1), values)
    torch.testing.assert_close(merged.double(), expected, atol=1e-5, rtol=1e-5)


def test_merge_matches_vllms_merge_attn_states():
    """The twin and vLLM's `merge_attn_states` (its CPU path, what the CUDA op computes) agree, empty prefixes of
    both signs included: the FLASH_ATTN hook calls vLLM's on CUDA."""
    vllm_merge = pytest.importorskip("vllm.v1.attention.ops.merge_attn_states")
    generator = torch.Generator().manual_seed(0)
    prefix_out, suffix_out = torch.randn(2, 6, 4, 8, generator=generator)
    prefix_lse, suffix_lse = torch.randn(2, 4, 6, generator=generator)
    prefix_lse[0, 0], prefix_lse[1, 2] = float("inf"), float("-inf")
    expected = torch.empty_like(prefix_out)
    vllm_merge._merge_attn_states_torch(expected, prefix_out, prefix_lse, suffix_out, suffix_lse)
    got = merge_attention_states_torch(torch.empty_like(prefix_out), prefix_out, prefix_lse, suffix_out, suffix_lse)
    torch.testing.assert_close(got, expected)
