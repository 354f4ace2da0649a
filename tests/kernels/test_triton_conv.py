import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_treewy.kernels.conv import conv_commit_packed, conv_step_packed, conv_verify_packed
from vllm_treewy.kernels.reference import reference_tree_conv
from vllm_treewy.kernels.triton._tree import ancestor_table_torch
from vllm_treewy.tree import DraftTree, node_requests, pack_trees

from .tree_cases import relative_error, trees
from .triton_cases import DEVICE, TREE_BATCH, rows

from vllm_treewy.kernels.triton import conv_commit_triton, conv_step_triton, tree_conv_triton  # noqa: E402

WIDTH, CHANNELS = 4, 80


def conv_inputs(history_len, seed, transposed):
    generator = torch.Generator().manual_seed(seed)
    packed = pack_trees(TREE_BATCH)
    x = torch.randn(packed.num_nodes, CHANNELS, generator=generator)
    weight = torch.randn(CHANNELS, WIDTH, generator=generator)
    bias = torch.randn(CHANNELS, generator=generator)
    num_slots = len(TREE_BATCH) + 2
    if transposed:  # vLLM's GPU layout: the pool stored [S, L, D], viewed as [S, D, L]
        conv_state = torch.randn(num_slots, history_len, CHANNELS, generator=generator).transpose(1, 2)
    else:
        conv_state = torch.randn(num_slots, CHANNELS, history_len, generator=generator)
    slots = torch.randperm(num_slots, generator=generator)[: len(TREE_BATCH)].to(torch.int32)
    return packed, x, weight, bias, conv_state, slots


@pytest.mark.parametrize("history_len, transposed, activation, with_bias", [
    (WIDTH - 1, False, "silu", True),
    (WIDTH + 2, True, None, False),
])
def test_tree_conv_matches_reference_and_twin(history_len, transposed, activation, with_bias):
    packed, x, weight, bias, conv_state, slots = conv_inputs(history_len, 1, transposed)
    bias = bias if with_bias else None
    slots[2] = -1  # a padding request: its rows stay unwritten
    out = torch.full_like(x, float("nan")).to(DEVICE)
    tree_conv_triton(x.to(DEVICE), conv_state.to(DEVICE), slots.to(DEVICE), weight.to(DEVICE),
                     None if bias is None else bias.to(DEVICE), packed.parents.to(DEVICE),
                     packed.cu_nodes.to(DEVICE), activation=activation, out=out, block_nodes=4, block_d=32)
    out = out.cpu()
    twin = conv_verify_packed(x, conv_state, slots, weight, bias, packed.parents, packed.cu_nodes,
                              activation=activation)
    for b, parents in enumerate(TREE_BATCH):
        r = rows(packed, b)
        if slots[b] < 0:
            assert bool(out[r].isnan().all())
            continue
        expected = reference_tree_conv(x[r], conv_state[slots[b]], weight, bias, parents, activation).out
        assert relative_error(out[r], expected) <= 1e-5
        assert relative_error(out[r], twin[r]) <= 1e-5


@pytest.mark.parametrize("history_len, transposed", [(WIDTH - 1, True), (WIDTH + 2, False)])
def test_conv_commit_matches_reference_and_twin(history_len, transposed):
    packed, x, weight, bias, conv_state, slots = conv_inputs(history_len, 2, transposed)
    accepted = torch.tensor([9, 7, -1, 3], dtype=torch.int32)
    committed = conv_state.clone().to(DEVICE)
    conv_commit_triton(committed, slots.to(DEVICE), x.to(DEVICE), packed.parents.to(DEVICE),
                       packed.cu_nodes.to(DEVICE), accepted.to(DEVICE), block_d=32)
    committed = committed.cpu()
    twin = conv_state.clone()
    conv_commit_packed(twin, slots, x, packed.parents, packed.cu_nodes, accepted)
    assert torch.equal(committed, twin)
    for b, parents in enumerate(TREE_BATCH):
        if accepted[b] >= 0:
            r = rows(packed, b)
            expected = reference_tree_conv(x[r], conv_state[slots[b]], weight, bias, parents).history
            assert torch.equal(committed[slots[b]], expected[accepted[b]].float())


@settings(max_examples=12, deadline=None)
@given(batch=st.lists(trees(max_nodes=9, max_depth=5), min_size=1, max_size=4), rows_per_slot=st.integers(1, 5),
       history_len=st.sampled_from([WIDTH - 1, WIDTH + 1]), transposed=st.booleans(), data=st.data())
