"""Tree attention through vLLM's own `unified_attention` with a tree `qq_bias`, and the accepted path's KV compaction,
on the TRITON_ATTN paged KV layout (`trees.attention_triton`).

vLLM's kernel runs as it is under the Triton interpreter (`vllm_interpreted`), on CPU tensors laid out as
vLLM's CUDA KV cache (logical `[num_blocks, num_kv_heads, block_size, 2 * head_size]`, physically head-major or
token-major), against an fp64 masked reference: every committed position plus, for a tree row, the ancestors of
its block token and itself; causal for a prefill chunk; everything for a one-token decode.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.kernels.tree_cases import chains, random_trees, width_trees
from tests.plugin.paged_batches import PagedBatch, empty_cache, make_batch, reference_attention, scattered_block_table
from tests.plugin.vllm_interpreted import interpreted_unified_attention
from vllm_treewy.spec_decode.acceptance import accepted_kv_moves_reference
from vllm_treewy.tree import DraftTree
from vllm_treewy.kernels.paged_kv_compaction_torch import compact_paged_kv_torch
from vllm_treewy.kernels.paged_kv_compaction_triton import compact_paged_kv_triton
from vllm_treewy.vllm_plugin.trees.attention_triton import (
    QQ_BIAS_PAD_ROWS,
    split_kv_cache,
    tree_qq_bias,
    tree_rows_attention,
)

torch.set_num_threads(1)  # a shared 2-core machine; the tensors are tiny

HEADS = [(2, 1), (4, 2), (4, 4), (8, 1)]  # (query heads, KV heads)
LAYOUTS = ["HND", "NHD"]  # physical order of a block's (heads, tokens): vLLM's KV cache layouts
DTYPES = [torch.float32, torch.float16, torch.bfloat16]  # bf16: the model's (tests/interpreter_bf16.py)


def fast(max_examples: int) -> settings:
    return settings(max_examples=max_examples, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def tolerance(dtype: torch.dtype) -> dict:
    # fp32: the kernel's fp32 accumulation order; bf16: the output's rounding (plus bf16 P in the P @ V dot).
    return {"atol": 2e-5, "rtol": 2e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}


def vllm_attention(batch: PagedBatch, qq_bias: torch.Tensor | None, output: torch.Tensor | None = None):
    """vLLM's `unified_attention` over the whole batch, as `TritonAttentionImpl.forward` launches it (causal)."""
    key_cache, value_cache = split_kv_cache(batch.kv_cache, batch.head_size)
    output = torch.full_like(batch.query, float("nan")) if output is None else output
    ones = torch.ones(len(batch.kinds), key_cache.shape[2])
    interpreted_unified_attention()(
        q=batch.query, k=key_cache, v=value_cache, out=output, cu_seqlens_q=batch.query_start_loc,
        max_seqlen_q=max(batch.query_lens), seqused_k=batch.seq_lens, max_seqlen_k=int(batch.seq_lens.max()),
        softmax_scale=batch.head_size**-0.5, causal=True, window_size=(-1, -1), block_table=batch.block_table,
        softcap=0, q_descale=None, k_descale=ones, v_descale=ones, qq_bias=qq_bias,
    )
    return output


def post_pass(batch: PagedBatch, output: torch.Tensor) -> torch.Tensor:
    key_cache, value_cache = split_kv_cache(batch.kv_cache, batch.head_size)
    rows = batch.tree_requests
    return tree_rows_attention(
        interpreted_unified_attention(), batch.query, key_cache, value_cache, output,
        token_indices=batch.tree_token_indices, request_indices=rows,
        tree_query_start_loc=torch.arange(rows.numel() + 1, dtype=torch.int32) * (1 + batch.tree.num_nodes),
        seq_lens=batch.seq_lens, block_table=batch.block_table, block_len=1 + batch.tree.num_nodes,
        max_seq_len=int(batch.seq_lens.max()), scale=batch.head_size**-0.5, qq_bias=tree_qq_bias(batch.tree),
    )


def any_tree(max_nodes: int = 12):
    return st.one_of(random_trees(max_nodes, 5), width_trees(max_nodes), chains(6)).map(DraftTree)


