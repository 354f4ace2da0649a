"""The drafter's first-pass chain inputs on CUDA (`kernels.accepted_chains_triton`) against the torch twin at the 27B
shape's hidden size (5120, bf16) for the [2,2,1] and [3,2,2,1] trees, on steps of tree rows only and of tree rows
among decodes and prefill chunks, and replayed in a CUDA graph on new paths, roots and hidden states. The CPU test
(`tests/kernels/test_accepted_chains.py`) runs it interpreted. Run on the H200: `pytest -m gpu tests/gpu`."""

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

from tests.gpu.test_level_inputs_gpu import on_cuda  # noqa: E402
from tests.kernels.test_accepted_chains import case, write  # noqa: E402
from vllm_treewy.kernels.accepted_chains_torch import accepted_chains_torch  # noqa: E402
from vllm_treewy.kernels.accepted_chains_triton import accepted_chains_triton  # noqa: E402
from vllm_treewy.tree import DraftTree  # noqa: E402


@pytest.mark.parametrize("widths", [[2, 2, 1], [3, 2, 2, 1]])
@pytest.mark.parametrize("num_requests", [1, 8, 64])
@pytest.mark.parametrize("mixed", [False, True])
def test_accepted_chains_kernel_equals_its_twin_on_cuda(widths, num_requests, mixed):
    kinds = ["tree", 3, 1, "tree", 37] * num_requests if mixed else ["tree"] * num_requests
    inputs, _, buffers, num_tokens = case(DraftTree.from_widths(widths).parents, kinds, 5, 5120, torch.bfloat16,
                                          num_requests)
    inputs = on_cuda(inputs)
    want = write(accepted_chains_torch, inputs, on_cuda(buffers()), num_tokens)
    got = write(accepted_chains_triton, inputs, on_cuda(buffers()), num_tokens)
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def test_accepted_chains_kernel_replays_in_a_cuda_graph():
    tree = DraftTree.from_widths([3, 2, 2, 1])
    inputs, _, buffers, num_tokens = case(tree.parents, ["tree", 4, "tree", 1, "tree"] * 3, 2, 5120,
                                          torch.bfloat16, 0)
    inputs, out = on_cuda(inputs), on_cuda(buffers())
    write(accepted_chains_triton, inputs, out, num_tokens)  # compiles
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        write(accepted_chains_triton, inputs, out, num_tokens)
    block_rows, accepted_nodes, root_positions, token_ids, positions, hidden_states = inputs
    for seed in (1, 2):
        fresh, _, _, _ = case(tree.parents, ["tree", 4, "tree", 1, "tree"] * 3, 2, 5120, torch.bfloat16, seed)
        for buffer, value in zip((accepted_nodes, root_positions, token_ids, positions, hidden_states), fresh[1:]):
            buffer.copy_(value)
        graph.replay()
        want = write(accepted_chains_torch, inputs, on_cuda(buffers()), num_tokens)
        for a, b in zip(out, want):
            assert torch.equal(a, b)
