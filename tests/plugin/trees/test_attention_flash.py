"""Draft trees on FLASH_ATTN (`trees.attention_flash` through the `trees.attention` forward hook), on CPU: the real
hook and hand-over code end to end, the fused ancestor pass's torch twin (ancestors + merge into the output), and a
torch stand-in for FlashAttention's varlen function in the prefix pass (`paged_prefix_attention_torch`, writing +inf
as the log-sum-exp of a request without committed keys, as FlashAttention 3 does, and NaN in its output rows, which
nothing may read). Tree rows' outputs against the fp64 masked reference, in the three shapes of call: a covering step
(tree rows and one-token decodes, with graph-padding requests and tokens), a capture's dummy run (uniform 1 + N
decode batch, no step), and a mixed batch (vLLM's launch, then the tree rows); the prefix lengths the hand-over
computes once per step (a persistent buffer for covering steps) or a drafting level's layer computes itself. Also the
accepted path's compaction in FlashAttention's view of the cache. Seconds."""

from __future__ import annotations

import dataclasses
import inspect
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.plugin.paged_batches import PagedBatch, empty_cache, make_batch, reference_attention, scattered_block_table
from vllm_treewy.kernels.paged_prefix_attention_torch import paged_prefix_attention_torch
from vllm_treewy.spec_decode.acceptance import accepted_kv_moves_reference
from vllm_treewy.tree import DraftTree
from vllm_treewy.vllm_plugin.trees import attention as tree_attention_hooks
from vllm_treewy.kernels.paged_kv_compaction_triton import compact_paged_kv_triton
from vllm_treewy.vllm_plugin.trees.attention_triton import split_kv_cache
from vllm_treewy.vllm_plugin.trees.metadata import (
    replace_metadata,
    tree_block_ancestors_of,
    tree_prefix_lens_of,
    tree_step_of,
)
from vllm_treewy.vllm_plugin.trees.run_state import TreeRunState
from vllm_treewy.vllm_plugin.trees.step import PagedLayerCaches, find_tree_step

flash_attn = pytest.importorskip("vllm.v1.attention.backends.flash_attn")

torch.set_num_threads(1)  # a shared 2-core machine; the tensors are tiny

TREES = [DraftTree.from_widths([2, 2, 1]), DraftTree.from_widths([3, 2, 2]), DraftTree.from_widths([1, 1, 1])]
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def flash_varlen_stand_in(calls: list, seqused: list):
    """FlashAttention's `flash_attn_varlen_func` as the prefix pass calls it (keywords), in torch; records each
    call's `max_seqlen_q` in `calls` and `seqused_k` in `seqused`."""

    def flash_attn_varlen_func(*, q, k, v, max_seqlen_q, cu_seqlens_q, max_seqlen_k, seqused_k, softmax_scale, causal,
                               block_table, return_softmax_lse, fa_version, k_descale, v_descale, num_splits):
        assert not causal and return_softmax_lse and fa_version == 3
        assert k_descale.shape == (cu_seqlens_q.numel() - 1, k.shape[2]) and v_descale.shape == k_descale.shape
        calls.append(max_seqlen_q)
        seqused.append(seqused_k.clone())
        out, lse = paged_prefix_attention_torch(q, k, v, cu_seqlens_q=cu_seqlens_q, seqused_k=seqused_k,
                                                block_table=block_table, max_seqlen_k=max_seqlen_k,
                                                scale=softmax_scale)
        empty = torch.isinf(lse)  # FlashAttention 3's empty rows: +inf; their output rows may hold anything
        return torch.where(empty.transpose(0, 1)[..., None], float("nan"), out), torch.where(empty, float("inf"), lse)

    return flash_attn_varlen_func


def flash_impl(batch: PagedBatch):
    impl = object.__new__(flash_attn.FlashAttentionImpl)
    impl.scale, impl.head_size, impl.num_kv_heads = batch.head_size**-0.5, batch.head_size, batch.keys[0].shape[1]
    impl.vllm_flash_attn_version = 3
    return impl


