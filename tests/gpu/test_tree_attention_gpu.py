"""Tree attention through vLLM's compiled `unified_attention` with the tree `qq_bias`, and the KV compaction, on CUDA in
bf16 at Qwen3.5 full-attention sizes, compiled (the interpreter tests in `tests/plugin/trees/test_attention_triton.py`
run the same kernel on CPU at small sizes). Run on the H200: `pytest -m gpu tests/gpu`."""

import dataclasses

import pytest
import torch

from vllm_treewy.tree import DraftTree

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

from tests.plugin.paged_batches import make_batch, reference_attention  # noqa: E402
from vllm_treewy.vllm_plugin.trees.attention_triton import (  # noqa: E402
    split_kv_cache,
    tree_qq_bias,
    tree_rows_attention,
)


def on_cuda(batch):
    moved = {f.name: getattr(batch, f.name) for f in dataclasses.fields(batch)}
    for name in ("query", "kv_cache", "block_table"):
        moved[name] = moved[name].cuda()
    return type(batch)(**moved)


def launch(batch, qq_bias):
    from vllm.v1.attention.ops.triton_unified_attention import unified_attention

    key_cache, value_cache = split_kv_cache(batch.kv_cache, batch.head_size)
    out = torch.full_like(batch.query, float("nan"))
    ones = torch.ones(len(batch.kinds), key_cache.shape[2], device="cuda")
    unified_attention(q=batch.query, k=key_cache, v=value_cache, out=out, cu_seqlens_q=batch.query_start_loc.cuda(),
                      max_seqlen_q=max(batch.query_lens), seqused_k=batch.seq_lens.cuda(),
                      max_seqlen_k=int(batch.seq_lens.max()), softmax_scale=batch.head_size**-0.5, causal=True,
                      window_size=(-1, -1), block_table=batch.block_table, softcap=0, q_descale=None,
                      k_descale=ones, v_descale=ones, qq_bias=qq_bias)
    return out


@pytest.mark.parametrize("widths", [[2, 1, 1], [2, 2, 1], [3, 2, 2], [4, 2]])
@pytest.mark.parametrize("block_size", [16, 272])
@pytest.mark.parametrize("mixed", [False, True], ids=["covering", "mixed"])
def test_tree_attention_on_cuda_bf16(widths, block_size, mixed):
    from vllm.v1.attention.ops.triton_unified_attention import unified_attention

    tree = DraftTree.from_widths(widths)
    kinds = ["tree", "decode", "tree", "prefill", "tree"] if mixed else ["tree"] * 6 + ["decode"]
    context_lens = [300, 17, 5, 0, 1000, 40, 9][: len(kinds)]
    batch = make_batch(tree, kinds, context_lens, [0, 0, 0, 200, 0, 0, 0], num_heads=16, num_kv_heads=2,
                       head_size=256, block_size=block_size, dtype=torch.bfloat16, layout="NHD", seed=5)
    batch = on_cuda(batch)
    bias = tree_qq_bias(tree, "cuda")
    if mixed:
        out = launch(batch, None)
        key_cache, value_cache = split_kv_cache(batch.kv_cache, batch.head_size)
        rows = batch.tree_requests.cuda()
        tree_rows_attention(unified_attention, batch.query, key_cache, value_cache, out,
                            token_indices=batch.tree_token_indices.cuda(), request_indices=rows,
                            tree_query_start_loc=torch.arange(rows.numel() + 1, dtype=torch.int32,
                                                              device="cuda") * (1 + tree.num_nodes),
                            seq_lens=batch.seq_lens.cuda(), block_table=batch.block_table,
                            block_len=1 + tree.num_nodes, max_seq_len=int(batch.seq_lens.max()),
                            scale=batch.head_size**-0.5, qq_bias=bias)
    else:
        out = launch(batch, bias)
    batch.query = batch.query.cpu()
    torch.testing.assert_close(out.cpu().double(), reference_attention(batch), atol=2e-2, rtol=2e-2)
