"""The runner wiring of draft trees for vLLM's TRITON_ATTN backend (`v1.runner`), on this CPU machine.

vLLM's own `TritonAttentionImpl.forward` runs under our wrapper, with vLLM's kernel under the Triton interpreter
standing in for the compiled one (`vllm_interpreted.interpreted_unified_attention`) behind the module global that
forward launches: for a batch the step covers (tree rows and one-token decodes), the bias rides into vLLM's launch;
for a mixed batch the tree rows are recomputed after it. Both against the fp64 reference of
`trees/test_attention_triton`.
"""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import vllm.v1.attention.backends.triton_attn as triton_attn
from hypothesis import given
from hypothesis import strategies as st
from vllm.forward_context import ForwardContext, override_forward_context
from vllm.v1.attention.backends.triton_attn import TritonAttentionImpl, TritonAttentionMetadata

from tests.plugin.paged_batches import make_batch, reference_attention
from tests.plugin.trees.test_attention_triton import batch_shapes, fast, tolerance
from tests.plugin.vllm_interpreted import interpreted_unified_attention
from vllm_treewy.tree import DraftTree
from vllm_treewy.vllm_plugin.v1 import runner as v1_runner
from vllm_treewy.vllm_plugin.patch_points import TRITON_ATTENTION_FORWARD, TRITON_UNIFIED_ATTENTION
from vllm_treewy.vllm_plugin.trees.metadata import tree_qq_bias_of, tree_step_of
from vllm_treewy.vllm_plugin.trees.run_state import TreeRunState
from vllm_treewy.vllm_plugin.trees.sampling import commit_accepted_path
from vllm_treewy.vllm_plugin.trees.step import PagedLayerCaches, find_tree_step
from vllm_treewy.vllm_plugin.trees import attention as tree_attention_hooks

torch.set_num_threads(1)


def tree_step_of_batch(batch):
    """The step `_prepare_inputs` finds in the batch (vLLM's per-request counts for its kinds)."""
    n = batch.tree.num_nodes
    num_decode_drafts = np.array([n if k == "tree" else 0 if k == "decode" else -1 for k in batch.kinds])
    num_drafts = np.array([n if k == "tree" else 0 for k in batch.kinds])
    query_start_loc = batch.query_start_loc.numpy()
    step = find_tree_step(batch.tree, num_decode_drafts, num_drafts, query_start_loc,
                          np.array(batch.context_lens), torch.device("cpu"))
    step.covers_batch = v1_runner.covers_batch(step, query_start_loc, len(batch.kinds))
    return step


def triton_metadata(batch, max_query_len=None) -> TritonAttentionMetadata:
    seq_lens = batch.seq_lens
    return TritonAttentionMetadata(
        num_actual_tokens=batch.query.shape[0], max_query_len=max_query_len or max(batch.query_lens),
        query_start_loc=batch.query_start_loc, max_seq_len=int(seq_lens.max()), seq_lens=seq_lens,
        block_table=batch.block_table, slot_mapping=torch.empty(0, dtype=torch.long), seq_threshold_3D=0,
        num_par_softmax_segments=0, softmax_segm_output=None, softmax_segm_max=None, softmax_segm_expsum=None,
        causal=True)


def hand_tree_to_attention_layers(tree_state, layers, per_layer, step, prepared):
    tree_attention_hooks.hand_tree_to_attention_layers(tree_state, layers, per_layer, step, prepared, torch.device("cpu"))
    return per_layer


def one_layer(kv_cache) -> dict:
    return {"attn.0": SimpleNamespace(kv_cache=kv_cache)}


@contextlib.contextmanager
def forward_context():
    """vLLM's forward context, as the runner sets it around a forward (the tree bias travels in it)."""
    context = ForwardContext(no_compile_layers={}, attn_metadata={}, slot_mapping={})
    with override_forward_context(context):
        yield context