@st.composite
def batch_shapes(draw, with_prefills: bool):
    tree = draw(any_tree())
    kinds = draw(st.lists(st.sampled_from(["tree", "tree", "decode"] + ["prefill"] * with_prefills), min_size=1,
                          max_size=4))
    if "tree" not in kinds:
        kinds.append("tree")
    if with_prefills and "prefill" not in kinds:
        kinds.insert(draw(st.integers(0, len(kinds))), "prefill")
    block_size = draw(st.sampled_from([16, 32]))
    context_lens = [draw(st.integers(0 if kind == "prefill" else 1, 3 * block_size)) for kind in kinds]
    # Prefill chunks both shorter and longer than the bias (1 + N rows), and exactly as long.
    prefill_lens = [draw(st.sampled_from([1, 2, 1 + tree.num_nodes, 40])) for _ in kinds]
    num_heads, num_kv_heads = draw(st.sampled_from(HEADS))
    return dict(tree=tree, kinds=kinds, context_lens=context_lens, prefill_lens=prefill_lens, num_heads=num_heads,
                num_kv_heads=num_kv_heads, head_size=draw(st.sampled_from([32, 64])), block_size=block_size,
                dtype=draw(st.sampled_from(DTYPES)), layout=draw(st.sampled_from(LAYOUTS)),
                seed=draw(st.integers(0, 2**16)))


# --- the bias ----------------------------------------------------------------------------------------------------


def test_bias_rows_are_ancestors_or_self_then_zero_padding():
    tree = DraftTree.from_widths([2, 2, 1])  # block: root 0; 1, 2; 3, 4 below 1; 5, 6 below 2; 7 .. 10
    bias = tree_qq_bias(tree)
    assert bias.shape == (11 + QQ_BIAS_PAD_ROWS, 11) and bias.is_contiguous() and bias.dtype == torch.float32
    visible = (bias[:11] == 0).nonzero().tolist()
    expected = {(0, 0), (1, 0), (1, 1), (2, 0), (2, 2), (3, 0), (3, 1), (3, 3), (9, 0), (9, 2), (9, 5), (9, 9)}
    assert expected <= {tuple(v) for v in visible}
    assert bias[9].tolist().count(0.0) == 4 and bias[0].tolist().count(0.0) == 1
    assert bool((bias[:11] != 0).logical_and(bias[:11] != float("-inf")).any()) is False
    assert bool((bias[11:] == 0).all())


# --- attention -----------------------------------------------------------------------------------------------------


@fast(30)
@given(shape=batch_shapes(with_prefills=False))
def test_bias_in_vllms_launch_is_tree_attention_for_tree_rows_and_one_token_decodes(shape):
    """A batch of tree rows and one-token decodes (what the runner sends with the bias, FULL CUDA graphs included):
    vLLM's own launch with the tree bias gives every row its masked attention."""
    batch = make_batch(**shape)
    out = vllm_attention(batch, tree_qq_bias(batch.tree))
    torch.testing.assert_close(out.double(), reference_attention(batch), **tolerance(shape["dtype"]))


@fast(30)
@given(shape=batch_shapes(with_prefills=True))
def test_post_pass_after_vllms_causal_launch_fixes_the_tree_rows_of_a_mixed_batch(shape):
    """A batch with prefills: vLLM's causal launch for all, then the tree rows recomputed alone with the bias."""
    batch = make_batch(**shape)
    out = post_pass(batch, vllm_attention(batch, None))
    torch.testing.assert_close(out.double(), reference_attention(batch), **tolerance(shape["dtype"]))


def test_the_bias_would_mask_a_prefill_chunk_like_a_tree():
    """Why mixed batches do not get the bias: a prefill chunk of 1 + N tokens would be tree-masked (and the test
    can see that); the same batch through the post-pass is right."""
    tree = DraftTree.from_widths([2, 2])
    shape = dict(tree=tree, kinds=["tree", "prefill"], context_lens=[20, 5], prefill_lens=[0, 1 + tree.num_nodes],
                 num_heads=4, num_kv_heads=2, head_size=32, block_size=16, dtype=torch.float32, layout="NHD")
    batch = make_batch(**shape)
    reference = reference_attention(batch)
    prefill_rows = slice(1 + tree.num_nodes, None)
    wrong = vllm_attention(batch, tree_qq_bias(tree))
    assert not torch.allclose(wrong[prefill_rows].double(), reference[prefill_rows], atol=1e-3)
    right = post_pass(batch, vllm_attention(batch, None))
    torch.testing.assert_close(right.double(), reference, **tolerance(torch.float32))


def test_post_pass_writes_a_flat_output_and_leaves_other_rows_alone():
    """`output` as vLLM hands it to `forward` ([T, heads * head_size]); non-tree rows keep what they hold."""
    tree = DraftTree.from_widths([3, 1])
    batch = make_batch(tree, ["decode", "tree", "prefill", "tree"], [7, 30, 3, 16], [0, 0, 9, 0], num_heads=4,
                       num_kv_heads=2, head_size=32, block_size=16, dtype=torch.float32, layout="HND", seed=3)
    flat = torch.full((batch.query.shape[0], 4 * 32), 5.0)
    post_pass(batch, flat)
    tree_rows = batch.tree_token_indices
    others = torch.ones(flat.shape[0], dtype=torch.bool)
    others[tree_rows] = False
    assert bool((flat[others] == 5.0).all())
    torch.testing.assert_close(flat[tree_rows].view(-1, 4, 32).double(), reference_attention(batch)[tree_rows],
                               **tolerance(torch.float32))