def flash_metadata(batch: PagedBatch, padded_requests: int = 0, padded_tokens: int = 0):
    """vLLM's FlashAttentionMetadata of the batch, with graph padding: empty requests (seq_len 0) past the batch."""
    query_start_loc = torch.cat([batch.query_start_loc, batch.query_start_loc[-1:].expand(padded_requests)])
    seq_lens = torch.cat([batch.seq_lens, torch.zeros(padded_requests, dtype=torch.int32)])
    table = torch.cat([batch.block_table, torch.zeros(padded_requests, batch.block_table.shape[1], dtype=torch.int32)])
    num_tokens = int(batch.query_start_loc[-1]) + padded_tokens
    return flash_attn.FlashAttentionMetadata(
        num_actual_tokens=num_tokens, max_query_len=max(batch.query_lens), query_start_loc=query_start_loc,
        max_seq_len=int(seq_lens.max()), seq_lens=seq_lens, block_table=table,
        slot_mapping=torch.zeros(num_tokens, dtype=torch.long))


def new_key_values(batch: PagedBatch, padded_tokens: int):
    keys = torch.cat([k[c:] for k, c in zip(batch.keys, batch.context_lens)])
    values = torch.cat([v[c:] for v, c in zip(batch.values, batch.context_lens)])
    pad = torch.full((padded_tokens, *keys.shape[1:]), float("nan"), dtype=keys.dtype)
    return torch.cat([keys, pad]), torch.cat([values, pad])


def tree_step_of_batch(batch: PagedBatch):
    drafts = np.array([batch.tree.num_nodes if kind == "tree" else -1 if kind == "prefill" else 0
                       for kind in batch.kinds])
    step = find_tree_step(batch.tree, drafts, np.maximum(drafts, 0), batch.query_start_loc.numpy(),
                          np.array(batch.context_lens), torch.device("cpu"))
    step.covers_batch = "prefill" not in batch.kinds
    return step


def run_hook(batch: PagedBatch, monkeypatch, *, step, prepared=True, padded_requests=0, padded_tokens=0,
             marking=None):
    """The step's tree handed to the layer's metadata (`hand_tree_to_attention_layers`; `marking(state, per_layer)`
    instead: another hand-over, such as a drafting level's), then the wrapped forward. vLLM's own launch
    (`original`) writes the reference with the tree rows NaN: any tree row the hook leaves is caught; a covering step
    or a capture must not call it. Returns (output, metadata, prefix calls' max_seqlen_q, vLLM launches, prefix
    calls' seqused_k)."""
    calls, launches, seqused = [], [], []
    monkeypatch.setattr(flash_attn, "flash_attn_varlen_func", flash_varlen_stand_in(calls, seqused), raising=False)
    layers = {"attn": SimpleNamespace(kv_cache=batch.kv_cache, _k_scale=torch.tensor(1.0),
                                      _v_scale=torch.tensor(1.0))}
    per_layer = {"attn": flash_metadata(batch, padded_requests, padded_tokens)}
    state = TreeRunState(batch.tree)
    if marking is None:
        tree_attention_hooks.hand_tree_to_attention_layers(state, layers, per_layer, step, prepared,
                                                           torch.device("cpu"))
    else:
        marking(state, per_layer)
    metadata = per_layer["attn"]
    expected = reference_attention(batch).to(batch.query.dtype)
    tree_rows = torch.tensor([kind == "tree" for kind, n in zip(batch.kinds, batch.query_lens) for _ in range(n)])

    def original(self, layer, query, key, value, kv_cache, attn_metadata, output):
        launches.append(True)
        output[: expected.shape[0]] = torch.where(tree_rows[:, None, None], float("nan"), expected)
        return output

    query = torch.cat([batch.query, torch.randn(padded_tokens, *batch.query.shape[1:]).to(batch.query.dtype)])
    key, value = new_key_values(batch, padded_tokens)
    output = torch.full_like(query, -7.0)
    forward = tree_attention_hooks._attending_tree_rows_flash(original)
    forward(flash_impl(batch), layers["attn"], query, key, value, batch.kv_cache, metadata, output)
    return output, metadata, calls, launches, seqused


def assert_rows(batch, output, padded_tokens, dtype):
    expected = reference_attention(batch)
    torch.testing.assert_close(output[: expected.shape[0]].double(), expected, atol=TOLERANCE[dtype], rtol=0)
    assert bool((output[expected.shape[0]:] == -7.0).all())  # graph-padding tokens left as they were
    assert padded_tokens == output.shape[0] - expected.shape[0]