@pytest.fixture(scope="module")
def interpreted_triton_attention():
    """vLLM's forward launches the interpreted kernel through our qq_bias wrapper, as `install()` arranges on CUDA."""
    launch = tree_attention_hooks._passing_qq_bias(interpreted_unified_attention())
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(triton_attn, "unified_attention", launch)
        patch.setattr(tree_attention_hooks, "TRITON_UNIFIED_ATTENTION", SimpleNamespace(resolve=lambda: launch))
        yield tree_attention_hooks._attending_tree_rows_triton(TRITON_ATTENTION_FORWARD.original())


# every (prefills, sinks) pair each run: the sinks reach both vLLM's launch and the tree rows' own (mixed batches)
@pytest.mark.parametrize("sinks", [False, True], ids=["no sinks", "sinks"])
@pytest.mark.parametrize("with_prefills", [False, True], ids=["trees and decodes", "with prefills"])
@fast(5)
@given(data=st.data())
def test_vllms_triton_forward_under_the_wrapper_is_tree_attention(interpreted_triton_attention, with_prefills, sinks,
                                                                  data):
    shape = data.draw(batch_shapes(with_prefills=with_prefills))
    shape["dtype"] = torch.float32
    batch = make_batch(**shape)
    step = tree_step_of_batch(batch)
    metadata = triton_metadata(batch)
    state = TreeRunState(batch.tree)
    metadata = hand_tree_to_attention_layers(state, one_layer(batch.kv_cache), {"attn.0": metadata}, step, True)["attn.0"]
    covering = "prefill" not in batch.kinds or all(q <= 1 for k, q in zip(batch.kinds, batch.query_lens)
                                                    if k == "prefill")
    assert step.covers_batch == covering
    assert (tree_qq_bias_of(metadata) is not None) == covering
    assert (tree_step_of(metadata) is step) == (not covering)
    assert [layer.kv_cache for layer in step.attention_layers] == [batch.kv_cache]

    num_heads, num_kv_heads, head_size = shape["num_heads"], shape["num_kv_heads"], shape["head_size"]
    impl = TritonAttentionImpl(num_heads=num_heads, head_size=head_size, scale=head_size**-0.5,
                               num_kv_heads=num_kv_heads, alibi_slopes=None, sliding_window=None, kv_cache_dtype="auto",
                               sinks=torch.randn(num_heads) if sinks else None)  # weights comparable to a key's
    layer = SimpleNamespace(_k_scale=torch.tensor(1.0), _v_scale=torch.tensor(1.0), _q_scale=torch.tensor(1.0))
    output = torch.full_like(batch.query, float("nan"))  # vLLM's Attention layer hands [T, heads, head_size]
    with forward_context() as context:
        interpreted_triton_attention(impl, layer, batch.query, None, None, batch.kv_cache, metadata, output)
    torch.testing.assert_close(output.double(), reference_attention(batch, impl.sinks),
                               **tolerance(torch.float32))
    assert tree_attention_hooks.QQ_BIAS_KEY not in context.additional_kwargs  # held only during the launch


def test_a_capture_dummy_run_of_uniform_decodes_takes_the_bias_and_others_do_not():
    tree = DraftTree.from_widths([2, 2])
    batch = make_batch(tree, ["tree", "tree"], [4, 9], [0, 0], num_heads=2, num_kv_heads=1, head_size=32,
                       block_size=16, dtype=torch.float32, layout="NHD")
    state, layers = TreeRunState(tree), one_layer(batch.kv_cache)
    # "c": a uniform decode of the chain of the tree's depth (draft_tree_max_batch_size's larger batches: causal)
    built = hand_tree_to_attention_layers(state, layers, {"a": triton_metadata(batch),
                                                  "b": triton_metadata(batch, max_query_len=64),
                                                  "c": triton_metadata(batch, max_query_len=1 + tree.max_depth)},
                                  None, False)
    bias = tree_qq_bias_of(built["a"])
    assert bias.shape[1] == 1 + tree.num_nodes and tree_qq_bias_of(built["b"]) is None
    assert tree_qq_bias_of(built["c"]) is None
    # A real step without tree rows (prepared) never takes it; the bias is built once per runner.
    assert tree_qq_bias_of(hand_tree_to_attention_layers(state, layers, {"a": triton_metadata(batch)}, None, True)["a"]) is None
    again = hand_tree_to_attention_layers(state, layers, {"a": triton_metadata(batch)}, None, False)["a"]
    assert tree_qq_bias_of(again) is bias


