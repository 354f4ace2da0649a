import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_treewy.tree import DraftTree, global_parents, node_requests, pack_trees, packed_depths

from .tree_cases import trees


def walk_up(parents, i):
    """Strict ancestors of node i, nearest first (an independent walk for the properties below)."""
    ancestors = []
    while parents[i] >= 0:
        i = parents[i]
        ancestors.append(i)
    return ancestors


def test_widths_build_breadth_first_levels():
    tree = DraftTree.from_widths([2, 2, 1])
    assert tree.num_nodes == 10
    assert tree.parents == (-1, -1, 0, 0, 1, 1, 2, 3, 4, 5)
    assert tree.depth == (1, 1, 2, 2, 2, 2, 3, 3, 3, 3)
    assert tree.max_depth == 3
    assert tree.breadth_first_order() == tuple(range(10))


def test_chain_is_widths_of_ones():
    tree = DraftTree.from_widths([1] * 4)
    assert tree.parents == (-1, 0, 1, 2)
    assert tree.depth == (1, 2, 3, 4)
    assert tree.ancestor_mask().equal(torch.ones(4, 4, dtype=torch.bool).tril(-1))


def test_empty_tree():
    tree = DraftTree.from_widths([])
    assert tree.num_nodes == 0 and tree.max_depth == 0
    assert tree.with_root().parents == (-1,)


def test_equal_widths_share_one_tree():
    tree = DraftTree.from_widths([2, 2, 1])
    assert DraftTree.from_widths((2, 2, 1)) is tree
    assert DraftTree.from_widths([2, 1, 1]) is not tree


@pytest.mark.parametrize(
    "widths, message",
    [([2, 0], r"draft_tree_widths\[1\] = 0"), ([1.5], "positive integers"), ([True], "positive integers")],
)
def test_bad_widths_raise(widths, message):
    DraftTree.from_widths([1])  # a cached equal-hashing tree ((True,) == (1,)) must not skip the check
    with pytest.raises(ValueError, match=message):
        DraftTree.from_widths(widths)


@pytest.mark.parametrize(
    "parents, message",
    [
        ([0], r"parents\[0\] = 0"),
        ([-1, 1], r"parents\[1\] = 1: a parent must be -1"),
        ([-1, 2, 0], r"parents\[1\] = 2"),
        ([-2], r"parents\[0\] = -2"),
        ([-1, 0.0], "not an integer"),
        ([False], "bool"),
    ],
)
def test_bad_parents_raise(parents, message):
    with pytest.raises(ValueError, match=message):
        DraftTree(parents)


def test_parents_accept_integer_tensors():
    assert DraftTree(torch.tensor([-1, 0, 0])).parents == (-1, 0, 0)


@settings(max_examples=60, deadline=None)
@given(trees())
def test_topology_matches_parent_walks(parents):
    tree = DraftTree(parents)
    mask = tree.ancestor_mask()
    for i in range(tree.num_nodes):
        ancestors = walk_up(parents, i)
        assert tree.depth[i] == len(ancestors) + 1
        assert sorted(mask[i].nonzero().flatten().tolist()) == sorted(ancestors)
    assert tree.max_depth == max(tree.depth)

    order = tree.breadth_first_order()
    assert sorted(order) == list(range(tree.num_nodes))
    position = {node: n for n, node in enumerate(order)}
    assert all(p < 0 or position[p] < position[i] for i, p in enumerate(parents))
    assert [tree.depth[i] for i in order] == sorted(tree.depth)


@settings(max_examples=30, deadline=None)
@given(trees())
def test_with_root_hangs_drafts_below_the_root(parents):
    rooted = DraftTree(parents).with_root()
    assert rooted.num_nodes == len(parents) + 1
    assert rooted.parents[0] == -1
    assert rooted.depth == (1,) + tuple(d + 1 for d in DraftTree(parents).depth)
    assert all(walk_up(rooted.parents, i)[-1] == 0 for i in range(1, rooted.num_nodes))


@settings(max_examples=30, deadline=None)
@given(st.lists(st.one_of(st.just(()), trees(max_nodes=16)), min_size=1, max_size=5))
def test_pack_trees(batch):
    packed = pack_trees([DraftTree(p) for p in batch[:1]] + list(batch[1:]), device="cpu")
    sizes = [len(p) for p in batch]
    assert packed.num_requests == len(batch) and packed.num_nodes == sum(sizes)
    assert packed.parents.dtype == packed.cu_nodes.dtype == packed.depth.dtype == torch.int32
    assert packed.cu_nodes.tolist() == [sum(sizes[:b]) for b in range(len(batch) + 1)]
    assert packed.parents.tolist() == [p for parents in batch for p in parents]
    assert packed.max_nodes == max(sizes)
    assert packed.max_depth == max((DraftTree(p).max_depth for p in batch), default=0)

    requests = node_requests(packed.cu_nodes).tolist()
    parent_of = global_parents(packed.parents, packed.cu_nodes).tolist()
    assert packed_depths(packed.parents, packed.cu_nodes).tolist() == packed.depth.tolist()
    for b, parents in enumerate(batch):
        offset = sum(sizes[:b])
        tree = DraftTree(parents)
        for i in range(tree.num_nodes):
            n = offset + i
            assert requests[n] == b
            assert parent_of[n] == (parents[i] + offset if parents[i] >= 0 else -1)
            assert packed.depth[n] == tree.depth[i]
            assert packed.ancestor_mask[n, : tree.num_nodes].equal(tree.ancestor_mask()[i])
            assert not packed.ancestor_mask[n, tree.num_nodes :].any()


def test_chain_parents_of_packed_chains():
    from vllm_treewy.tree import chain_parents, pack_trees

    lengths = [4, 1, 3, 2]
    cu_nodes = torch.tensor([0, 4, 5, 8, 10], dtype=torch.int32)
    expected = pack_trees([DraftTree.from_widths([1] * (n - 1)).with_root() for n in lengths]).parents
    assert chain_parents(cu_nodes, 10).tolist() == expected.tolist()
    assert chain_parents(torch.tensor([0], dtype=torch.int32), 0).numel() == 0
