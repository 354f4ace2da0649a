"""Two-pass tree attention (prefix pass over the paged cache, then the ancestor pass over the verified block with the
merge by log-sum-exp folded in) against one dense masked softmax over the union in fp64, on random trees, prefix
lengths (0 included: graph-padding rows, whose prefix output may be NaN), GQA head counts and fp32 / fp16 / bf16; the
fused Triton kernel (interpreted on CPU) against its torch twin on batches of blocks, one-token decodes, empty
requests and padding rows past the batch (left untouched), prefix log-sum-exps of +inf / -inf with NaN prefix rows,
GQA groups of 1 to 6, head sizes up to 256, strided inputs and outputs, request counts at the search's bit-length
edges; the merge against one softmax over the union of two disjoint key sets. Seconds in all."""

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
SENTINEL = -7.0  # what a graph's padding rows of the output hold before the launch, and must hold after it


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


def two_pass(query, key, value, key_cache, value_cache, block_table, prefix_lens, table, scale, fused,
             empty_lse=float("-inf")):
    """The two passes over R back-to-back verified blocks: what the FLASH_ATTN hook computes, with the torch prefix
    pass; a request without prefix keys gets log-sum-exp `empty_lse` and NaN prefix rows (nothing may read them)."""
    num_requests, block_len = len(prefix_lens), table.shape[0]
    flat = [t.reshape(num_requests * block_len, *t.shape[2:]) for t in (query, key, value)]
    cu = torch.arange(num_requests + 1, dtype=torch.int32) * block_len
    prefix_out, prefix_lse = paged_prefix_attention_torch(
        flat[0], key_cache, value_cache, cu_seqlens_q=cu, seqused_k=torch.tensor(prefix_lens, dtype=torch.int32),
        block_table=block_table, max_seqlen_k=max(prefix_lens), scale=scale)
    empty = torch.isinf(prefix_lse)
    prefix_lse = torch.where(empty, empty_lse, prefix_lse)
    prefix_out = torch.where(empty.transpose(0, 1)[..., None], float("nan"), prefix_out)
    output = torch.full_like(flat[0], float("nan"))
    assert fused(*flat, cu, table, prefix_out, prefix_lse, output, scale) is output
    return output


def dense_reference(query, dense, prefix_lens, key, value, parents, scale):
    return tree_attention_reference(
        query, [keys[:length] for (keys, _), length in zip(dense, prefix_lens)],
        [values[:length] for (_, values), length in zip(dense, prefix_lens)], key, value, parents, scale)


@settings(max_examples=25, deadline=None)
@given(parents=trees(), prefix_lens=st.lists(st.integers(0, 21), min_size=1, max_size=3),
       kv_heads=st.sampled_from([1, 2]), group=st.sampled_from([1, 3]), dtype=DTYPES, seed=st.integers(0, 2**16),
       empty_lse=st.sampled_from([float("inf"), float("-inf")]))
def test_two_pass_equals_one_softmax_over_prefix_and_ancestors(parents, prefix_lens, kv_heads, group, dtype, seed,
                                                               empty_lse):
    """The torch twin (ancestors + merge into the output) after the torch prefix pass: the softmax over the union;
    empty prefixes (+inf as FlashAttention 3 writes it, or -inf; NaN prefix rows) contribute nothing."""
    generator = torch.Generator().manual_seed(seed)
    block_len, head_size, scale = 1 + len(parents), 8, 0.4
    key_cache, value_cache, block_table, dense = paged_batch(prefix_lens, block_len, kv_heads, head_size, 4, dtype,
                                                             generator)
    query = torch.randn(len(prefix_lens), block_len, kv_heads * group, head_size, generator=generator).to(dtype)
    key = torch.stack([keys[length:] for (keys, _), length in zip(dense, prefix_lens)])
    value = torch.stack([values[length:] for (_, values), length in zip(dense, prefix_lens)])
    table = block_ancestor_table(parents)
    expected = dense_reference(query, dense, prefix_lens, key, value, parents, scale)
    got = two_pass(query, key, value, key_cache, value_cache, block_table, prefix_lens, table, scale,
                   tree_attention_ancestors_torch, empty_lse)
    assert got.dtype == dtype
    torch.testing.assert_close(got.double().view_as(expected), expected, atol=TOLERANCE[dtype], rtol=0)