def test_layers_sharing_a_cache_are_compacted_once():
    tree = DraftTree.from_widths([2])
    batch = make_batch(tree, ["tree"], [4], [0], num_heads=2, num_kv_heads=1, head_size=32, block_size=16,
                       dtype=torch.float32, layout="NHD")
    layers = {**one_layer(batch.kv_cache), "attn.1": SimpleNamespace(kv_cache=batch.kv_cache)}
    step = tree_step_of_batch(batch)
    hand_tree_to_attention_layers(TreeRunState(tree), layers, {"attn.0": triton_metadata(batch),
                                                       "attn.1": triton_metadata(batch)}, step, True)
    assert len(step.attention_layers) == 1


def test_covers_batch_counts_queries_longer_than_one():
    step = SimpleNamespace(num_requests=2)
    assert v1_runner.covers_batch(step, np.array([0, 5, 6, 11, 12]), 4)  # tree, decode, tree, one-token chunk
    assert not v1_runner.covers_batch(step, np.array([0, 5, 7, 12]), 3)  # a 2-token prefill chunk
    assert not v1_runner.covers_batch(None, np.array([0, 1]), 1)


def test_unsupported_triton_layers_are_refused():
    impl = TritonAttentionImpl(num_heads=2, head_size=32, scale=1.0, num_kv_heads=1, alibi_slopes=None,
                               sliding_window=128, kv_cache_dtype="fp8")
    with pytest.raises(NotImplementedError, match="kv_cache_dtype 'fp8'.*sliding window"):
        tree_attention_hooks.check_triton_tree_support(impl)
    plain = TritonAttentionImpl(num_heads=2, head_size=32, scale=1.0, num_kv_heads=1, alibi_slopes=None,
                                sliding_window=None, kv_cache_dtype="bfloat16")
    tree_attention_hooks.check_triton_tree_support(plain)


def test_backends_other_than_triton_and_full_graphs_for_mixed_batches_are_refused(monkeypatch):
    from vllm.config import CUDAGraphMode
    from vllm.platforms import current_platform

    monkeypatch.setattr(current_platform, "is_cpu", lambda: False)
    plain = TritonAttentionImpl(num_heads=2, head_size=32, scale=1.0, num_kv_heads=1, alibi_slopes=None,
                                sliding_window=None, kv_cache_dtype="bfloat16")
    runner = SimpleNamespace(compilation_config=SimpleNamespace(cudagraph_mode=CUDAGraphMode.FULL_AND_PIECEWISE,
                                                                static_forward_context={"attn": SimpleNamespace(
                                                                    impl=plain)}))
    tree_attention_hooks.check_tree_backends(runner.compilation_config, {"attn": object.__new__(TritonAttentionMetadata)})
    runner.compilation_config.static_forward_context["attn"].impl = TritonAttentionImpl(
        num_heads=2, head_size=32, scale=1.0, num_kv_heads=1, alibi_slopes=None, sliding_window=128,
        kv_cache_dtype="bfloat16")
    with pytest.raises(NotImplementedError, match="sliding window"):
        tree_attention_hooks.check_tree_backends(runner.compilation_config, {"attn": object.__new__(TritonAttentionMetadata)})
    runner.compilation_config.static_forward_context["attn"].impl = plain
    with pytest.raises(ValueError, match="TRITON_ATTN"):
        tree_attention_hooks.check_tree_backends(runner.compilation_config, {"attn": SimpleNamespace()})
    runner.compilation_config.cudagraph_mode = CUDAGraphMode.FULL
    with pytest.raises(ValueError, match="FULL_AND_PIECEWISE"):
        tree_attention_hooks.check_tree_backends(runner.compilation_config, {"attn": object.__new__(TritonAttentionMetadata)})