# --- compaction (`kernels.paged_kv_compaction_*`: the torch twin, and the Triton kernel under the interpreter) ------

COMPACTIONS = ("torch", "triton")


def compact(implementation: str, caches, table, paths, roots) -> None:
    """The accepted paths' compaction of every cache (sharing `table`) by the twin (one call) or the kernel (one
    launch per cache, as `trees.sampling.commit_accepted_path` runs it on CUDA)."""
    caches = [caches] if isinstance(caches, torch.Tensor) else caches
    if implementation == "torch":
        compact_paged_kv_torch(caches, table, paths, roots)
    else:
        for cache in caches:
            compact_paged_kv_triton(cache, table, paths, roots)


def random_path(tree: DraftTree, generator: torch.Generator, depth: int) -> list[int]:
    """A root-to-node path (local nodes; empty: nothing accepted), padded with -1 to `depth`."""
    node = int(torch.randint(-1, tree.num_nodes, (1,), generator=generator))
    path = []
    while node >= 0:
        path.insert(0, node)
        node = tree.parents[node]
    return path + [-1] * (depth - len(path))


@fast(40)
@given(tree=any_tree(16), num_requests=st.integers(1, 4), block_size=st.sampled_from([16, 32]),
       layout=st.sampled_from(LAYOUTS), dtype=st.sampled_from(DTYPES), num_layers=st.integers(1, 2),
       seed=st.integers(0, 2**16), implementation=st.sampled_from(COMPACTIONS))
def test_compaction_puts_the_accepted_path_behind_the_root(tree, num_requests, block_size, layout, dtype, num_layers,
                                                          seed, implementation):
    generator = torch.Generator().manual_seed(seed)
    block_len = 1 + tree.num_nodes
    roots = torch.randint(0, 3 * block_size, (num_requests,), generator=generator)
    table, num_blocks = scattered_block_table(num_requests, (roots + block_len).tolist(), block_size, generator)
    caches = []
    for _ in range(num_layers):
        cache = empty_cache(num_blocks, 2, block_size, 2 * 32, dtype, layout, fill=0.0)
        cache.copy_(torch.randn(cache.shape, generator=generator).to(dtype))
        caches.append(cache)
    before = [c.clone() for c in caches]
    paths = [random_path(tree, generator, max(tree.depth)) for _ in range(num_requests)]
    compact(implementation, caches, table, torch.tensor(paths), roots)
    for cache, original in zip(caches, before):
        expected = original.transpose(1, 2).clone()  # [blocks, tokens, heads, C]
        for r, path in enumerate(paths):
            accepted = [node for node in path if node >= 0]
            for source, destination in accepted_kv_moves_reference(accepted, int(roots[r])):
                block_s, block_d = table[r, source // block_size], table[r, destination // block_size]
                expected[block_d, destination % block_size] = original.transpose(1, 2)[block_s, source % block_size]
        assert torch.equal(cache.transpose(1, 2), expected)


@pytest.mark.parametrize("implementation", COMPACTIONS)
def test_compaction_of_a_chain_moves_nothing(implementation):
    cache = empty_cache(4, 2, 16, 64, torch.float32, "NHD", fill=0.0).normal_()
    before = cache.clone()
    table, paths, roots = torch.tensor([[2, 0, 1]]), torch.tensor([[0, 1, -1]]), torch.tensor([14])
    compact(implementation, cache, table, paths, roots)
    assert bool((compact_paged_kv_torch(cache, table, paths, roots).sources < 0).all())
    assert torch.equal(cache, before)


@pytest.mark.parametrize("implementation", COMPACTIONS)
def test_compaction_across_a_block_boundary(implementation):
    """Root at position 14 of 16-token blocks: the path's nodes sit in the next block, and move into both."""
    tree = DraftTree.from_widths([2, 2])  # nodes 0, 1; 2, 3 below 0; 4, 5 below 1
    cache = empty_cache(4, 1, 16, 8, torch.float32, "HND", fill=0.0)
    tokens = cache.transpose(1, 2)
    table = torch.tensor([[3, 1, 0]])
    for position in range(14, 14 + 1 + tree.num_nodes):
        tokens[table[0, position // 16], position % 16] = position
    compact(implementation, cache, table, torch.tensor([[1, 5]]), torch.tensor([14]))
    # root 14 stays; node 1 (position 16 = block 1 offset 0) -> 15 (block 3 offset 15); node 5 (position 20) -> 16
    assert tokens[3, 15, 0, 0] == 16 and tokens[1, 0, 0, 0] == 20 and tokens[3, 14, 0, 0] == 14
    assert tokens[1, 4, 0, 0] == 20  # sources keep their (now stale) values
