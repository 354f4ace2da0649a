"""Tree attention on FLASH_ATTN on CUDA (`trees.attention_flash`): vLLM's FlashAttention 3 varlen call as the prefix
pass (its real output and `[H, T]` log-sum-exp, +inf for a request without committed keys), then the Triton ancestor
pass with the merge folded in, writing into the output, in bf16 at Qwen3.5 full-attention sizes, against the fp64
masked reference; the whole-batch path captured in a CUDA graph (prefix lengths in a buffer written outside it, as
the hand-over does) and replayed on other lengths, its graph-padding rows untouched; the fused Triton kernel against
its torch twin. The CPU tests (`tests/plugin/trees/test_attention_flash.py`) run the same hook with a torch stand-in
for FlashAttention. Run on the H200: `pytest -m gpu tests/gpu`."""

import dataclasses

import pytest
import torch

from vllm_treewy.tree import DraftTree

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

from tests.plugin.paged_batches import make_batch, reference_attention  # noqa: E402
from vllm_treewy.kernels.tree_attention_ancestors_torch import tree_attention_ancestors_torch  # noqa: E402
from vllm_treewy.kernels.tree_attention_ancestors_triton import tree_attention_ancestors_triton  # noqa: E402
from vllm_treewy.vllm_plugin.trees.attention_flash import (  # noqa: E402
    prefix_lengths,
    tree_batch_attention,
    tree_block_ancestors,
    tree_rows_attention,
)
from vllm_treewy.vllm_plugin.trees.attention_triton import split_kv_cache  # noqa: E402


SENTINEL = -7.0  # what a graph's padding rows of the output hold before the passes, and must hold after them


def flash_varlen():
    from vllm.vllm_flash_attn import flash_attn_interface

    if not flash_attn_interface.FA3_AVAILABLE:
        pytest.skip(f"FlashAttention 3 does not load: {flash_attn_interface.FA3_UNAVAILABLE_REASON}")
    return flash_attn_interface.flash_attn_varlen_func


def on_cuda(batch):
    moved = {f.name: getattr(batch, f.name) for f in dataclasses.fields(batch)}
    for name in ("query", "kv_cache", "block_table"):
        moved[name] = moved[name].cuda()
    return type(batch)(**moved)


def new_key_values(batch):
    keys = torch.cat([k[c:] for k, c in zip(batch.keys, batch.context_lens)]).cuda()
    values = torch.cat([v[c:] for v, c in zip(batch.values, batch.context_lens)]).cuda()
    return keys, values


def prefix_kwargs(num_requests, num_kv_heads):
    ones = torch.ones(1, device="cuda").expand(num_requests, num_kv_heads)
    return {"fa_version": 3, "k_descale": ones, "v_descale": ones, "num_splits": 0}


def batch_of(tree, kinds, context_lens, seed=5, block_size=16):
    return make_batch(tree, kinds, context_lens, [0, 0, 0, 200, 0, 0, 0], num_heads=16, num_kv_heads=2,
                      head_size=256, block_size=block_size, dtype=torch.bfloat16, layout="NHD", seed=seed)


@pytest.mark.parametrize("widths", [[2, 2, 1], [3, 2, 2], [4, 2]])
@pytest.mark.parametrize("block_size", [16, 272])
@pytest.mark.parametrize("mixed", [False, True], ids=["covering", "mixed"])
def test_flash_tree_attention_on_cuda_bf16(widths, block_size, mixed):
    flash = flash_varlen()
    tree = DraftTree.from_widths(widths)
    kinds = ["tree", "decode", "tree", "prefill", "tree"] if mixed else ["tree"] * 6 + ["decode"]
    batch = on_cuda(batch_of(tree, kinds, [300, 17, 5, 0, 1000, 40, 9][: len(kinds)], block_size=block_size))
    key, value = new_key_values(batch)
    key_cache, value_cache = split_kv_cache(batch.kv_cache, batch.head_size)
    table = tree_block_ancestors(tree, "cuda")
    reference = reference_attention(dataclasses.replace(batch, query=batch.query.cpu()))
    seq_lens = batch.seq_lens.cuda()
    common = dict(block_table=batch.block_table, max_seq_len=int(batch.seq_lens.max()), block_ancestors=table,
                  scale=batch.head_size**-0.5)
    if mixed:
        out = reference.to(torch.bfloat16).cuda()  # vLLM's causal launch's rows; the tree rows are overwritten
        tree_rows = batch.tree_token_indices.cuda()
        out[tree_rows] = float("nan")
        rows = batch.tree_requests.cuda()
        tree_query_start_loc = torch.arange(rows.numel() + 1, dtype=torch.int32, device="cuda") * (1 + tree.num_nodes)
        tree_rows_attention(flash, batch.query, key, value, key_cache, value_cache, out,
                            token_indices=tree_rows, request_indices=rows, tree_query_start_loc=tree_query_start_loc,
                            prefix_lens=prefix_lengths(seq_lens[rows], tree_query_start_loc),
                            block_len=1 + tree.num_nodes, prefix_kwargs=prefix_kwargs(rows.numel(), 2), **common)
    else:
        out = torch.full_like(batch.query, float("nan"))
        query_start_loc = batch.query_start_loc.cuda()
        tree_batch_attention(flash, batch.query, key, value, key_cache, value_cache, out,
                             query_start_loc=query_start_loc, prefix_lens=prefix_lengths(seq_lens, query_start_loc),
                             max_query_len=max(batch.query_lens), prefix_kwargs=prefix_kwargs(len(kinds), 2), **common)
    torch.testing.assert_close(out.cpu().double(), reference, atol=2e-2, rtol=2e-2)


