"""The drafter's first-pass inputs with accepted paths laid out as chains (`kernels.accepted_chains_*`): the Triton
kernel (interpreted on CPU) writes exactly what its torch twin writes, and the twin what a per-token reference says
(a tree row's block row i takes its path's i-th token's id and hidden state and the position root + i; rows past the
path and every other token keep their own), on random trees and accepted paths, steps that mix tree rows with other
requests (decodes, prefill chunks) and padding, hidden sizes (past one copy chunk), dtypes and strided views, whose
rows past the step stay as they were. `trees.drafting.accepted_paths_as_chains` (V1's drafter) is the twin into new
tensors."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_treewy.kernels.accepted_chains_torch import accepted_chains_torch
from vllm_treewy.kernels.accepted_chains_triton import accepted_chains_triton
from vllm_treewy.kernels.row_copy_triton import ROW_BLOCK
from vllm_treewy.tree import DraftTree
from vllm_treewy.vllm_plugin.trees.drafting import accepted_paths_as_chains

from .tree_cases import trees


def random_path(tree: DraftTree, generator: torch.Generator) -> list[int]:
    """A root-to-node walk: at each node stop, or move to one of its children (node indices increase along it)."""
    path, node = [], -1
    while True:
        children = [n for n, p in enumerate(tree.parents) if p == node]
        choice = int(torch.randint(0, len(children) + 1, (), generator=generator))
        if choice == len(children):
            return path
        node = children[choice]
        path.append(node)


def case(parents, kinds, padding, hidden_size, dtype, seed):
    """A step whose requests are tree rows ("tree": a whole verified block) or other requests (an int: a query of
    that many tokens), then `padding` padding tokens; random ids, positions, hidden states and accepted paths."""
    generator = torch.Generator().manual_seed(seed)
    tree = DraftTree(tuple(parents))
    block_len = 1 + tree.num_nodes
    starts, num_tokens = [], 0
    for kind in kinds:
        if kind == "tree":
            starts.append(num_tokens)
        num_tokens += block_len if kind == "tree" else kind
    num_tokens += padding
    block_rows = (torch.tensor(starts, dtype=torch.int64)[:, None] + torch.arange(block_len)).reshape(-1, block_len)
    paths = [random_path(tree, generator) for _ in starts]
    accepted_nodes = torch.full((len(starts), tree.max_depth), -1, dtype=torch.int64)
    for row, path in enumerate(paths):
        accepted_nodes[row, : len(path)] = torch.tensor(path, dtype=torch.int64)
    root_positions = torch.randint(0, 500, (len(starts),), generator=generator)
    token_ids = torch.randint(0, 1000, (num_tokens,), generator=generator, dtype=torch.int32)
    positions = torch.randint(0, 500, (num_tokens,), generator=generator)
    wide = torch.randn(num_tokens, hidden_size + 3, generator=generator).to(dtype)
    inputs = (block_rows, accepted_nodes, root_positions, token_ids, positions, wide[:, :hidden_size])

    def buffers():  # persistent buffers longer than the step: their rows past it must survive
        g = torch.Generator().manual_seed(seed + 1)
        return (torch.full((num_tokens + 5,), -7, dtype=torch.int32), torch.full((num_tokens + 5,), -7),
                torch.randn(num_tokens + 5, hidden_size, generator=g).to(dtype))

    return inputs, paths, buffers, num_tokens


def write(function, inputs, buffers, num_tokens):
    function(*inputs, *(buffer[:num_tokens] for buffer in buffers))
    return buffers


def reference(inputs, paths):
    """Token by token: (source row, position) of every step token."""
    block_rows, accepted_nodes, root_positions, token_ids, positions, hidden_states = inputs
    block_len = block_rows.shape[1]
    rows = {int(block_rows[r, 0]): r for r in range(block_rows.shape[0])}
    sources, chain_positions = [], []
    for token in range(token_ids.shape[0]):
        request = next((r for start, r in rows.items() if start <= token < start + block_len), None)
        if request is None:
            sources.append(token)
            chain_positions.append(int(positions[token]))
            continue
        start, offset = int(block_rows[request, 0]), token - int(block_rows[request, 0])
        path = paths[request]
        sources.append(start + 1 + path[offset - 1] if 1 <= offset <= len(path) else token)
        chain_positions.append(int(root_positions[request]) + offset)
    return sources, chain_positions


request_kinds = st.lists(st.one_of(st.just("tree"), st.integers(1, 5)), min_size=1, max_size=5)


@settings(max_examples=30, deadline=None)
@given(parents=trees(max_nodes=9, max_depth=4), kinds=request_kinds, padding=st.integers(0, 3),
       hidden_size=st.sampled_from([1, 7, 64, ROW_BLOCK + 24]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]), seed=st.integers(0, 2**16))
def test_the_kernel_writes_what_the_twin_writes_and_the_twin_the_chains(parents, kinds, padding, hidden_size, dtype,
                                                                         seed):
    inputs, paths, buffers, num_tokens = case(parents, kinds, padding, hidden_size, dtype, seed)
    want = write(accepted_chains_torch, inputs, buffers(), num_tokens)
    got = write(accepted_chains_triton, inputs, buffers(), num_tokens)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    ids, chain_positions, hidden = want
    token_ids, hidden_states = inputs[3], inputs[5]
    sources, expected_positions = reference(inputs, paths)
    assert ids[:num_tokens].tolist() == token_ids[sources].tolist()
    assert chain_positions[:num_tokens].tolist() == expected_positions
    assert torch.equal(hidden[:num_tokens], hidden_states[sources])
    untouched = buffers()
    for a, b in zip(want, untouched):
        assert torch.equal(a[num_tokens:], b[num_tokens:])


def test_the_runners_helper_is_the_twin_into_new_tensors():
    inputs, _, buffers, num_tokens = case(DraftTree.from_widths([2, 2]).parents, ["tree", 3, "tree"], 2, 16,
                                          torch.bfloat16, 0)
    block_rows, accepted_nodes, root_positions, token_ids, positions, hidden_states = inputs
    step = SimpleNamespace(num_requests=block_rows.shape[0], block_len=block_rows.shape[1],
                           token_indices=block_rows.reshape(-1), root_positions=root_positions)
    got = accepted_paths_as_chains(step, SimpleNamespace(accepted_nodes=accepted_nodes), token_ids, positions,
                                   hidden_states)
    want = write(accepted_chains_torch, inputs, buffers(), num_tokens)
    for a, b in zip(got, want):
        assert torch.equal(a, b[:num_tokens])
