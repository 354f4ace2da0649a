import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_treewy.kernels import commit_packed, path_log_decay, tree_commit, tree_verify, verify_packed
from vllm_treewy.kernels.reference import reference_tree_recurrence
from vllm_treewy.tree import DraftTree, pack_trees

from .tree_cases import GATE_RANGES, gdn_inputs, relative_error, trees

TOLERANCE = {torch.float64: 1e-12, torch.float32: 1e-5}

heads = st.integers(1, 3)
ratios = st.integers(1, 3)
dims = st.sampled_from([4, 8, 16])
gates = st.sampled_from(sorted(GATE_RANGES))
seeds = st.integers(0, 2**31 - 1)
float_dtypes = st.sampled_from([torch.float64, torch.float32])


def packed_batch(batch, dtype, key_heads, ratio, key_dim, value_dim, gate, seed):
    """Concatenated inputs of several requests, each with its own slot in a shuffled pool with spare slots."""
    requests = [
        gdn_inputs(len(parents), key_heads, ratio, key_dim, value_dim, gate, seed + b, dtype)
        for b, parents in enumerate(batch)
    ]
    q, k, v, g, beta = (torch.cat([r[n] for r in requests]) for n in range(5))
    num_slots = len(batch) + 2
    slots = torch.randperm(num_slots, generator=torch.Generator().manual_seed(seed))[: len(batch)]
    pool = torch.randn(num_slots, *requests[0][5].shape[1:], dtype=torch.float64).to(dtype)
    return q, k, v, g, beta, pool, slots


def request_rows(packed, b):
    return slice(int(packed.cu_nodes[b]), int(packed.cu_nodes[b + 1]))


@settings(max_examples=60, deadline=None)
@given(trees(), float_dtypes, heads, ratios, dims, dims, gates, seeds)
def test_verify_matches_reference(parents, dtype, key_heads, ratio, key_dim, value_dim, gate, seed):
    q, k, v, g, beta, pool = gdn_inputs(len(parents), key_heads, ratio, key_dim, value_dim, gate, seed, dtype)
    h0 = pool[0]
    expected = reference_tree_recurrence(q, k, v, g, beta, h0, parents)
    o, u = tree_verify(q, k, v, g, beta, h0, parents)
    assert o.dtype == dtype and u.dtype == dtype
    assert relative_error(o, expected.o) <= TOLERANCE[dtype]
    assert relative_error(u, expected.u) <= TOLERANCE[dtype]


@settings(max_examples=40, deadline=None)
@given(trees(), float_dtypes, heads, ratios, dims, dims, gates, seeds)
def test_neumann_equals_substitution(parents, dtype, key_heads, ratio, key_dim, value_dim, gate, seed):
    q, k, v, g, beta, pool = gdn_inputs(len(parents), key_heads, ratio, key_dim, value_dim, gate, seed, dtype)
    by_substitution = tree_verify(q, k, v, g, beta, pool[0], parents, solve="substitution")
    by_neumann = tree_verify(q, k, v, g, beta, pool[0], parents, solve="neumann")
    for a, b in zip(by_substitution, by_neumann):
        assert relative_error(a, b) <= TOLERANCE[dtype]


