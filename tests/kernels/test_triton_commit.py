import pytest
import torch

from vllm_treewy.kernels.closed_form import commit_packed
from vllm_treewy.kernels.reference import reference_tree_recurrence

from .tree_cases import relative_error
from .triton_cases import CHAIN_BATCH, DEVICE, TREE_BATCH, packed_gdn, rows, to_device

from vllm_treewy.kernels.triton import (  # noqa: E402
    commit_layers_triton,
    commit_packed_triton,
    state_pool_table,
    verify_packed_triton,
)

TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 1e-2}


def verified(batch, seed, state_dtype, chain=False):
    packed, inputs, pool, slots = packed_gdn(batch, seed=seed)
    dev = to_device(*inputs, slots, packed.parents, packed.cu_nodes)
    q, k, v, g, beta, dev_slots, parents, cu_nodes = dev
    state = pool.to(state_dtype).to(DEVICE)
    bounds = dict(max_nodes=packed.max_nodes, max_depth=packed.max_depth, chain=chain, block_v=16)
    _, u = verify_packed_triton(q, k, v, g, beta, state, dev_slots, parents, cu_nodes, **bounds)
    return packed, inputs, slots, state, (dev_slots, k, u, g, parents, cu_nodes), bounds


@pytest.mark.parametrize(
    "batch, chain, state_dtype, block_k",
    [
        (TREE_BATCH, False, torch.float32, None),
        (TREE_BATCH, False, torch.bfloat16, 16),
        (CHAIN_BATCH, True, torch.float32, 16),
    ],
)
def test_commit_every_node_matches_reference_and_twin(batch, chain, state_dtype, block_k):
    packed, inputs, slots, state, factors, bounds = verified(batch, 21, state_dtype, chain)
    dev_slots, k, u, g, parents, cu_nodes = factors
    h0 = state.cpu()
    expected = [
        reference_tree_recurrence(*(x[rows(packed, b)] for x in inputs), h0[slots[b]], p).state
        for b, p in enumerate(batch)
    ]
    for node in range(packed.max_nodes):
        # requests with fewer nodes accept nothing (-1): their slot must stay as it was
        accepted = torch.tensor([node if node < len(p) else -1 for p in batch], dtype=torch.int32)
        committed = state.clone()
        commit_packed_triton(committed, *factors[:-1], cu_nodes, accepted.to(DEVICE), block_k=block_k, **bounds)
        twin = h0.clone()
        commit_packed(twin, slots, inputs[1], u.cpu(), inputs[3], packed.parents, packed.cu_nodes, accepted)
        committed = committed.cpu()
        assert relative_error(committed, twin) <= TOLERANCE[state_dtype]
        for b in range(len(batch)):
            if accepted[b] < 0:
                assert torch.equal(committed[slots[b]], h0[slots[b]])
            else:
                assert relative_error(committed[slots[b]], expected[b][node]) <= TOLERANCE[state_dtype]
        spare = sorted(set(range(h0.shape[0])) - set(slots.tolist()))
        assert torch.equal(committed[spare], h0[spare])


def test_commit_all_layers_in_one_launch():
    layers = [verified(TREE_BATCH, 30 + layer, torch.float32) for layer in range(3)]
    packed, _, slots, _, (dev_slots, _, _, _, parents, cu_nodes), bounds = layers[0]
    # the layers share the tree and the slots; each has its own pool and factors
    k, u, g = (torch.stack([layer[4][i] for layer in layers]) for i in (1, 2, 3))
    accepted = torch.tensor([7, 3, -1, 2], dtype=torch.int32, device=DEVICE)
    expected = [layer[3].clone() for layer in layers]
    for layer, pool in enumerate(expected):
        commit_packed_triton(pool, dev_slots, k[layer], u[layer], g[layer], parents, cu_nodes, accepted, **bounds)
    by_list = [layer[3].clone() for layer in layers]
    commit_layers_triton(by_list, dev_slots, k, u, g, parents, cu_nodes, accepted, **bounds)
    by_table = [layer[3].clone() for layer in layers]
    commit_layers_triton(state_pool_table(by_table), dev_slots, k, u, g, parents, cu_nodes, accepted,
                         pool_like=by_table[0], **bounds)
    for a, b, c in zip(expected, by_list, by_table):
        assert torch.equal(a, b) and torch.equal(a, c)


def test_commit_with_measured_launch_defaults():
    """No explicit block sizes: the wrapper picks its measured launch configuration (as the adapter calls it)."""
    from vllm_treewy.kernels import commit_packed
    from vllm_treewy.kernels.triton import commit_packed_triton

    gen = torch.Generator().manual_seed(0)
    state = torch.randn(3, 4, 16, 16, generator=gen)
    expected = state.clone()
    k = torch.nn.functional.normalize(torch.randn(5, 2, 16, generator=gen), dim=-1)
    u, g = torch.randn(5, 4, 16, generator=gen), -torch.rand(5, 4, generator=gen)
    parents = torch.tensor([-1, 0, 1, -1, 0], dtype=torch.int32)
    cu_nodes, slots = torch.tensor([0, 3, 5], dtype=torch.int32), torch.tensor([2, 0], dtype=torch.int32)
    accepted = torch.tensor([1, 1], dtype=torch.int32)
    commit_packed_triton(state, slots, k, u, g, parents, cu_nodes, accepted, max_nodes=3, chain=True)
    commit_packed(expected, slots, k, u, g, parents, cu_nodes, accepted)
    torch.testing.assert_close(state, expected, rtol=1e-5, atol=1e-5)