def test_commit_accepted_path_compacts_recorded_triton_layers():
    tree = DraftTree.from_widths([2, 2])  # nodes 0, 1; 2, 3 below 0; 4, 5 below 1
    cache = torch.zeros(3, 1, 16, 4)
    tokens = cache.transpose(1, 2)
    for position in range(16):
        tokens[1, position] = position
    step = SimpleNamespace(attention_layers=[PagedLayerCaches(cache, torch.tensor([[1, 0]]))],
                           root_positions=torch.tensor([5]))
    commit_accepted_path(step, SimpleNamespace(accepted_nodes=torch.tensor([[1, 5]])))
    assert tokens[1, 6, 0, 0] == 7 and tokens[1, 7, 0, 0] == 11  # node 1 at 7 -> 6, node 5 at 11 -> 7
    assert list(tree.parents)[5] == 1  # the accepted path 1 -> 5 is one of the tree's


def test_commit_accepted_path_compacts_layers_sharing_a_block_table_in_one_call(monkeypatch):
    """Layers that share their tree rows' block table (one KV-cache group, as `hand_tree_to_attention_layers` records them)
    are compacted by ONE `compact_paged_kv_torch` call with all their caches (the moves computed once per table);
    each cache ends as compacting it alone leaves it; a CPU-layout layer is still compacted on its own."""
    from vllm_treewy.vllm_plugin.trees import sampling as tree_sampling
    from vllm_treewy.vllm_plugin.trees.step import AttentionLayerCaches

    generator = torch.Generator().manual_seed(3)
    shared, other = torch.tensor([[1, 0], [2, 3]]), torch.tensor([[0, 2], [3, 1]])
    caches = [torch.randn(4, 1, 16, 4, generator=generator) for _ in range(4)]
    layers = [PagedLayerCaches(caches[0], shared), PagedLayerCaches(caches[1], other),
              PagedLayerCaches(caches[2], shared), PagedLayerCaches(caches[3], other)]
    key_cache, value_cache = (torch.randn(8, 1, 16, 2, generator=generator) for _ in range(2))
    cpu_layer = AttentionLayerCaches(key_cache, value_cache, torch.tensor([[0, 1], [2, 3]]), "vec")
    accepted = torch.tensor([[1, 5], [0, 2]])  # tree [2, 2]: 1 -> 5 (both moved), 0 -> 2 (2 moved)
    roots = torch.tensor([5, 17])
    expected = [c.clone() for c in caches]
    originals = [c.clone() for c in caches]
    for cache, layer in zip(expected, layers):
        tree_sampling.compact_paged_kv_torch(cache, layer.block_table, accepted, roots)
    expected_cpu = (key_cache.clone(), value_cache.clone())
    tree_sampling.compact_accepted_kv(*expected_cpu, cpu_layer.block_table, accepted, roots, isa="vec")
    calls = []
    compact = tree_sampling.compact_paged_kv_torch
    monkeypatch.setattr(tree_sampling, "compact_paged_kv_torch",
                        lambda kv_caches, table, *args: (calls.append((list(kv_caches), table)),
                                                         compact(kv_caches, table, *args))[1])
    step = SimpleNamespace(attention_layers=[layers[0], cpu_layer, *layers[1:]], root_positions=roots)
    commit_accepted_path(step, SimpleNamespace(accepted_nodes=accepted))
    assert [(len(kv), table is shared) for kv, table in calls] == [(2, True), (2, False)]
    assert calls[0][0][0] is caches[0] and calls[0][0][1] is caches[2] and calls[1][0][1] is caches[3]
    for cache, want in zip(caches, expected):
        assert torch.equal(cache, want)
    assert torch.equal(key_cache, expected_cpu[0]) and torch.equal(value_cache, expected_cpu[1])
    assert not any(torch.equal(want, before) for want, before in zip(expected, originals))  # every cache moved


def test_vllms_triton_forward_launches_the_module_global_with_a_qq_bias_parameter():
    """What the qq_bias route relies on: forward calls the `unified_attention` name of its module (which the plugin
    wraps), and that function still takes `qq_bias`."""
    import inspect

    forward = TRITON_ATTENTION_FORWARD.original()
    assert "unified_attention" in forward.__code__.co_names
    assert "qq_bias" in inspect.signature(TRITON_UNIFIED_ATTENTION.original()).parameters
