import pytest
import torch
from hypothesis import HealthCheck, find, given, settings
from hypothesis import strategies as st

from vllm_treewy.spec_decode import (
    TreeAcceptance,
    accepted_kv_moves,
    accepted_kv_moves_reference,
    greedy_tree_acceptance,
    greedy_tree_acceptance_reference,
    verified_block_offsets,
)
from vllm_treewy.tree import DraftTree, pack_trees

from .acceptance_cases import Request, planted_batches, random_batches

def fast(max_examples: int) -> settings:
    return settings(max_examples=max_examples, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def run_acceptance(requests: list[Request], max_depth: int | None = None, acceptance=greedy_tree_acceptance):
    packed = pack_trees([r.parents for r in requests])
    result = acceptance(
        packed.parents,
        packed.cu_nodes,
        torch.tensor([t for r in requests for t in r.draft_tokens], dtype=torch.long),
        torch.tensor([t for r in requests for t in r.target_argmax], dtype=torch.long),
        packed.max_depth if max_depth is None else max_depth,
    )
    return packed, result


def assert_matches_reference(requests: list[Request], max_depth: int | None = None, acceptance=greedy_tree_acceptance):
    packed, result = run_acceptance(requests, max_depth, acceptance)
    depth = packed.max_depth if max_depth is None else max_depth
    assert result.accepted_nodes.shape == (len(requests), depth)
    for b, r in enumerate(requests):
        path, bonus = greedy_tree_acceptance_reference(r.parents, r.draft_tokens, r.target_argmax, max_depth)
        assert result.accepted_nodes[b].tolist() == path + [-1] * (depth - len(path)), b
        assert int(result.num_accepted[b]) == len(path), b
        assert int(result.last_accepted_node[b]) == (path[-1] if path else -1), b
        assert int(result.bonus_tokens[b]) == bonus, b


# --- greedy acceptance: hand-written cases -------------------------------------------------------------------


def widths_request(widths, draft_tokens, argmax_at: dict[int, int], default: int = 0) -> Request:
    """``argmax_at``: the target's argmax at local node j (key -1 = the root); ``default`` elsewhere."""
    parents = DraftTree.from_widths(widths).parents
    argmax = [default] * (len(parents) + 1)
    for node, token in argmax_at.items():
        argmax[node + 1] = token
    return Request(parents, tuple(draft_tokens), tuple(argmax))


# [2, 2, 1]: nodes 0, 1 at depth 1; 2, 3 below 0 and 4, 5 below 1; 6, 7, 8, 9 below 2, 3, 4, 5.
SECOND_BRANCH = widths_request(
    [2, 2, 1], draft_tokens=[6, 7, 1, 2, 8, 9, 0, 0, 0, 3], argmax_at={-1: 7, 1: 9, 5: 3, 9: 42}, default=5
)


def test_continuation_on_second_branches_is_accepted_to_full_depth():
    _, result = run_acceptance([SECOND_BRANCH])
    assert result.accepted_nodes.tolist() == [[1, 5, 9]]
    assert result.num_accepted.tolist() == [3]
    assert result.last_accepted_node.tolist() == [9]
    assert result.bonus_tokens.tolist() == [42]  # the target's argmax after the deepest accepted node


def test_nothing_accepted_gives_the_root_argmax_as_bonus():
    request = widths_request([2, 2, 1], draft_tokens=[6, 7, 1, 2, 8, 9, 0, 0, 0, 3], argmax_at={-1: 3})
    _, result = run_acceptance([request])
    assert result.accepted_nodes.tolist() == [[-1, -1, -1]]
    assert result.num_accepted.tolist() == [0]
    assert result.last_accepted_node.tolist() == [-1]
    assert result.bonus_tokens.tolist() == [3]


def test_chain_stops_at_first_mismatch():
    # drafts 4, 5, 6, 7; the target agrees with 4 and 5, then wants 9 instead of 6.
    request = widths_request([1] * 4, draft_tokens=[4, 5, 6, 7], argmax_at={-1: 4, 0: 5, 1: 9, 2: 7})
    _, result = run_acceptance([request])
    assert result.accepted_nodes.tolist() == [[0, 1, -1, -1]]
    assert result.bonus_tokens.tolist() == [9]


def test_repeated_sibling_tokens_take_the_first_in_node_order():
    # root children 0, 1, 2 all carry token 5; only node 2 has a matching child (node 3).
    request = Request(parents=(-1, -1, -1, 2), draft_tokens=(5, 5, 5, 8), target_argmax=(5, 8, 8, 8, 1))
    _, result = run_acceptance([request])
    assert result.accepted_nodes.tolist() == [[0, -1]]
    assert result.bonus_tokens.tolist() == [8]


def test_batch_mixes_trees_chains_and_empty_drafts():
    chain = widths_request([1, 1], draft_tokens=[2, 3], argmax_at={-1: 2, 0: 3, 1: 4})
    empty = Request(parents=(), draft_tokens=(), target_argmax=(11,))
    _, result = run_acceptance([chain, SECOND_BRANCH, empty, chain])
    assert result.accepted_nodes.tolist() == [[0, 1, -1], [1, 5, 9], [-1, -1, -1], [0, 1, -1]]
    assert result.num_accepted.tolist() == [2, 3, 0, 2]
    assert result.last_accepted_node.tolist() == [1, 9, -1, 1]
    assert result.bonus_tokens.tolist() == [4, 42, 11, 4]


@pytest.mark.parametrize("widths", [[2, 1, 1], [2, 2, 1], [3, 2, 2], [4, 2]])
def test_every_planted_node_is_reached_in_the_issue_widths(widths):
    """Each node in turn holds the true continuation (all branches, first or not): its path is accepted."""
    tree = DraftTree.from_widths(widths)
    # siblings carry tokens 1, 2, ...; token 0 is never drafted, so an argmax of 0 stops the walk.
    draft = [1 + tree.parents[:node].count(parent) for node, parent in enumerate(tree.parents)]
    requests, paths = [], []
    for end in range(tree.num_nodes):
        path, node = [], end
        while node >= 0:
            path.insert(0, node)
            node = tree.parents[node]
        argmax = [0] * (tree.num_nodes + 1)
        for parent, child in zip([-1] + path, path):
            argmax[parent + 1] = draft[child]
        argmax[end + 1] = 100 + end
        requests.append(Request(tree.parents, tuple(draft), tuple(argmax)))
        paths.append(path)
    _, result = run_acceptance(requests)
    for b, path in enumerate(paths):
        assert result.accepted_nodes[b].tolist() == path + [-1] * (tree.max_depth - len(path))
        assert int(result.num_accepted[b]) == tree.depth[path[-1]] == len(path)
        assert int(result.bonus_tokens[b]) == 100 + path[-1]


def test_rejects_misshapen_inputs():
    packed = pack_trees([(-1, 0)])
    with pytest.raises(ValueError, match="target_argmax"):
        greedy_tree_acceptance(packed.parents, packed.cu_nodes, torch.zeros(2), torch.zeros(2), 2)
    with pytest.raises(ValueError, match="draft_tokens"):
        greedy_tree_acceptance(packed.parents, packed.cu_nodes, torch.zeros(3), torch.zeros(3), 2)


# --- greedy acceptance: properties against the node-by-node reference ----------------------------------------


@fast(150)
@given(random_batches())
def test_matches_reference_on_random_batches(requests):
    assert_matches_reference(requests)


@fast(60)
@given(random_batches(), st.integers(0, 6))
def test_depth_bound_caps_acceptance(requests, cap):
    assert_matches_reference(requests, max_depth=cap)


@fast(100)
@given(planted_batches())
def test_planted_continuation_is_accepted_exactly(batch):
    requests = [request for request, _ in batch]
    assert_matches_reference(requests)
    _, result = run_acceptance(requests)
    for b, (request, path) in enumerate(batch):
        assert int(result.num_accepted[b]) == len(path)  # = the planted node's depth; 0 when planted at the root
        assert result.accepted_nodes[b, : len(path)].tolist() == path
        assert int(result.bonus_tokens[b]) == request.target_argmax[(path[-1] if path else -1) + 1]


@fast(60)
@given(random_batches())
def test_nothing_accepted_when_no_root_child_matches(requests):
    requests = [
        Request(r.parents, r.draft_tokens, (-5,) + r.target_argmax[1:]) for r in requests  # -5: never drafted
    ]
    _, result = run_acceptance(requests)
    assert (result.accepted_nodes == -1).all()
    assert (result.num_accepted == 0).all() and (result.last_accepted_node == -1).all()
    assert (result.bonus_tokens == -5).all()


# --- the tests can fail: planted wrong rules are caught ------------------------------------------------------


def first_child_only(parents, cu_nodes, draft_tokens, target_argmax, max_depth) -> TreeAcceptance:
    """Wrong rule: only the first child of each node is ever considered (a chain walk on a tree)."""
    first_child = torch.zeros(parents.numel(), dtype=torch.bool)
    for b in range(cu_nodes.numel() - 1):
        start, end = int(cu_nodes[b]), int(cu_nodes[b + 1])
        local = parents[start:end].tolist()
        first_child[start:end] = torch.tensor([p not in local[:i] for i, p in enumerate(local)], dtype=torch.bool)
    hidden = torch.where(first_child, draft_tokens, -7)  # -7: never an argmax
    return greedy_tree_acceptance(parents, cu_nodes, hidden, target_argmax, max_depth)


def bonus_at_root(parents, cu_nodes, draft_tokens, target_argmax, max_depth) -> TreeAcceptance:
    """Wrong rule: the bonus token read at the root instead of at the last accepted node."""
    result = greedy_tree_acceptance(parents, cu_nodes, draft_tokens, target_argmax, max_depth)
    return result._replace(bonus_tokens=target_argmax[verified_block_offsets(cu_nodes)[:-1]])


def fails(acceptance, requests) -> bool:
    try:
        assert_matches_reference(requests, acceptance=acceptance)
    except AssertionError:
        return True
    return False


@pytest.mark.parametrize("wrong_rule", [first_child_only, bonus_at_root])
def test_property_catches_a_wrong_rule(wrong_rule):
    assert fails(wrong_rule, [SECOND_BRANCH])
    counterexample = find(
        random_batches(), lambda requests: fails(wrong_rule, requests), settings=settings(database=None)
    )
    assert fails(wrong_rule, counterexample) and not fails(greedy_tree_acceptance, counterexample)


# --- no host syncs, no data-dependent shapes -----------------------------------------------------------------


def test_runs_on_meta_tensors():
    """Meta tensors have no data: any .item(), bool(), nonzero or data-sized output would raise here."""
    packed = pack_trees([DraftTree.from_widths([3, 2, 2]).parents, (), (-1, 0)], device="meta")
    num_nodes, num_requests = packed.num_nodes, packed.num_requests
    result = greedy_tree_acceptance(
        packed.parents,
        packed.cu_nodes,
        torch.empty(num_nodes, dtype=torch.long, device="meta"),
        torch.empty(num_nodes + num_requests, dtype=torch.long, device="meta"),
        packed.max_depth,
    )
    assert result.accepted_nodes.shape == (num_requests, packed.max_depth)
    per_request = (result.num_accepted, result.last_accepted_node, result.bonus_tokens)
    assert all(t.shape == (num_requests,) for t in per_request)
    moves = accepted_kv_moves(result.accepted_nodes, torch.empty(num_requests, dtype=torch.long, device="meta"))
    assert moves.sources.shape == moves.destinations.shape == (num_requests, packed.max_depth)


# --- KV compaction --------------------------------------------------------------------------------------------


def test_kv_moves_for_the_second_branch_path():
    _, result = run_acceptance([SECOND_BRANCH, widths_request([1] * 3, [1, 2, 3], {-1: 1, 0: 2, 1: 3})])
    moves = accepted_kv_moves(result.accepted_nodes, torch.tensor([100, 7]))
    # request 0: node 1 at 102 -> 101, node 5 at 106 -> 102, node 9 at 110 -> 103 (102 read before it is written)
    assert moves.sources.tolist() == [[102, 106, 110], [-1, -1, -1]]
    assert moves.destinations.tolist() == [[101, 102, 103], [-1, -1, -1]]  # a chain's accepted KV is in place


def apply_at_once(cache, moves):
    cache = cache.clone()
    rows = torch.arange(cache.shape[0])[:, None].expand_as(moves.sources)
    copy = moves.sources >= 0
    cache[rows[copy], moves.destinations[copy]] = cache[rows[copy], moves.sources[copy]]
    return cache


def apply_in_column_order(cache, moves, columns=None):
    cache = cache.clone()
    for column in columns if columns is not None else range(moves.sources.shape[1]):
        for b in range(cache.shape[0]):
            source, destination = int(moves.sources[b, column]), int(moves.destinations[b, column])
            if source >= 0:
                cache[b, destination] = cache[b, source]
    return cache


def compacted_correctly(cache, compacted, accepted_nodes, root_positions) -> bool:
    """Positions L + 1 .. L + k hold the accepted nodes' entries in path order; every other position unchanged."""
    expected = cache.clone()
    for b, (path, root) in enumerate(zip(accepted_nodes.tolist(), root_positions.tolist())):
        path = [node for node in path if node >= 0]
        for step, node in enumerate(path, start=1):
            expected[b, root + step] = cache[b, root + 1 + node]
    return bool(compacted.equal(expected))


@fast(100)
@given(planted_batches(), st.data())
def test_kv_moves_compact_the_accepted_path(batch, data):
    requests = [request for request, _ in batch]
    packed, result = run_acceptance(requests)
    root_positions = torch.tensor(data.draw(st.lists(st.integers(0, 20), min_size=len(batch), max_size=len(batch))))
    moves = accepted_kv_moves(result.accepted_nodes, root_positions)

    for b, (_, path) in enumerate(batch):
        expected = accepted_kv_moves_reference(path, int(root_positions[b]))
        got = [(s, d) for s, d in zip(moves.sources[b].tolist(), moves.destinations[b].tolist()) if s >= 0]
        assert got == expected
        assert ((moves.sources[b] >= 0) == (moves.destinations[b] >= 0)).all()

    # toy cache: one row per request, one distinct entry per position, room for the whole verified block
    width = 21 + 1 + packed.max_nodes + 2
    cache = torch.arange(len(batch) * width).reshape(len(batch), width)
    for apply in (apply_at_once, apply_in_column_order):
        assert compacted_correctly(cache, apply(cache, moves), result.accepted_nodes, root_positions)


def test_kv_moves_are_wrong_applied_in_reverse_column_order():
    """The ordering the docstring states matters: a later column overwrites an earlier column's source."""
    _, result = run_acceptance([SECOND_BRANCH])
    root_positions = torch.tensor([0])
    moves = accepted_kv_moves(result.accepted_nodes, root_positions)
    cache = torch.arange(16)[None]
    assert compacted_correctly(cache, apply_in_column_order(cache, moves), result.accepted_nodes, root_positions)
    reverse = apply_in_column_order(cache, moves, columns=reversed(range(moves.sources.shape[1])))
    assert not compacted_correctly(cache, reverse, result.accepted_nodes, root_positions)


def test_kv_moves_reject_misshapen_inputs():
    with pytest.raises(ValueError):
        accepted_kv_moves(torch.zeros(2, 3, dtype=torch.long), torch.zeros(3, dtype=torch.long))
