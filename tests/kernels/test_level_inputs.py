"""The inputs of an MTP drafting level (`kernels.level_inputs_*`): the Triton kernel (interpreted on CPU) writes exactly
what its torch twin writes, and the twin what the level's definition says (root then nodes, each node's hidden input
the head's output at its parent, depth positions capped, query starts and lengths), on random level trees, request
counts, hidden sizes (past one copy chunk), dtypes and strided views of larger buffers whose other rows stay as they
were."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_treewy.kernels.level_inputs_torch import level_inputs_torch
from vllm_treewy.kernels.level_inputs_triton import level_inputs_triton
from vllm_treewy.kernels.row_copy_triton import ROW_BLOCK
from vllm_treewy.tree import DraftTree

from .tree_cases import trees


def case(parents, num_requests, hidden_size, dtype, seed):
    generator = torch.Generator().manual_seed(seed)
    tree = DraftTree(tuple(parents))
    num_nodes, widest, spare = tree.num_nodes, tree.num_nodes + 3, 2
    depths = torch.tensor((0, *tree.depth), dtype=torch.int64)
    parent_blocks = torch.tensor(parents, dtype=torch.int64) + 1
    roots = torch.randint(0, 60, (num_requests,), generator=generator)
    root_tokens = torch.randint(0, 1000, (num_requests,), generator=generator, dtype=torch.int32)
    root_hidden = torch.randn(num_requests + spare, hidden_size, generator=generator).to(dtype)[:num_requests]
    all_tokens = torch.randint(0, 1000, (num_requests + spare, num_nodes + 4), generator=generator)
    outputs = torch.randn(num_requests + spare, widest, hidden_size, generator=generator).to(dtype)[:num_requests]
    rows = num_requests * (1 + num_nodes)

    def buffers():  # stale values past the level's rows must survive
        g = torch.Generator().manual_seed(seed + 1)
        return (torch.full((rows + 5,), -7, dtype=torch.int32),
                torch.randn(rows + 5, hidden_size, generator=g).to(dtype),
                torch.full((rows + 5,), -7, dtype=torch.int64), torch.full((num_requests + 4,), -7, dtype=torch.int32),
                torch.full((num_requests + 4,), -7, dtype=torch.int32))

    inputs = (root_tokens, root_hidden, all_tokens[:num_requests, :num_nodes], outputs, parent_blocks, depths, roots,
              40)
    return inputs, buffers, rows


def write(function, inputs, buffers, rows, num_requests):
    ids, hidden, positions, query_start_loc, seq_lens = buffers
    function(*inputs, ids[:rows], hidden[:rows], positions[:rows], query_start_loc[: num_requests + 1],
             seq_lens[:num_requests])
    return buffers


@settings(max_examples=30, deadline=None)
@given(parents=trees(max_nodes=9, max_depth=4), num_requests=st.integers(1, 4),
       hidden_size=st.sampled_from([1, 7, 64, ROW_BLOCK + 24]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]), seed=st.integers(0, 2**16))
def test_the_kernel_writes_what_the_twin_writes_and_the_twin_the_level(parents, num_requests, hidden_size, dtype,
                                                                      seed):
    inputs, buffers, rows = case(parents, num_requests, hidden_size, dtype, seed)
    want = write(level_inputs_torch, inputs, buffers(), rows, num_requests)
    got = write(level_inputs_triton, inputs, buffers(), rows, num_requests)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    root_tokens, root_hidden, node_tokens, outputs, parent_blocks, depths, roots, cap = inputs
    ids, hidden, positions, query_start_loc, seq_lens = want
    block_len = 1 + len(parents)
    for r in range(num_requests):
        for b in range(block_len):
            row = r * block_len + b
            parent = -1 if b == 0 else parents[b - 1]
            assert ids[row] == (root_tokens[r] if b == 0 else node_tokens[r, b - 1])
            assert torch.equal(hidden[row], root_hidden[r] if b == 0 else outputs[r, parent + 1])
            assert positions[row] == min(int(roots[r]) + int(depths[b]), cap)
        assert seq_lens[r] == int(roots[r]) + block_len
    assert query_start_loc[: num_requests + 1].tolist() == [r * block_len for r in range(num_requests + 1)]
    untouched = buffers()
    assert (ids[rows:] == untouched[0][rows:]).all() and torch.equal(hidden[rows:], untouched[1][rows:])
    assert (query_start_loc[num_requests + 1 :] == -7).all() and (seq_lens[num_requests:] == -7).all()
