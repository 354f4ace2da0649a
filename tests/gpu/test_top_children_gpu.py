"""A drafting level's top children on CUDA (`kernels.top_children_triton`) against the torch twin at Qwen3.5's vocab
(248,320) for the row counts of drafting levels (1 to 704 rows), widths 2 and 3, bf16 and fp32 logits with forced
ties, NaN and infinities; and the adapter's `trees.drafting.top_children` (which picks the kernel on CUDA) captured
in a CUDA graph and replayed on new logits. The CPU test (`tests/kernels/test_top_children.py`) runs it interpreted.
Run on the H200: `pytest -m gpu tests/gpu`."""

import math

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

from vllm_treewy.kernels.top_children_torch import top_children_torch  # noqa: E402
from vllm_treewy.kernels.top_children_triton import top_children_triton  # noqa: E402
from vllm_treewy.vllm_plugin.trees.drafting import top_children  # noqa: E402

VOCAB = 248320  # Qwen3.5


def logits_case(num_rows, dtype, seed, ties):
    """Normal logits x 4 on the GPU; with `ties`, rounded to halves (many equal values a row, the top ones included)
    and a NaN, +inf and -inf planted in some rows."""
    generator = torch.Generator(device="cuda").manual_seed(seed)
    logits = torch.randn(num_rows, VOCAB, generator=generator, device="cuda") * 4
    if ties:
        logits = (logits * 2).round() / 2
        rows = torch.arange(0, num_rows, 3, device="cuda")
        tokens = torch.randint(0, VOCAB, (3, rows.numel()), generator=generator, device="cuda")
        for planted, value in zip(tokens, (math.nan, math.inf, -math.inf)):
            logits[rows, planted] = value
    return logits.to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("width", [2, 3])
@pytest.mark.parametrize("num_rows", [1, 8, 24, 88, 704])
def test_top_children_kernel_equals_its_twin_on_cuda(num_rows, width, dtype):
    for seed, ties in enumerate((False, True)):
        logits = logits_case(num_rows, dtype, seed, ties)
        got = top_children_triton(logits, width)
        assert got.dtype == torch.int64 and got.shape == (num_rows * width,)
        assert torch.equal(got, top_children_torch(logits, width))


def test_top_children_replays_in_a_cuda_graph():
    logits = logits_case(8, torch.bfloat16, 0, True)
    top_children(logits, 3)  # compiles
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ids = top_children(logits, 3)
    for seed, ties in ((1, False), (2, True)):
        logits.copy_(logits_case(8, torch.bfloat16, seed, ties))
        graph.replay()
        assert torch.equal(ids, top_children_torch(logits, 3))
