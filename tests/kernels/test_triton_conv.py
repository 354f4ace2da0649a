import pytest
import torch

from vllm_treewy.kernels.conv import conv_commit_packed, conv_verify_packed
from vllm_treewy.kernels.reference import reference_tree_conv
from vllm_treewy.tree import pack_trees

from .tree_cases import relative_error
from .triton_cases import DEVICE, TREE_BATCH, rows

from vllm_treewy.kernels.triton import conv_commit_triton, tree_conv_triton  # noqa: E402

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
