"""The batched per-node serial tree (the store_all tree baseline on CPU) against the fp64 per-node reference, on
packed batches of random trees, shapes, gates and head counts; requests of fewer nodes than the static block too."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_treewy.kernels.reference import reference_tree_conv, reference_tree_recurrence
from vllm_treewy.kernels.serial_tree import serial_tree_conv, serial_tree_states

from .tree_cases import GATE_RANGES, gdn_inputs, relative_error, trees

FP32 = 1e-5
heads = st.integers(1, 3)
ratios = st.integers(1, 3)
dims = st.sampled_from([4, 8, 16])
gates = st.sampled_from(sorted(GATE_RANGES))
seeds = st.integers(0, 2**31 - 1)
batches = st.lists(trees(max_nodes=12, max_depth=5), min_size=1, max_size=4)


def _packed(batch):
    parents = torch.tensor([p for tree in batch for p in tree], dtype=torch.int32)
    cu = torch.tensor([0, *torch.tensor([len(t) for t in batch]).cumsum(0).tolist()], dtype=torch.int32)
    return parents, cu, max(len(t) for t in batch) + 1  # a static block larger than every request's tree


@settings(max_examples=40, deadline=None)
@given(batches, heads, ratios, dims, dims, gates, seeds)
def test_serial_states_match_the_reference(batch, key_heads, ratio, key_dim, value_dim, gate, seed):
    parents, cu, max_nodes = _packed(batch)
    requests = [gdn_inputs(len(t), key_heads, ratio, key_dim, value_dim, gate, seed + b) for b, t in enumerate(batch)]
    q, k, v, g, beta = (torch.cat([r[n] for r in requests]) for n in range(5))
    h0 = torch.stack([r[5][0] for r in requests])
    out, states = serial_tree_states(q.float(), k.float(), v.float(), g.float(), beta.float(), h0.float(), parents,
                                     cu, max_nodes)
    assert out.dtype == states.dtype == torch.float32
    for b, tree in enumerate(batch):
        rows = slice(int(cu[b]), int(cu[b + 1]))
        expected = reference_tree_recurrence(q[rows], k[rows], v[rows], g[rows], beta[rows], h0[b], tree)
        assert relative_error(out[rows], expected.o) <= FP32
        assert relative_error(states[rows], expected.state) <= FP32


@settings(max_examples=40, deadline=None)
@given(batches, st.integers(1, 6), st.integers(2, 4), st.integers(0, 2), st.booleans(), st.booleans(), seeds)
def test_serial_conv_matches_the_reference(batch, channels, width, extra_history, with_bias, silu, seed):
    parents, cu, max_nodes = _packed(batch)
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(int(cu[-1]), channels, generator=generator)
    history = torch.randn(len(batch), channels, width - 1 + extra_history, generator=generator)
    weight = torch.randn(channels, width, generator=generator)
    bias = torch.randn(channels, generator=generator) if with_bias else None
    activation = "silu" if silu else None
    out, histories = serial_tree_conv(x, history, weight, bias, parents, cu, max_nodes, activation)
    for b, tree in enumerate(batch):
        rows = slice(int(cu[b]), int(cu[b + 1]))
        expected = reference_tree_conv(x[rows], history[b], weight, bias, tree, activation)
        assert relative_error(out[rows], expected.out) <= FP32
        assert relative_error(histories[rows], expected.history) <= FP32

