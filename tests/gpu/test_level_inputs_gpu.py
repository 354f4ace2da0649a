"""The drafting levels' inputs on CUDA (`kernels.level_inputs_triton`) against the torch twin at the 27B shape's hidden
size (5120, bf16) for the [2,2,1] and [3,2,2,1] trees' levels, and replayed in a CUDA graph on new roots. The CPU test
(`tests/kernels/test_level_inputs.py`) runs it interpreted. Run on the H200: `pytest -m gpu tests/gpu`."""

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

from tests.kernels.test_level_inputs import case, write  # noqa: E402
from vllm_treewy.kernels.level_inputs_torch import level_inputs_torch  # noqa: E402
from vllm_treewy.kernels.level_inputs_triton import level_inputs_triton  # noqa: E402
from vllm_treewy.spec_decode.tree_drafting import level_trees  # noqa: E402


def on_cuda(values):
    return tuple(v.cuda() if isinstance(v, torch.Tensor) else v for v in values)


@pytest.mark.parametrize("widths", [[2, 2, 1], [3, 2, 2, 1]])
@pytest.mark.parametrize("num_requests", [1, 8, 64])
def test_level_inputs_kernel_equals_its_twin_on_cuda(widths, num_requests):
    for seed, level in enumerate(level_trees(widths)):
        inputs, buffers, rows = case(level.parents, num_requests, 5120, torch.bfloat16, seed)
        inputs = on_cuda(inputs)
        want = write(level_inputs_torch, inputs, on_cuda(buffers()), rows, num_requests)
        got = write(level_inputs_triton, inputs, on_cuda(buffers()), rows, num_requests)
        for a, b in zip(got, want):
            assert torch.equal(a, b)


def test_level_inputs_kernel_replays_in_a_cuda_graph():
    level = level_trees([3, 2, 2, 1])[-1]
    inputs, buffers, rows = case(level.parents, 8, 5120, torch.bfloat16, 0)
    inputs, out = on_cuda(inputs), on_cuda(buffers())
    write(level_inputs_triton, inputs, out, rows, 8)  # compiles
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        write(level_inputs_triton, inputs, out, rows, 8)
    roots = inputs[6]
    for shift in (3, 17):
        roots.add_(shift)
        graph.replay()
        want = write(level_inputs_torch, inputs, on_cuda(buffers()), rows, 8)
        for a, b in zip(out, want):
            assert torch.equal(a, b)