def test_conv_step_commits_the_pending_draft_then_convolves(batch, rows_per_slot, history_len, transposed, data):
    """conv_step = commit of each slot's previous draft (a chain over the slot's rows, or one static tree given as
    an ancestor table, possibly with spare columns) at its pending node from the per-slot input rows, then the tree
    conv of this step; the step's inputs replace the rows. Triton vs torch twin vs the fp64 node-by-node reference;
    padding requests and slots outside the batch are untouched."""
    seed = data.draw(st.integers(0, 2**16))
    generator = torch.Generator().manual_seed(seed)
    batch = [p if len(p) <= rows_per_slot else p[:rows_per_slot] for p in batch]
    packed = pack_trees(batch)
    num_slots = len(batch) + 2
    x = torch.randn(packed.num_nodes, CHANNELS, generator=generator)
    weight, bias = torch.randn(CHANNELS, WIDTH, generator=generator), torch.randn(CHANNELS, generator=generator)
    if transposed:
        conv_state = torch.randn(num_slots, history_len, CHANNELS, generator=generator).transpose(1, 2)
    else:
        conv_state = torch.randn(num_slots, CHANNELS, history_len, generator=generator)
    inputs = torch.randn(num_slots, rows_per_slot, CHANNELS, generator=generator)
    slots = torch.randperm(num_slots, generator=generator)[: len(batch)].to(torch.int32)
    pending_tree = data.draw(st.one_of(st.none(), trees(max_nodes=rows_per_slot, max_depth=rows_per_slot)))
    if pending_tree is None:
        pending_parents, pending_ancestors = tuple(range(-1, rows_per_slot - 1)), None
    else:
        depth = DraftTree(pending_tree).max_depth + data.draw(st.integers(0, 1))
        pending_parents = pending_tree
        pending_ancestors = ancestor_table_torch(torch.tensor(pending_tree, dtype=torch.int32),
                                                 torch.tensor([0, len(pending_tree)]), depth)
    pending = torch.tensor([data.draw(st.integers(-1, len(pending_parents) - 1)) for _ in batch], dtype=torch.int32)
    if len(batch) > 1 and data.draw(st.booleans()):
        slots[0] = -1  # a padding request

    expected_out, expected_state, expected_inputs = x.clone(), conv_state.clone(), inputs.clone()
    for b, parents in enumerate(batch):
        if slots[b] < 0:
            continue
        s, r = int(slots[b]), rows(packed, b)
        history = conv_state[s]
        if pending[b] >= 0:
            history = reference_tree_conv(inputs[s, : len(pending_parents)], history, weight, bias,
                                          pending_parents).history[pending[b]].float()
        expected_state[s] = history
        expected_out[r] = reference_tree_conv(x[r], history, weight, bias, parents, "silu").out.float()
        expected_inputs[s, : len(parents)] = x[r]

    twin_state, twin_inputs = conv_state.clone(), inputs.clone()
    twin_out = conv_step_packed(x, twin_state, slots, weight, bias, packed.parents, packed.cu_nodes, twin_inputs,
                                pending, pending_ancestors=pending_ancestors, activation="silu")
    state, step_inputs = conv_state.clone().to(DEVICE), inputs.clone().to(DEVICE)
    out = torch.full_like(x, float("nan")).to(DEVICE)
    conv_step_triton(x.to(DEVICE), state, slots.to(DEVICE), weight.to(DEVICE), bias.to(DEVICE),
                     packed.parents.to(DEVICE), packed.cu_nodes.to(DEVICE), step_inputs, pending.to(DEVICE),
                     pending_ancestors=None if pending_ancestors is None else pending_ancestors.to(DEVICE),
                     activation="silu", out=out, block_nodes=4, block_d=32)
    live = slots.long()[node_requests(packed.cu_nodes)] >= 0
    for actual_out, actual_state, actual_inputs in ((out.cpu(), state.cpu(), step_inputs.cpu()),
                                                    (twin_out, twin_state, twin_inputs)):
        assert relative_error(actual_out[live], expected_out[live]) <= 1e-5
        assert torch.allclose(actual_state, expected_state, rtol=0, atol=0)
        assert torch.equal(actual_inputs, expected_inputs)
    assert bool(out.cpu()[~live].isnan().all())