@pytest.mark.parametrize("empty_lse", [float("inf"), float("-inf")])
def test_two_pass_with_the_triton_kernel(empty_lse):
    """One case end to end with the fused Triton kernel (interpreted on CPU), the [2, 2, 1] tree in fp16, a request
    without prefix keys (NaN prefix rows)."""
    parents, prefix_lens, dtype = [-1, -1, 0, 1, 2], [0, 9, 5], torch.float16
    generator = torch.Generator().manual_seed(7)
    block_len, scale = 1 + len(parents), 0.4
    key_cache, value_cache, block_table, dense = paged_batch(prefix_lens, block_len, 2, 8, 4, dtype, generator)
    query = torch.randn(len(prefix_lens), block_len, 4, 8, generator=generator).to(dtype)
    key = torch.stack([keys[length:] for (keys, _), length in zip(dense, prefix_lens)])
    value = torch.stack([values[length:] for (_, values), length in zip(dense, prefix_lens)])
    expected = dense_reference(query, dense, prefix_lens, key, value, parents, scale)
    got = two_pass(query, key, value, key_cache, value_cache, block_table, prefix_lens,
                   block_ancestor_table(parents), scale, tree_attention_ancestors_triton, empty_lse)
    torch.testing.assert_close(got.double().view_as(expected), expected, atol=TOLERANCE[dtype], rtol=0)


def fused_inputs(parents, query_lens, padding, kv_heads, group, head_size, dtype, seed, *, empty_lse=float("inf"),
                 flat_output=False):
    """One batch of the fused kernel's inputs: `query_lens` entries 0, 1 or "block"; `padding` tokens past the batch;
    key / value rows strided as a fused QKV output; a prefix output strided in its token axis and a prefix
    log-sum-exp `[H, T]` strided as a slice of a wider buffer, a third of its rows (and every padding token's) without
    prefix keys (`empty_lse`, their prefix rows NaN); the output a strided view, `[T, H, D]` or `[T, H * D]`, holding
    SENTINEL. Returns (the arguments but output, output, cu); None for an empty batch."""
    generator = torch.Generator().manual_seed(seed)
    table = block_ancestor_table(parents)
    lengths = [table.shape[0] if length == "block" else length for length in query_lens]
    cu = torch.tensor([0, *lengths]).cumsum(0).to(torch.int32)
    num_tokens, heads = int(cu[-1]) + padding, kv_heads * group
    if num_tokens == 0:
        return None
    query = torch.randn(num_tokens, heads, head_size, generator=generator).to(dtype)
    qkv = torch.randn(num_tokens, 3 * kv_heads, head_size, generator=generator).to(dtype)
    key, value = qkv[:, kv_heads : 2 * kv_heads], qkv[:, 2 * kv_heads :]
    prefix_out = torch.randn(num_tokens, heads + 1, head_size, generator=generator).to(dtype)[:, :heads]
    prefix_lse = (torch.randn(heads, num_tokens + 5, generator=generator) * 3)[:, :num_tokens]
    empty = torch.rand(num_tokens, generator=generator) < 1 / 3
    empty[int(cu[-1]):] = True
    prefix_lse[:, empty] = empty_lse
    prefix_out[empty] = float("nan")
    wide = torch.full((num_tokens, heads * head_size + 3), SENTINEL, dtype=dtype)[:, : heads * head_size]
    output = wide if flat_output else wide.view(num_tokens, heads, head_size)
    return (query, key, value, cu, table, prefix_out, prefix_lse), output, cu


def assert_triton_equals_twin(parents, query_lens, padding, kv_heads, group, head_size, dtype, seed, scale=0.3,
                              **options):
    """The fused Triton kernel against its torch twin on one batch (`fused_inputs`): the batch's rows agree, the
    padding rows past `query_start_loc[-1]` still hold SENTINEL, exactly."""
    made = fused_inputs(parents, query_lens, padding, kv_heads, group, head_size, dtype, seed, **options)
    if made is None:
        return
    args, output, cu = made
    expected = tree_attention_ancestors_torch(*args, output.clone(), scale)
    got = tree_attention_ancestors_triton(*args, output, scale)
    assert got is output and got.dtype == dtype
    rows, expected = got.reshape(got.shape[0], -1), expected.reshape(got.shape[0], -1)
    batch = int(cu[-1])
    assert not rows[:batch].isnan().any()
    torch.testing.assert_close(rows[:batch].float(), expected[:batch].float(), atol=TOLERANCE[dtype], rtol=0)
    assert bool((rows[batch:] == SENTINEL).all()) and bool((expected[batch:] == SENTINEL).all())


@settings(max_examples=20, deadline=None)
@given(parents=trees(max_nodes=5), query_lens=st.lists(st.sampled_from([0, 1, "block"]), min_size=1, max_size=6),
       padding=st.integers(0, 2), kv_heads=st.sampled_from([1, 2]), group=st.sampled_from([1, 2, 3, 6]),
       head_size=st.sampled_from([12, 64, 256]), dtype=DTYPES, seed=st.integers(0, 2**16),
       empty_lse=st.sampled_from([float("inf"), float("-inf")]), flat_output=st.booleans())
