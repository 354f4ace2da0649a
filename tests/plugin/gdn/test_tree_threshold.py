"""`draft_tree_max_batch_size` on the runner side: which steps verify trees, the commit table of both shapes and the
torch commit's rows along it (the fp64 commits across shapes: `gdn/test_pseudo_value_buffer`)."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from vllm_treewy.kernels.conv_step_torch import commit_rows_and_parents
from vllm_treewy.tree import DraftTree
from vllm_treewy.vllm_plugin.config import draft_shape_of
from vllm_treewy.vllm_plugin.gdn.step_metadata import commit_ancestor_table, verified_tree_ancestors
from vllm_treewy.vllm_plugin.trees.step import find_tree_step

TREE = DraftTree.from_widths([2, 2, 1])  # N = 10, D = 3
N, D = TREE.num_nodes, TREE.max_depth


def _shape(threshold):
    return draft_shape_of(SimpleNamespace(is_draft_tree=True, draft_tree=TREE, draft_tree_max_batch_size=threshold))


def _find(drafts, chain_depth):
    drafts = np.asarray(drafts)
    query_start_loc = np.concatenate([[0], np.cumsum(1 + np.maximum(drafts, 0))])
    return find_tree_step(TREE, drafts, np.maximum(drafts, 0), query_start_loc, np.full(len(drafts), 20),
                          torch.device("cpu"), chain_depth=chain_depth)


def test_a_step_of_chains_has_no_tree_rows_and_a_step_never_mixes_shapes():
    assert _find([3, 1, -1, 0], chain_depth=D) is None  # vLLM's chain path
    step = _find([N, -1, N, 0], chain_depth=D)
    assert step.request_indices.tolist() == [0, 2]
    with pytest.raises(RuntimeError, match=r"requests \[1\] were scheduled chains of \[3\] drafts beside 10-node"):
        _find([N, 3], chain_depth=D)
    with pytest.raises(RuntimeError, match=r"requests \[0\] were scheduled \[3\] drafts of a 10-node draft tree"):
        _find([3, N], chain_depth=0)  # no threshold: no chain rows at all
    with pytest.raises(RuntimeError, match=r"scheduled \[5\] drafts of a 10-node"):
        _find([5], chain_depth=D)  # deeper than the chain, short of the tree


def test_the_gdn_step_verifies_the_tree_only_when_a_row_holds_it():
    counts = torch.tensor([3, -1, 0])
    assert not _shape(2).verifies_tree(counts) and not _shape(2).verifies_tree(None)
    assert _shape(2).verifies_tree(torch.tensor([N, -1, 0]))
    assert _shape(None).verifies_tree(counts)  # no threshold: every speculative step is the tree's
    assert not draft_shape_of(SimpleNamespace(is_draft_tree=False)).verifies_tree(counts)
    assert _shape(2).chain_count_offset == _shape(0).chain_count_offset == 1 + N
    assert _shape(None).chain_count_offset == 0


def test_rows_longer_than_the_chain_verify_as_the_tree():
    """vLLM's piecewise capture dummies split 1 + N tokens a row with draft counts of 0: a chain step's launch is
    sized for 1 + D tokens a row (on an H100 at the 27B shape, the chain-sized launch over such rows faulted), so
    they verify as the tree; real chain steps (rows of at most 1 + D tokens) stay chains."""
    zeros = torch.zeros(64, dtype=torch.int32)
    assert _shape("auto").verifies_tree(zeros, num_spec_rows=64, num_spec_tokens=64 * (1 + N))
    assert _shape(8).verifies_tree(zeros, num_spec_rows=64, num_spec_tokens=64 * (1 + D) + 1)
    assert not _shape(8).verifies_tree(zeros, num_spec_rows=64, num_spec_tokens=64 * (1 + D))
    assert not _shape("auto").verifies_tree(torch.full((4,), D), num_spec_rows=4, num_spec_tokens=4 + 4 * D)
    # only batches without drafts (the dummies): a step with chain drafts stays a chain step
    assert not _shape("auto").verifies_tree(torch.tensor([D, 0]), num_spec_rows=2, num_spec_tokens=2 * (1 + N))


def test_the_commit_table_holds_the_trees_block_then_the_chains():
    table = commit_ancestor_table(TREE, "cpu")
    assert table.dtype == torch.int32 and table.is_contiguous() and table.shape == (1 + N + 1 + D, D + 1)
    assert torch.equal(table[: 1 + N], verified_tree_ancestors(TREE, "cpu"))
    assert table[1 + N:].tolist() == [[0, -1, -1, -1], [1, 0, -1, -1], [2, 1, 0, -1], [3, 2, 1, 0]]


def test_the_torch_commit_rows_follow_table_rows_past_the_slots_rows():
    """Commit node a is table row a; its path names the slot's rows (a chain block j: row 1 + N + j, path j .. 0)."""
    table = commit_ancestor_table(TREE, "cpu")
    rows_per_slot = 1 + N
    nodes = torch.tensor([9, 1 + N + 2, -1, 1 + N], dtype=torch.int32)  # tree block 9, chain block 2, none, root
    rows, parents = commit_rows_and_parents(rows_per_slot, nodes, table)
    assert rows.tolist() == [9, 2, -1, 0]
    parents = parents.view(4, rows_per_slot)
    assert [parents[0, r].item() for r in (9, 5, 2)] == [5, 2, 0]  # tree path 9 -> 5 -> 2 -> 0
    assert parents[1, :3].tolist() == [-1, 0, 1]  # the chain's rows 0 .. 2
    # the tree's own table (rows = slot rows) gives the tree's parents along the path, as before the threshold
    tree_rows, tree_parents = commit_rows_and_parents(rows_per_slot, nodes[:1], verified_tree_ancestors(TREE, "cpu"))
    assert tree_rows.tolist() == [9] and tree_parents[[9, 5, 2]].tolist() == [5, 2, 0]
