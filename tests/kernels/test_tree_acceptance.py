"""Tree acceptance on the runner's logits layout (`kernels.tree_acceptance_*`): the Triton kernel (interpreted on CPU)
equals its torch twin on every output, and both equal the node-by-node reference (`greedy_tree_acceptance_reference`,
the walk written plainly), on random trees, batches that mix tree rows with one-token rows and rows of several logits
rows, planted paths of every depth (and draws that match nothing), fewer or more speculative columns than the depth,
and synthetic acceptance (its decisions from the uniforms and the rates of each row's request state, by hand)."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_treewy.kernels.tree_acceptance_torch import PLACEHOLDER_TOKEN, SyntheticDraw, tree_acceptance_torch
from vllm_treewy.kernels.tree_acceptance_triton import tree_acceptance_triton
from vllm_treewy.spec_decode.acceptance import UniformWalkTables, greedy_tree_acceptance_reference
from vllm_treewy.spec_decode.synthetic_acceptance import NodeRateIndex, conditional_rates_reference

from .tree_cases import trees

VOCAB = 50


def step_layout(parents, kinds, extra_columns, generator):
    """A step whose batch rows are `kinds` ("tree": a verified block; "one": one logits row; "many": three logits
    rows of a row that is not a tree row), its drafts and draws planted so that each tree row walks a random path
    (the draw at each node of it is one child's token; elsewhere tokens no draft carries)."""
    num_nodes = len(parents)
    block_len = 1 + num_nodes
    lengths = [block_len if kind == "tree" else 3 if kind == "many" else 1 for kind in kinds]
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
    request_indices = torch.tensor([b for b, kind in enumerate(kinds) if kind == "tree"])
    input_ids = torch.randint(0, VOCAB, (int(cu[-1]) + 5,), generator=generator, dtype=torch.int32)
    token_indices = (cu.long()[request_indices][:, None] + 2 + torch.arange(block_len)).contiguous()  # shifted rows
    draws = torch.randint(VOCAB, 2 * VOCAB, (int(cu[-1]),), generator=generator)  # nothing matches by default
    for r, b in enumerate(request_indices.tolist()):
        drafts = input_ids[token_indices[r, 1:]]
        current = -1
        for _ in range(int(torch.randint(0, len(parents) + 1, (1,), generator=generator))):
            children = [n for n, p in enumerate(parents) if p == current]
            if not children:
                break
            child = children[int(torch.randint(0, len(children), (1,), generator=generator))]
            draws[int(cu[b]) + 1 + current] = drafts[child]
            current = child
    depth = UniformWalkTables.of(list(parents), "cpu").node_at_depth.shape[1]
    return draws, cu, request_indices, token_indices, input_ids, depth + extra_columns


def assert_equal_rows(got, want):
    for name, a, b in zip(want._fields, got, want):
        if name == "acceptance":
            for field, x, y in zip(b._fields, a, b):
                assert torch.equal(x, y), field
        else:
            assert torch.equal(a, b), name


@settings(max_examples=40, deadline=None)
@given(parents=trees(max_nodes=12, max_depth=5), kinds=st.lists(st.sampled_from(["tree", "tree", "one", "many"]),
                                                                  min_size=1, max_size=6),
       extra_columns=st.integers(0, 3), seed=st.integers(0, 2**16))
def test_the_kernel_equals_the_twin_and_the_node_by_node_walk(parents, kinds, extra_columns, seed):
    if "tree" not in kinds:
        kinds = [*kinds, "tree"]
    generator = torch.Generator().manual_seed(seed)
    draws, cu, rows, token_indices, input_ids, steps = step_layout(parents, kinds, extra_columns, generator)
    tables = UniformWalkTables.of(list(parents), "cpu")
    args = (draws, cu, rows, token_indices, input_ids, tables, steps)
    want = tree_acceptance_torch(*args)
    assert_equal_rows(tree_acceptance_triton(*args), want)
    block_len = 1 + len(parents)
    for b in range(len(kinds)):
        start, end = int(cu[b]), int(cu[b + 1])
        if b in rows.tolist():
            r = rows.tolist().index(b)
            drafts = input_ids[token_indices[r, 1:]].tolist()
            path, bonus = greedy_tree_acceptance_reference(parents, drafts, draws[start:end].tolist())
            emitted = [drafts[n] for n in path] + [bonus]
            assert want.sampled[b].tolist() == emitted + [PLACEHOLDER_TOKEN] * (steps + 1 - len(emitted))
            assert want.num_sampled[b] == len(emitted) and want.leaf_counts[b] == (path[-1] + 2 if path else 1)
            blocks = [0] + [1 + n for n in path] + list(range(1 + len(path), block_len))
            assert want.chain_rows[start:end].tolist() == [start + i for i in blocks]
            assert want.acceptance.accepted_nodes[r].tolist()[: len(path)] == path
            assert int(want.acceptance.bonus_tokens[r]) == bonus
        else:
            assert want.sampled[b].tolist() == [int(draws[end - 1])] + [PLACEHOLDER_TOKEN] * steps
            assert want.num_sampled[b] == 1 and want.leaf_counts[b] == 0
            assert want.chain_rows[start:end].tolist() == list(range(start, end))


@settings(max_examples=25, deadline=None)
@given(parents=trees(max_nodes=10, max_depth=4), kinds=st.lists(st.sampled_from(["tree", "one"]), min_size=1,
                                                                  max_size=5),
       seed=st.integers(0, 2**16))
def test_synthetic_acceptance_takes_the_first_carrying_child_whatever_the_tokens(parents, kinds, seed):
    if "tree" not in kinds:
        kinds = [*kinds, "tree"]
    generator = torch.Generator().manual_seed(seed)
    draws, cu, rows, token_indices, input_ids, steps = step_layout(parents, kinds, 0, generator)
    tables = UniformWalkTables.of(list(parents), "cpu")
    depth = tables.node_at_depth.shape[1]
    num_states = 7
    rates = torch.rand(num_states, 2, depth, generator=generator)
    slots = torch.randperm(num_states, generator=generator)[: len(kinds)]
    uniforms = torch.rand(rows.numel(), len(parents), dtype=torch.float64, generator=generator)
    synthetic = SyntheticDraw(uniforms, rates, slots, NodeRateIndex.of(parents, "cpu").index)
    args = (draws, cu, rows, token_indices, input_ids, tables, steps, synthetic)
    want = tree_acceptance_torch(*args)
    assert_equal_rows(tree_acceptance_triton(*args), want)
    for r, b in enumerate(rows.tolist()):
        node_rates = conditional_rates_reference(parents, rates[int(slots[b])].tolist())
        carries = [float(uniforms[r, n]) < float(torch.tensor(node_rates[n], dtype=torch.float32)) for n in
                   range(len(parents))]
        path, current = [], -1
        while True:
            taken = [n for n, p in enumerate(parents) if p == current and carries[n]]
            if not taken:
                break
            current = taken[0]
            path.append(current)
        assert [n for n in want.acceptance.accepted_nodes[r].tolist() if n >= 0] == path
        assert int(want.acceptance.bonus_tokens[r]) == int(draws[int(cu[b]) + 1 + current])