def test_triton_kernel_equals_its_twin(parents, query_lens, padding, kv_heads, group, head_size, dtype, seed,
                                       empty_lse, flat_output):
    """Batches mixing verified blocks, one-token decodes, empty (padded) requests and padding tokens past the batch,
    as a FULL graph's replay of a covering batch has them; GQA groups of power-of-two and other sizes (one program
    holds a KV head's whole group, padded to a power of two), head sizes of one and other sizes; prefixes with and
    without keys; the output as vLLM's `[T, H, D]` or `[T, H * D]`."""
    assert_triton_equals_twin(parents, query_lens, padding, kv_heads, group, head_size, dtype, seed,
                              empty_lse=empty_lse, flat_output=flat_output)


def test_triton_kernel_at_the_27b_attention_shape():
    """Qwen3.5-27B's full attention (24 query heads over 4 KV heads: groups of 6; head size 256) in bf16, the
    [2, 2, 1] tree, a batch of blocks, a decode, an empty request and graph padding."""
    parents = DraftTree.from_widths([2, 2, 1]).parents
    assert_triton_equals_twin(parents, ["block", "block", 1, "block", 0, "block"], 3, 4, 6, 256, torch.bfloat16,
                              seed=3, scale=256**-0.5)


@pytest.mark.parametrize("num_requests", [1, 2, 3, 4, 7, 8, 9, 16, 17])
def test_triton_kernel_request_search_at_power_of_two_edges(num_requests):
    """The request search over R requests: request counts at and past powers of two, every request
    found (blocks, decodes and empty requests interleaved, the last token of the last request included)."""
    kinds = ["block", 1, "block", 0]
    query_lens = [kinds[r % len(kinds)] for r in range(num_requests)]
    query_lens[-1] = "block"
    assert_triton_equals_twin([-1, 0, -1], query_lens, 1, 1, 3, 12, torch.float32, seed=num_requests)


@pytest.mark.parametrize("kernel", [tree_attention_ancestors_torch, tree_attention_ancestors_triton], ids=["torch",
                                                                                                        "triton"])
def test_the_prefix_is_the_softmax_start_and_padding_rows_stay(kernel):
    """Hand-checkable: a one-token decode whose own key scores s = 0 with value 1, beside a prefix with log-sum-exp
    0 and output 3, merges to (3 + 1) / 2 = 2; the same decode without prefix keys (+inf, NaN row) to 1; a padding
    row keeps its SENTINEL. The merge and the guards alone, on both twins."""
    query = torch.zeros(3, 1, 4)
    key, value = torch.zeros(3, 1, 4), torch.ones(3, 1, 4)
    cu = torch.tensor([0, 1, 2], dtype=torch.int32)
    table = block_ancestor_table([-1])
    prefix_out = torch.tensor([3.0, float("nan"), 5.0])[:, None, None].expand(3, 1, 4).contiguous()
    prefix_lse = torch.tensor([[0.0, float("inf"), 0.0]])
    output = torch.full((3, 1, 4), SENTINEL)
    kernel(query, key, value, cu, table, prefix_out, prefix_lse, output, 1.0)
    assert output[:, 0, 0].tolist() == [2.0, 1.0, SENTINEL]


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
    """Keys split into a prefix part (possibly empty: its log-sum-exp +inf as FlashAttention 3 writes it, or -inf,
    its output rows NaN) and a non-empty suffix part; the merged output is the softmax over all keys."""
    split = min(split, num_keys - 1)
    generator = torch.Generator().manual_seed(seed)
    scores = torch.randn(4, heads, num_keys, generator=generator, dtype=torch.float64) * 3
    values = torch.randn(4, heads, num_keys, 5, generator=generator, dtype=torch.float64)

    def partial(part):
        if part.stop - (part.start or 0) == 0:
            return torch.full((4, heads, 5), float("nan")), torch.full((heads, 4), empty_as)
        lse = torch.logsumexp(scores[..., part], dim=-1)
        out = torch.einsum("thk,thkd->thd", torch.softmax(scores[..., part], dim=-1), values[..., part, :])
        return out.float(), lse.transpose(0, 1).float()

    merged = merge_attention_states_torch(torch.empty(4, heads, 5), *partial(slice(0, split)),
                                          *partial(slice(split, num_keys)))
    expected = torch.einsum("thk,thkd->thd", torch.softmax(scores, dim=-1), values)
    torch.testing.assert_close(merged.double(), expected, atol=1e-5, rtol=1e-5)