@settings(max_examples=40, deadline=None)
@given(trees(), float_dtypes, heads, ratios, dims, dims, gates, seeds)
def test_commit_of_every_node_matches_reference(parents, dtype, key_heads, ratio, key_dim, value_dim, gate, seed):
    """One batch holding the tree once per node, each copy accepting a different node, through a [S, HV, K, V] pool."""
    q, k, v, g, beta, pool = gdn_inputs(len(parents), key_heads, ratio, key_dim, value_dim, gate, seed, dtype)
    expected = reference_tree_recurrence(q, k, v, g, beta, pool[0], parents).state
    _, u = tree_verify(q, k, v, g, beta, pool[0], parents)

    num_nodes = len(parents)
    packed = pack_trees([parents] * num_nodes)
    storage = pool[0].transpose(-1, -2).contiguous().expand(num_nodes, -1, -1, -1).clone()  # CPU layout
    state = storage.transpose(-1, -2)
    repeat = (num_nodes,) + (1,) * (u.dim() - 1)
    commit_packed(
        state, torch.arange(num_nodes), k.repeat(repeat), u.repeat(repeat), g.repeat(repeat[:2]),
        packed.parents, packed.cu_nodes, torch.arange(num_nodes),
    )
    assert state.data_ptr() == storage.data_ptr()
    for node in range(num_nodes):
        assert relative_error(storage[node].transpose(-1, -2), expected[node]) <= TOLERANCE[dtype]


@settings(max_examples=40, deadline=None)
@given(
    st.lists(trees(max_nodes=16), min_size=1, max_size=5),
    st.data(), float_dtypes, heads, ratios, dims, dims, gates, seeds, st.sampled_from(["substitution", "neumann"]),
)
def test_packed_batch_with_padding(batch, data, dtype, key_heads, ratio, key_dim, value_dim, gate, seed, solve):
    q, k, v, g, beta, pool, slots = packed_batch(batch, dtype, key_heads, ratio, key_dim, value_dim, gate, seed)
    padding = torch.tensor(data.draw(st.lists(st.booleans(), min_size=len(batch), max_size=len(batch))))
    state_indices = torch.where(padding, -1, slots)
    accepted = torch.tensor([data.draw(st.integers(-1, len(parents) - 1)) for parents in batch])
    packed = pack_trees(batch)
    pool_before = pool.clone()

    o, u = verify_packed(q, k, v, g, beta, pool, state_indices, packed.parents, packed.cu_nodes, solve=solve)
    assert pool.equal(pool_before)
    commit_packed(pool, state_indices, k, u, g, packed.parents, packed.cu_nodes, accepted)

    touched = set()
    for b, parents in enumerate(batch):
        rows = request_rows(packed, b)
        if padding[b]:
            assert not o[rows].any() and not u[rows].any()
            continue
        slot = int(slots[b])
        expected = reference_tree_recurrence(q[rows], k[rows], v[rows], g[rows], beta[rows], pool_before[slot], parents)
        assert relative_error(o[rows], expected.o) <= TOLERANCE[dtype]
        assert relative_error(u[rows], expected.u) <= TOLERANCE[dtype]
        if accepted[b] >= 0:
            touched.add(slot)
            assert relative_error(pool[slot], expected.state[accepted[b]]) <= TOLERANCE[dtype]
    for slot in set(range(pool.shape[0])) - touched:
        assert pool[slot].equal(pool_before[slot])


@settings(max_examples=20, deadline=None)
@given(trees(), seeds)
def test_path_log_decay_sums_the_path(parents, seed):
    g = torch.randn(len(parents), 3, generator=torch.Generator().manual_seed(seed)).double()
    packed = pack_trees([parents])
    c = path_log_decay(g, packed.parents, packed.cu_nodes)
    expected = g + DraftTree(parents).ancestor_mask().double() @ g
    assert torch.allclose(c, expected, rtol=1e-14, atol=1e-14)


@settings(max_examples=20, deadline=None)
@given(trees(max_nodes=24), gates, seeds)
def test_reference_node_state_equals_chain_along_its_path(parents, gate, seed):
    """The reference's tree bookkeeping against itself run on each root-to-node chain."""
    q, k, v, g, beta, pool = gdn_inputs(len(parents), 2, 2, 4, 4, gate, seed)
    tree_states = reference_tree_recurrence(q, k, v, g, beta, pool[0], parents).state
    for node in range(len(parents)):
        path = [node]
        while parents[path[-1]] >= 0:
            path.append(parents[path[-1]])
        path.reverse()
        chain = DraftTree.from_widths([1] * len(path)).parents
        chain_states = reference_tree_recurrence(q[path], k[path], v[path], g[path], beta[path], pool[0], chain).state
        assert torch.allclose(chain_states[-1], tree_states[node], rtol=0, atol=1e-13)