def test_the_whole_batch_path_replays_in_a_cuda_graph_on_other_lengths():
    """Captured once (static shapes: the tree, the request count, bounds on lengths), replayed on a batch of other
    committed lengths (0 included) and contents written into the same buffers, the prefix lengths rewritten into
    their buffer outside the graph before the replay (as the hand-over does each step): the replay is tree attention,
    and the padding tokens past the batch keep their output."""
    flash = flash_varlen()
    tree = DraftTree.from_widths([2, 2, 1])
    kinds = ["tree"] * 4 + ["decode"]
    padding = 3
    captured = on_cuda(batch_of(tree, kinds, [900, 500, 700, 300, 200], seed=1))
    replayed = on_cuda(batch_of(tree, kinds, [30, 0, 650, 5, 199], seed=2))
    kv_cache = captured.kv_cache.clone()
    block_table = captured.block_table.clone()
    pad = torch.full((padding, *captured.query.shape[1:]), float("nan"), dtype=torch.bfloat16, device="cuda")
    query = torch.cat([captured.query, pad])
    key, value = (torch.cat([rows, pad[:, : rows.shape[1]]]) for rows in new_key_values(captured))
    seq_lens = captured.seq_lens.cuda()
    query_start_loc = captured.query_start_loc.cuda()
    prefix_lens = torch.zeros_like(seq_lens)
    key_cache, value_cache = split_kv_cache(kv_cache, captured.head_size)
    out = torch.full_like(query, SENTINEL)
    table = tree_block_ancestors(tree, "cuda")

    def body():
        tree_batch_attention(flash, query, key, value, key_cache, value_cache, out,
                             query_start_loc=query_start_loc, prefix_lens=prefix_lens, block_table=block_table,
                             max_query_len=1 + tree.num_nodes, max_seq_len=1000 + 1 + tree.num_nodes,
                             block_ancestors=table, scale=captured.head_size**-0.5,
                             prefix_kwargs=prefix_kwargs(len(kinds), 2))

    prefix_lengths(seq_lens, query_start_loc, out=prefix_lens)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        body()  # warm-up: Triton's compile, FlashAttention's first call
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        body()
    kv_cache.zero_()
    kv_cache[: replayed.kv_cache.shape[0]] = replayed.kv_cache
    block_table.zero_()
    block_table[:, : replayed.block_table.shape[1]] = replayed.block_table
    batch_tokens = replayed.query.shape[0]
    query[:batch_tokens] = replayed.query
    new_key, new_value = new_key_values(replayed)
    key[:batch_tokens] = new_key
    value[:batch_tokens] = new_value
    seq_lens.copy_(replayed.seq_lens)
    prefix_lengths(seq_lens, query_start_loc, out=prefix_lens)
    out.fill_(SENTINEL)
    graph.replay()
    torch.cuda.synchronize()
    reference = reference_attention(dataclasses.replace(replayed, query=replayed.query.cpu()))
    torch.testing.assert_close(out[:batch_tokens].cpu().double(), reference, atol=2e-2, rtol=2e-2)
    assert bool((out[batch_tokens:] == SENTINEL).all())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("flat_output", [False, True], ids=["THD", "T(HD)"])
def test_fused_triton_kernel_equals_its_twin_on_cuda(dtype, flat_output):
    """Blocks, a decode, an empty request and 3 padding tokens; prefixes with keys and without (+inf, NaN rows); the
    prefix log-sum-exp strided; the output `[T, H, D]` or `[T, H * D]`, its padding rows untouched."""
    tree = DraftTree.from_widths([3, 2, 2])
    block_len = 1 + tree.num_nodes
    lengths = [block_len, 1, 0, block_len, block_len]
    cu = torch.tensor([0, *lengths], device="cuda").cumsum(0).to(torch.int32)
    batch_tokens = int(cu[-1])
    num_tokens = batch_tokens + 3
    generator = torch.Generator(device="cuda").manual_seed(0)
    query = torch.randn(num_tokens, 16, 256, device="cuda", generator=generator).to(dtype)
    qkv = torch.randn(num_tokens, 4, 256, device="cuda", generator=generator).to(dtype)
    key, value = qkv[:, :2], qkv[:, 2:]
    prefix_out = torch.randn(num_tokens, 16, 256, device="cuda", generator=generator).to(dtype)
    prefix_lse = (torch.randn(16, num_tokens + 8, device="cuda", generator=generator) * 3)[:, :num_tokens]
    empty = torch.arange(num_tokens, device="cuda") % 4 == 1
    empty[batch_tokens:] = True
    prefix_lse[:, empty] = float("inf")
    prefix_out[empty] = float("nan")
    table = tree_block_ancestors(tree, "cuda")
    output = torch.full((num_tokens, 16 * 256), SENTINEL, dtype=dtype, device="cuda")
    output = output if flat_output else output.view(num_tokens, 16, 256)
    expected = tree_attention_ancestors_torch(query, key, value, cu, table, prefix_out, prefix_lse, output.clone(),
                                              0.0625)
    got = tree_attention_ancestors_triton(query, key, value, cu, table, prefix_out, prefix_lse, output, 0.0625)
    got, expected = got.reshape(num_tokens, -1), expected.reshape(num_tokens, -1)
    assert not got[:batch_tokens].isnan().any()
    torch.testing.assert_close(got[:batch_tokens].float(), expected[:batch_tokens].float(), atol=1e-2, rtol=1e-2)
    assert bool((got[batch_tokens:] == SENTINEL).all())
