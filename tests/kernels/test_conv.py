import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_treewy.kernels import conv_commit_packed, conv_verify_packed
from vllm_treewy.kernels.reference import reference_tree_conv
from vllm_treewy.tree import DraftTree, pack_trees

from .tree_cases import relative_error, trees

TOLERANCE = {torch.float64: 1e-12, torch.float32: 1e-5}


def conv_inputs(num_nodes, channels, width, extra_history, num_slots, seed, dtype):
    """x ``[T, D]``, a conv pool ``[S, D, w-1+extra]``, weight ``[D, w]``, bias ``[D]``."""
    generator = torch.Generator().manual_seed(seed)

    def normal(*shape):
        return torch.randn(shape, dtype=torch.float64, generator=generator).to(dtype)

    history_len = width - 1 + extra_history
    return normal(num_nodes, channels), normal(num_slots, channels, history_len), normal(channels, width), normal(channels)


@settings(max_examples=40, deadline=None)
@given(
    st.lists(trees(max_nodes=24), min_size=1, max_size=4),
    st.data(),
    st.sampled_from([torch.float64, torch.float32]),
    st.integers(1, 8),
    st.integers(2, 4),
    st.integers(0, 3),
    st.sampled_from([None, "silu"]),
    st.booleans(),
    st.integers(0, 2**31 - 1),
)
def test_conv_verify_and_commit_match_reference(
    batch, data, dtype, channels, width, extra_history, activation, with_bias, seed
):
    """Packed batch with padding requests and a shuffled pool stored as [S, L, D] (passed transposed)."""
    packed = pack_trees(batch)
    num_slots = len(batch) + 2
    x, pool, weight, bias = conv_inputs(packed.num_nodes, channels, width, extra_history, num_slots, seed, dtype)
    bias = bias if with_bias else None
    storage = pool.transpose(1, 2).contiguous().clone()  # [S, L, D], never aliasing pool
    conv_state = storage.transpose(1, 2)
    slots = torch.randperm(num_slots, generator=torch.Generator().manual_seed(seed))[: len(batch)]
    padding = torch.tensor(data.draw(st.lists(st.booleans(), min_size=len(batch), max_size=len(batch))))
    state_indices = torch.where(padding, -1, slots)
    accepted = torch.tensor([data.draw(st.integers(-1, len(parents) - 1)) for parents in batch])

    out = conv_verify_packed(
        x, conv_state, state_indices, weight, bias, packed.parents, packed.cu_nodes, activation=activation
    )
    assert out.dtype == dtype and conv_state.equal(pool)
    conv_commit_packed(conv_state, state_indices, x, packed.parents, packed.cu_nodes, accepted)

    touched = set()
    for b, parents in enumerate(batch):
        rows = slice(int(packed.cu_nodes[b]), int(packed.cu_nodes[b + 1]))
        if padding[b]:
            assert not out[rows].any()
            continue
        slot = int(slots[b])
        expected = reference_tree_conv(x[rows], pool[slot], weight, bias, parents, activation)
        assert relative_error(out[rows], expected.out) <= TOLERANCE[dtype]
        if accepted[b] >= 0:
            touched.add(slot)
            assert storage[slot].transpose(0, 1).equal(expected.history[accepted[b]].to(dtype))
    for slot in set(range(num_slots)) - touched:
        assert storage[slot].transpose(0, 1).equal(pool[slot])


@pytest.mark.parametrize("width", [2, 4])
@pytest.mark.parametrize("activation", [None, "silu"])
def test_chain_equals_causal_conv1d(width, activation):
    """A chain is an ordinary causal conv over history + drafts (checks the reference too)."""
    x, pool, weight, bias = conv_inputs(6, 5, width, 0, 1, 11, torch.float64)
    parents = DraftTree.from_widths([1] * 6).parents
    sequence = torch.cat([pool[0], x.T], dim=1)[None]  # [1, D, w-1+T]
    expected = torch.nn.functional.conv1d(sequence, weight[:, None, :], bias, groups=5)[0].T
    if activation == "silu":
        expected = torch.nn.functional.silu(expected)
    packed = pack_trees([parents])
    out = conv_verify_packed(x, pool, torch.tensor([0]), weight, bias, packed.parents, packed.cu_nodes, activation=activation)
    assert relative_error(out, expected) <= 1e-14
    assert relative_error(reference_tree_conv(x, pool[0], weight, bias, parents, activation).out, expected) <= 1e-14


def test_commit_every_node_of_a_tree():
    parents = DraftTree.from_widths([2, 2, 1]).parents
    num_nodes = len(parents)
    x, pool, weight, bias = conv_inputs(num_nodes, 3, 4, 1, 1, 5, torch.float32)
    expected = reference_tree_conv(x, pool[0], weight, bias, parents).history
    packed = pack_trees([parents] * num_nodes)
    conv_state = pool.expand(num_nodes, -1, -1).clone()
    conv_commit_packed(
        conv_state, torch.arange(num_nodes), x.repeat(num_nodes, 1), packed.parents, packed.cu_nodes,
        torch.arange(num_nodes),
    )
    assert conv_state.equal(expected.float())


def test_conv_rejects_bad_arguments():
    x, pool, weight, bias = conv_inputs(2, 3, 4, 0, 1, 0, torch.float32)
    packed = pack_trees([[-1, 0]])
    args = (torch.tensor([0]), weight, bias, packed.parents, packed.cu_nodes)
    with pytest.raises(ValueError, match="activation must be one of"):
        conv_verify_packed(x, pool, *args, activation="gelu")
    with pytest.raises(ValueError, match=r"x must be \[N, D=3\]"):
        conv_verify_packed(x[:, :2], pool, *args)
    with pytest.raises(ValueError, match=r"conv_state must be \[S, D=3, L>=3\]"):
        conv_verify_packed(x, pool[..., :2], *args)
