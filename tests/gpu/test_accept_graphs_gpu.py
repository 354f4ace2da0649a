"""V2's acceptance graphs on CUDA (`vllm_plugin/v2/accept_graphs.py`): the body (the acceptance kernel, one compaction
launch per cache, the leaf counts through the count table) captured in real CUDA graphs of 8 and 1 requests and
replayed for batches of 8, 5, 3 and 1, against the same body run eagerly on a copy of the caches and counts: every
output, cache and count equal, the padded rows' moves kept inside vLLM's null block. The CPU test
(`tests/plugin/v2/test_accept_graphs.py`) holds the same with a stand-in graph whose replay runs the body; here the
kernels run inside a captured graph and padded rows run concurrently with row 0. Run on the H200: `pytest -m gpu
tests/gpu`."""

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

from tests.plugin.v2.test_accept_graphs import MAX_MODEL_LEN, World, uniform_step  # noqa: E402
from vllm_treewy.kernels.bookkeeping.slot_counts_triton import count_table  # noqa: E402
from vllm_treewy.tree import DraftTree  # noqa: E402
from vllm_treewy.vllm_plugin.trees.step import TreeConstants, uniform_tree_step  # noqa: E402
from vllm_treewy.vllm_plugin.v2.accept_graphs import TreeAcceptGraphs  # noqa: E402
from vllm_treewy.vllm_plugin.v2.acceptance import accept_and_commit_tree_rows
from vllm_treewy.vllm_plugin.v2.accepted_counts import CountedGroups  # noqa: E402


def on_cuda(world: World) -> World:
    world.tables = [table.cuda() for table in world.tables]
    world.caches = [[cache.cuda() for cache in caches] for caches in world.caches]
    world.gdn_groups = [(counts.cuda(), table.cuda()) for counts, table in world.gdn_groups]
    return world


def leaf_counts(world: World) -> CountedGroups:
    return CountedGroups(world.gdn_groups, count_table(world.gdn_groups))


@pytest.mark.parametrize("widths", [[2, 2, 1], [3, 2, 2, 1]])
def test_captured_acceptance_with_padded_rows_equals_the_eager_body(widths):
    tree = DraftTree.from_widths(widths)
    constants = TreeConstants.of(tree, torch.device("cuda"))
    eager = on_cuda(World(seed=3))
    graphed = eager.clone()
    graphs = TreeAcceptGraphs(tree, tree.num_nodes, graphed.caches, leaf_counts(graphed), 8, MAX_MODEL_LEN, constants)
    graphs.buffers.draws.fill_(-1)  # nothing accepted while capturing
    for size in (8, 1):
        graphs.run_body(size, record_counts=False)  # compiles the kernels
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            graphs.run_body(size)
        graphs.graphs[size] = graph
    gen = torch.Generator().manual_seed(len(widths))
    moved = False
    for num_reqs in (8, 5, 3, 1):
        step, batch, draws = uniform_step(tree, num_reqs, gen)
        batch.input_ids, batch.idx_mapping, batch.cu_num_logits, draws = (
            t.cuda() for t in (batch.input_ids, batch.idx_mapping, batch.cu_num_logits, draws))
        roots = step.root_positions.cuda()
        before = [cache.clone() for caches in graphed.caches for cache in caches]
        want_step = uniform_tree_step(tree, roots, constants)
        want_step.attention_layers = eager.recorded_layers(batch.idx_mapping)
        want = accept_and_commit_tree_rows(want_step, draws, batch.cu_num_logits, batch.input_ids, tree.num_nodes,
                                           batch.idx_mapping, leaf_counts(eager))
        got_step = uniform_tree_step(tree, roots, constants)
        got_step.attention_layers = graphed.recorded_layers(batch.idx_mapping)
        got = graphs.replay(got_step, draws, batch)
        torch.cuda.synchronize()
        assert got is not None
        for name in ("sampled", "num_sampled", "leaf_counts", "chain_rows"):
            assert torch.equal(getattr(got, name), getattr(want, name)), name
        for field, a, b in zip(want.acceptance._fields, got.acceptance, want.acceptance):
            assert torch.equal(a, b), field
        for a, b in zip(graphed.state(), eager.state()):
            assert torch.equal(a, b)
        moved |= any(not torch.equal(cache, old) for cache, old in
                     zip((c for caches in graphed.caches for c in caches), before))
    assert moved
