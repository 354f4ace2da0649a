"""The tree step's post-sampler kernels on CUDA: `tree_acceptance_triton` against its torch twin (real and synthetic
acceptance, mixed batches), captured in a CUDA graph and replayed on new draws; `compact_paged_kv_triton` against its
twin on a bf16 cache in vLLM's paged layout at Qwen3.5 full-attention sizes (4 KV heads x 2 x 256). The CPU tests run
both interpreted (`tests/kernels/test_tree_acceptance.py`, `tests/plugin/trees/test_attention_triton.py`). Run on the
H200: `pytest -m gpu tests/gpu`."""

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

from tests.kernels.test_tree_acceptance import assert_equal_rows, step_layout  # noqa: E402
from tests.plugin.paged_batches import empty_cache, scattered_block_table  # noqa: E402
from vllm_treewy.kernels.paged_kv_compaction_torch import compact_paged_kv_torch  # noqa: E402
from vllm_treewy.kernels.paged_kv_compaction_triton import compact_paged_kv_triton  # noqa: E402
from vllm_treewy.kernels.tree_acceptance_torch import SyntheticDraw, tree_acceptance_torch  # noqa: E402
from vllm_treewy.kernels.tree_acceptance_triton import tree_acceptance_triton  # noqa: E402
from vllm_treewy.spec_decode.acceptance import UniformWalkTables  # noqa: E402
from vllm_treewy.spec_decode.synthetic_acceptance import NodeRateIndex  # noqa: E402
from vllm_treewy.tree import DraftTree  # noqa: E402

WIDTHS = ([2, 2, 1], [3, 2, 2, 1], [1, 1, 1])


def cuda_step(parents, kinds, seed):
    generator = torch.Generator().manual_seed(seed)
    return [t.cuda() if isinstance(t, torch.Tensor) else t for t in step_layout(parents, kinds, 0, generator)]


@pytest.mark.parametrize("widths", WIDTHS)
@pytest.mark.parametrize("synthetic", [False, True])
def test_acceptance_kernel_equals_its_twin_on_cuda(widths, synthetic):
    parents = DraftTree.from_widths(widths).parents
    tables = UniformWalkTables.of(list(parents), "cuda")
    for seed in range(20):
        kinds = ["tree"] * (1 + seed % 7) + ["one"] * (seed % 3)
        draws, cu, rows, token_indices, input_ids, steps = cuda_step(parents, kinds, seed)
        draw = None
        if synthetic:
            depth = tables.node_at_depth.shape[1]
            draw = SyntheticDraw(torch.rand(rows.numel(), len(parents), dtype=torch.float64, device="cuda"),
                                 torch.rand(9, 2, depth, device="cuda"), torch.randperm(9, device="cuda")[: len(kinds)],
                                 NodeRateIndex.of(parents, "cuda").index)
        args = (draws, cu, rows, token_indices, input_ids, tables, steps, draw)
        assert_equal_rows(tree_acceptance_triton(*args), tree_acceptance_torch(*args))


def test_acceptance_kernel_replays_in_a_cuda_graph():
    parents = DraftTree.from_widths([2, 2, 1]).parents
    tables = UniformWalkTables.of(list(parents), "cuda")
    draws, cu, rows, token_indices, input_ids, steps = cuda_step(parents, ["tree"] * 8, 0)
    static = draws.clone()
    tree_acceptance_triton(static, cu, rows, token_indices, input_ids, tables, steps)  # compiles
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = tree_acceptance_triton(static, cu, rows, token_indices, input_ids, tables, steps)
    for seed in range(1, 6):
        fresh = cuda_step(parents, ["tree"] * 8, seed)
        static.copy_(fresh[0])
        input_ids.copy_(fresh[4])
        graph.replay()
        assert_equal_rows(out, tree_acceptance_torch(static, cu, rows, token_indices, input_ids, tables, steps))


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_compaction_kernel_equals_its_twin_on_cuda(layout):
    tree = DraftTree.from_widths([3, 2, 2, 1])
    generator = torch.Generator().manual_seed(1)
    block_size, num_requests = 64, 16
    roots = torch.randint(0, 4 * block_size, (num_requests,), generator=generator)
    table, num_blocks = scattered_block_table(num_requests, (roots + 1 + tree.num_nodes).tolist(), block_size,
                                              generator)
    cache = empty_cache(num_blocks, 4, block_size, 2 * 256, torch.bfloat16, layout, fill=0.0)
    cache.copy_(torch.randn(cache.shape, generator=generator).to(torch.bfloat16))
    paths = []
    for _ in range(num_requests):
        node, path = int(torch.randint(-1, tree.num_nodes, (1,), generator=generator)), []
        while node >= 0:
            path.insert(0, node)
            node = tree.parents[node]
        paths.append(path + [-1] * (tree.max_depth - len(path)))
    paths, cache, table, roots = torch.tensor(paths).cuda(), cache.cuda(), table.cuda(), roots.cuda()
    want = cache.clone()
    compact_paged_kv_torch(want, table, paths, roots)
    compact_paged_kv_triton(cache, table, paths, roots)
    assert torch.equal(cache, want) and not torch.equal(want, cache.new_zeros(cache.shape))