def test_long_chain_fp32():
    parents = DraftTree.from_widths([1] * 64).parents
    q, k, v, g, beta, pool = gdn_inputs(64, 2, 2, 16, 16, "mixed", 7, torch.float32)
    expected = reference_tree_recurrence(q, k, v, g, beta, pool[0], parents)
    o, u = tree_verify(q, k, v, g, beta, pool[0], parents, solve="neumann")
    assert relative_error(o, expected.o) <= 1e-5
    assert relative_error(tree_commit(pool[0], k, u, g, beta, parents, 63), expected.state[63]) <= 1e-5


@pytest.mark.parametrize("dtype, tolerance", [(torch.bfloat16, 1e-2), (torch.float16, 2e-3), (torch.float32, 1e-5)])
@pytest.mark.parametrize("gates_fp32", [False, True])
def test_public_api_low_precision(dtype, tolerance, gates_fp32):
    """Inputs rounded to dtype; the reference runs in fp64 on the same rounded values."""
    parents = DraftTree.from_widths([2, 2, 1]).parents
    q, k, v, g, beta, pool = gdn_inputs(10, 2, 2, 16, 8, "mixed", 3, dtype)
    if gates_fp32:  # vLLM computes g and beta in fp32 beside bf16 activations
        g, beta = gdn_inputs(10, 2, 2, 16, 8, "mixed", 3, torch.float32)[3:5]
    h0 = pool[0]
    expected = reference_tree_recurrence(q, k, v, g, beta, h0, parents)
    o, u = tree_verify(q, k, v, g, beta, h0, parents)
    assert o.dtype == dtype and u.dtype == torch.float32
    assert relative_error(o, expected.o) <= tolerance
    assert relative_error(u, expected.u) <= tolerance
    for node in range(len(parents)):
        h_node = tree_commit(h0, k, u, g, beta, parents, node)
        assert h_node.dtype == dtype and h_node.shape == h0.shape
        assert relative_error(h_node, expected.state[node]) <= tolerance
    assert tree_commit(h0, k, u, g, beta, parents, -1).equal(h0)


def test_api_rejects_bad_arguments():
    q, k, v, g, beta, pool = gdn_inputs(3, 2, 2, 4, 4, "mixed", 0)
    h0 = pool[0]
    with pytest.raises(ValueError, match="parents has 2 entries but the inputs have T=3"):
        tree_verify(q, k, v, g, beta, h0, [-1, 0])
    with pytest.raises(ValueError, match=r"parents\[1\] = 1"):
        tree_verify(q, k, v, g, beta, h0, [-1, 1, 0])
    with pytest.raises(ValueError, match="solve must be one of"):
        tree_verify(q, k, v, g, beta, h0, [-1, 0, 0], solve="lu")
    with pytest.raises(ValueError, match="multiple of key heads"):
        tree_verify(q, k, v[:, :1].expand(-1, 3, -1), g, beta, h0, [-1, 0, 0])
    with pytest.raises(ValueError, match="h0 must be"):
        tree_verify(q, k, v, g, beta, h0[0], [-1, 0, 0])
    with pytest.raises(ValueError, match="state must be a pool"):
        tree_verify(q, k, v, g, beta, h0.transpose(-1, -2)[..., :2], [-1, 0, 0])
    with pytest.raises(ValueError, match="beta must be"):
        tree_verify(q, k, v, g, beta[:, :1], h0, [-1, 0, 0])
    _, u = tree_verify(q, k, v, g, beta, h0, [-1, 0, 0])
    with pytest.raises(ValueError, match=r"node = 3 is outside \[-1, 3\)"):
        tree_commit(h0, k, u, g, beta, [-1, 0, 0], 3)