def fast(max_examples: int) -> settings:
    return settings(max_examples=max_examples, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@fast(12)
@given(tree=st.sampled_from(TREES), kinds=st.lists(st.sampled_from(["tree", "tree", "decode"]), min_size=1,
                                                    max_size=3),
       context=st.integers(1, 20), padded_requests=st.integers(0, 2), padded_tokens=st.integers(0, 3),
       heads=st.sampled_from([(2, 1), (4, 2)]), dtype=st.sampled_from(list(TOLERANCE)), layout=st.sampled_from(
           ["HND", "NHD"]), seed=st.integers(0, 999))
def test_covering_step_runs_the_two_passes_for_the_whole_batch(tree, kinds, context, padded_requests, padded_tokens,
                                                              heads, dtype, layout, seed):
    """Tree rows and one-token decodes (a FULL graph's replay): the ancestor table and the prefix lengths on the
    metadata, no tree step, vLLM's launch replaced; graph-padding requests (no keys: +inf log-sum-exp, NaN prefix
    rows) and tokens change nothing."""
    kinds = kinds if "tree" in kinds else ["tree", *kinds]
    batch = make_batch(tree, kinds, [context + 3 * r for r in range(len(kinds))], None, num_heads=heads[0],
                       num_kv_heads=heads[1], head_size=16, block_size=8, dtype=dtype, layout=layout, seed=seed)
    with pytest.MonkeyPatch.context() as monkeypatch:
        output, metadata, calls, launches, seqused = run_hook(batch, monkeypatch, step=tree_step_of_batch(batch),
                                                              padded_requests=padded_requests,
                                                              padded_tokens=padded_tokens)
    assert tree_step_of(metadata) is None and tree_block_ancestors_of(metadata) is not None
    assert not launches and calls == [max(batch.query_lens)]
    prefix_lens = [*batch.context_lens, *[0] * padded_requests]
    assert tree_prefix_lens_of(metadata).tolist() == prefix_lens and [s.tolist() for s in seqused] == [prefix_lens]
    assert_rows(batch, output, padded_tokens, dtype)


def test_capture_dummy_run_of_a_uniform_tree_batch_takes_the_same_path(monkeypatch):
    """A CUDA-graph capture's dummy run (not prepared, no step, max_query_len 1 + N): the ancestor table, as a
    covering step gets it, so the captured graph replays the two passes; here with requests of no committed keys."""
    tree = TREES[0]
    batch = make_batch(tree, ["tree", "tree"], [0, 5], None, num_heads=4, num_kv_heads=2, head_size=16,
                       block_size=8, dtype=torch.float32, layout="NHD")
    output, metadata, calls, launches, seqused = run_hook(batch, monkeypatch, step=None, prepared=False,
                                                          padded_requests=1)
    assert tree_block_ancestors_of(metadata) is not None and not launches
    assert tree_prefix_lens_of(metadata).tolist() == [0, 5, 0]
    assert_rows(batch, output, 0, torch.float32)


def test_a_drafting_levels_layer_computes_its_own_prefix_lengths(monkeypatch):
    """A drafting level's hand-over (`uniform_tree_marking` without lengths: V2's level graphs write the lengths
    inside the graph, after the metadata is built): no prefix lengths on the metadata; the layer computes them from
    the metadata's own lengths and runs the same two passes."""
    tree = TREES[1]
    batch = make_batch(tree, ["tree", "tree", "tree"], [7, 0, 12], None, num_heads=4, num_kv_heads=2, head_size=16,
                       block_size=8, dtype=torch.float32, layout="NHD")

    def level_marking(state, per_layer):
        replace_metadata(per_layer, tree_attention_hooks.uniform_tree_marking(state, tree, torch.device("cpu")))

    output, metadata, calls, launches, seqused = run_hook(batch, monkeypatch, step=None, padded_requests=1,
                                                          marking=level_marking)
    assert tree_block_ancestors_of(metadata) is not None and tree_prefix_lens_of(metadata) is None and not launches
    assert [s.tolist() for s in seqused] == [[7, 0, 12, 0]]
    assert_rows(batch, output, 0, torch.float32)


def test_prefix_lengths_go_into_a_mirror_of_vllms_length_buffer():
    """`TreeRunState.prefix_lens`: the lengths of a view of vLLM's persistent `seq_lens` buffer land at the same offset
    of one buffer of the same size, every step (a FULL graph reads them at the address it was captured with); a
    micro-batch's slice lands beside the first's; another vLLM buffer gets its own."""
    state = TreeRunState(TREES[0])
    seq_lens = torch.zeros(8, dtype=torch.int32)  # vLLM's persistent buffer (max_num_reqs)
    query_start_loc = torch.zeros(9, dtype=torch.int32)

    def step(lengths, query_lens, rows):
        seq_lens[rows] = torch.tensor(lengths, dtype=torch.int32)
        query_start_loc[rows.start : rows.stop + 1] = torch.tensor([0, *query_lens]).cumsum(0)
        return state.prefix_lens(seq_lens[rows], query_start_loc[rows.start : rows.stop + 1])

    first = step([10, 6, 0], [6, 1, 0], slice(0, 3))  # a tree row, a decode, a graph's padding request
    assert first.tolist() == [4, 5, 0] and first.dtype == torch.int32
    second = step([30, 7, 9, 1], [6, 6, 1, 1], slice(0, 4))
    assert second.tolist() == [24, 1, 8, 0] and second.data_ptr() == first.data_ptr()
    micro = step([20, 8], [6, 1], slice(4, 6))
    assert micro.tolist() == [14, 7] and micro.data_ptr() == first.data_ptr() + 4 * 4
    assert second.tolist() == [24, 1, 8, 0]  # the first micro-batch's lengths kept
    other = state.prefix_lens(torch.tensor([9], dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32))
    assert other.tolist() == [8] and len(state.prefix_lens_buffers) == 2


def test_metadata_objects_sharing_their_lengths_share_one_computation():
    """Two KV-cache groups' FLASH_ATTN metadata over one step (vLLM's shared `seq_lens` and `query_start_loc`): the
    hand-over computes the prefix lengths once, both carry the same tensor."""
    batch = make_batch(TREES[0], ["tree", "decode"], [4, 3], None, num_heads=2, num_kv_heads=1, head_size=16,
                       block_size=8, dtype=torch.float32, layout="NHD")
    shared = flash_metadata(batch)
    per_layer = {"a": shared, "b": dataclasses.replace(shared)}
    layers = {name: SimpleNamespace(kv_cache=batch.kv_cache) for name in per_layer}
    step = tree_step_of_batch(batch)
    tree_attention_hooks.hand_tree_to_attention_layers(TreeRunState(batch.tree), layers, per_layer, step, True,
                                                       torch.device("cpu"))
    assert per_layer["a"] is not per_layer["b"]
    assert tree_prefix_lens_of(per_layer["a"]) is tree_prefix_lens_of(per_layer["b"])
    assert tree_prefix_lens_of(per_layer["a"]).tolist() == [4, 3]


def test_a_real_step_without_tree_rows_keeps_vllms_launch(monkeypatch):
    batch = make_batch(TREES[0], ["decode", "prefill"], [4, 0], [None, 6], num_heads=2, num_kv_heads=1,
                       head_size=16, block_size=8, dtype=torch.float32, layout="NHD")
    output, metadata, calls, launches, seqused = run_hook(batch, monkeypatch, step=None, prepared=True)
    assert tree_block_ancestors_of(metadata) is None and launches and not calls
    assert_rows(batch, output, 0, torch.float32)


@fast(8)
@given(tree=st.sampled_from(TREES), heads=st.sampled_from([(2, 1), (4, 4)]), dtype=st.sampled_from(list(TOLERANCE)),
       seed=st.integers(0, 999))
def test_mixed_batch_overwrites_the_tree_rows_after_vllms_launch(tree, heads, dtype, seed):
    """A batch with a prefill chunk (attention outside CUDA graphs): vLLM's causal launch, then the two passes over
    the tree rows alone overwrite theirs; the prefill and decode rows keep vLLM's."""
    batch = make_batch(tree, ["prefill", "tree", "decode", "tree"], [3, 9, 4, 1], [5, None, None, None],
                       num_heads=heads[0], num_kv_heads=heads[1], head_size=16, block_size=8, dtype=dtype,
                       layout="HND", seed=seed)
    step = tree_step_of_batch(batch)
    with pytest.MonkeyPatch.context() as monkeypatch:
        output, metadata, calls, launches, seqused = run_hook(batch, monkeypatch, step=step)
    assert tree_step_of(metadata) is step and launches and calls == [1 + tree.num_nodes]
    assert tree_prefix_lens_of(metadata).tolist() == [9, 1] and [s.tolist() for s in seqused] == [[9, 1]]
    assert [type(layer) for layer in step.attention_layers] == [PagedLayerCaches]  # recorded for the compaction
    assert_rows(batch, output, 0, dtype)


def test_flash_forward_views_the_cache_as_the_compaction_moves_it():
    """vLLM 0.32's FlashAttentionImpl attends over `kv_cache.transpose(1, 2).split(head_size, -1)`, TRITON_ATTN's
    view: `kernels.paged_kv_compaction_*` is the compaction of both (`trees.attention_flash`)."""
    source = inspect.getsource(flash_attn.FlashAttentionImpl.forward)
    assert "kv_cache.transpose(1, 2).split(self.head_size, dim=-1)" in source


@pytest.mark.parametrize("layout", ["HND", "NHD"])
def test_compaction_in_flash_attentions_view(layout):
    """After the compaction, FlashAttention's key and value views hold each request's root and accepted path at
    positions root .. root + n (the reference moves); every other slot unchanged. The kernel CUDA runs (interpreted)."""
    tree, block_size, head_size = TREES[1], 8, 16
    generator = torch.Generator().manual_seed(3)
    roots = torch.tensor([5, 13, 0])
    table, num_blocks = scattered_block_table(3, (roots + 1 + tree.num_nodes).tolist(), block_size, generator)
    cache = empty_cache(num_blocks, 2, block_size, 2 * head_size, torch.bfloat16, layout, fill=0.0)
    cache.copy_(torch.randn(cache.shape, generator=generator).to(torch.bfloat16))
    paths = torch.tensor([[0, 3, 9], [2, -1, -1], [1, 5, -1]])  # local nodes of the [3, 2, 2] tree, -1 padded
    before = [view.clone() for view in split_kv_cache(cache, head_size)]
    compact_paged_kv_triton(cache, table, paths, roots)
    for got, original in zip(split_kv_cache(cache, head_size), before):
        expected = original.clone()
        for r, path in enumerate(paths.tolist()):
            for source, destination in accepted_kv_moves_reference([n for n in path if n >= 0], int(roots[r])):
                expected[table[r, destination // block_size], destination % block_size] = original[
                    table[r, source // block_size], source % block_size]
        assert torch.equal(got, expected)


def test_check_flash_tree_support_names_what_it_refuses():
    impl = object.__new__(flash_attn.FlashAttentionImpl)
    impl.vllm_flash_attn_version, impl.kv_cache_dtype, impl.sliding_window = 3, "auto", (-1, -1)
    impl.alibi_slopes, impl.logits_soft_cap, impl.sinks, impl.dcp_world_size = None, None, None, 1
    impl.kv_sharing_target_layer_name = None
    impl.attn_type = tree_attention_hooks.AttentionType.DECODER
    tree_attention_hooks.check_flash_tree_support(impl)
    impl.vllm_flash_attn_version, impl.kv_cache_dtype, impl.logits_soft_cap = 4, "fp8", 30.0
    with pytest.raises(NotImplementedError, match="FlashAttention version 4.*fp8.*soft cap.*TRITON_ATTN"):
        tree_attention_hooks.check_flash_tree_support(impl)


def test_check_tree_backends_accepts_flash_attn_and_names_the_supported_backends(monkeypatch):
    """On CUDA (platform stood in), FLASH_ATTN layers pass with supported settings and are refused with what is
    wrong; a layer of another backend is refused naming FLASH_ATTN and TRITON_ATTN."""
    from vllm.config import CUDAGraphMode
    from vllm.platforms import current_platform

    monkeypatch.setattr(current_platform, "is_cpu", lambda: False)
    impl = object.__new__(flash_attn.FlashAttentionImpl)
    impl.vllm_flash_attn_version, impl.kv_cache_dtype, impl.sliding_window = 3, "auto", (-1, -1)
    impl.alibi_slopes, impl.logits_soft_cap, impl.sinks, impl.dcp_world_size = None, 0.0, None, 1
    impl.kv_sharing_target_layer_name, impl.attn_type = None, tree_attention_hooks.AttentionType.DECODER
    config = SimpleNamespace(cudagraph_mode=CUDAGraphMode.FULL_AND_PIECEWISE,
                             static_forward_context={"attn": SimpleNamespace(impl=impl)})
    metadata = object.__new__(flash_attn.FlashAttentionMetadata)
    tree_attention_hooks.check_tree_backends(config, {"attn": metadata})
    impl.sliding_window = (127, 0)
    with pytest.raises(NotImplementedError, match="sliding window"):
        tree_attention_hooks.check_tree_backends(config, {"attn": metadata})
    with pytest.raises(ValueError, match=r"layer attn runs SimpleNamespace.*FLASH_ATTN.*TRITON_ATTN"):
        tree_attention_hooks.check_tree_backends(config, {"attn": SimpleNamespace()})
