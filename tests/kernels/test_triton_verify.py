import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_treewy.kernels.closed_form import verify_packed
from vllm_treewy.kernels.reference import reference_tree_recurrence
from vllm_treewy.tree import pack_trees

from .tree_cases import relative_error, trees
from .triton_cases import CHAIN_BATCH, DEVICE, TREE_BATCH, packed_gdn, rows, to_device

from vllm_treewy.kernels.triton import (  # noqa: E402
    PendingCommit,
    ancestor_table,
    ancestor_table_torch,
    ancestor_table_triton,
    commit_packed_triton,
    verify_packed_triton,
)

TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 2e-2}


def run_verify(packed, inputs, pool, slots, state_dtype, **kwargs):
    q, k, v, g, beta = to_device(*inputs)
    state = pool.to(state_dtype).to(DEVICE)
    o, u = verify_packed_triton(
        q, k, v, g, beta, state, slots.to(DEVICE), packed.parents.to(DEVICE), packed.cu_nodes.to(DEVICE),
        max_nodes=packed.max_nodes, max_depth=packed.max_depth, block_v=16, **kwargs,
    )
    return o.cpu(), u.cpu(), state.cpu()


@pytest.mark.parametrize(
    "batch, chain, state_dtype, solve, gate, block_k",
    [
        (TREE_BATCH, False, torch.float32, "neumann", "mixed", 16),
        (TREE_BATCH, False, torch.float32, "substitution", "near_one", None),
        (TREE_BATCH, False, torch.bfloat16, "neumann", "near_zero", None),
        (CHAIN_BATCH, True, torch.float32, "neumann", "near_one", None),
        (CHAIN_BATCH, True, torch.bfloat16, "substitution", "mixed", 16),
    ],
)
def test_verify_matches_reference_and_twin(batch, chain, state_dtype, solve, gate, block_k):
    packed, inputs, pool, slots = packed_gdn(batch, gate=gate, seed=len(batch))
    o, u, state = run_verify(packed, inputs, pool, slots, state_dtype, chain=chain, solve=solve, block_k=block_k)
    twin_o, twin_u = verify_packed(*inputs, state, slots, packed.parents, packed.cu_nodes)
    assert relative_error(o, twin_o) <= TOLERANCE[state_dtype]
    assert relative_error(u, twin_u) <= TOLERANCE[state_dtype]
    for b, parents in enumerate(batch):
        r = rows(packed, b)
        expected = reference_tree_recurrence(*(x[r] for x in inputs), state[slots[b]], parents)
        assert relative_error(o[r], expected.o) <= TOLERANCE[state_dtype]
        assert relative_error(u[r], expected.u) <= TOLERANCE[state_dtype]


def test_bf16_inputs_and_state():
    packed, inputs, pool, slots = packed_gdn(TREE_BATCH, dtype=torch.bfloat16, seed=3)
    o, u, state = run_verify(packed, inputs, pool, slots, torch.bfloat16)
    assert o.dtype == torch.bfloat16 and u.dtype == torch.float32
    for b, parents in enumerate(TREE_BATCH):
        r = rows(packed, b)
        expected = reference_tree_recurrence(*(x[r] for x in inputs), state[slots[b]], parents)
        assert relative_error(o[r], expected.o) <= 1e-2
        assert relative_error(u[r], expected.u) <= 1e-2


def test_padding_requests_are_skipped_and_state_untouched():
    packed, inputs, pool, slots = packed_gdn(TREE_BATCH, seed=5)
    slots[1] = -1
    q, k, v, g, beta = to_device(*inputs)
    state = pool.float().to(DEVICE)
    before = state.clone()
    o = torch.full_like(v, float("nan"))
    u = torch.full(v.shape, float("nan"), device=DEVICE)
    verify_packed_triton(q, k, v, g, beta, state, slots.to(DEVICE), packed.parents.to(DEVICE),
                         packed.cu_nodes.to(DEVICE), max_nodes=packed.max_nodes, max_depth=packed.max_depth,
                         block_v=16, o=o, u=u)
    assert torch.equal(state, before)
    for b in range(len(TREE_BATCH)):
        r = rows(packed, b)
        assert bool(o[r].isnan().all() if b == 1 else o[r].isfinite().all())
        assert bool(u[r].isnan().all() if b == 1 else u[r].isfinite().all())


def test_chain_flag_equals_tree_walk():
    packed, inputs, pool, slots = packed_gdn(CHAIN_BATCH, seed=7)
    by_chain = run_verify(packed, inputs, pool, slots, torch.float32, chain=True)
    by_walk = run_verify(packed, inputs, pool, slots, torch.float32, chain=False)
    for a, b in zip(by_chain[:2], by_walk[:2]):
        assert relative_error(a, b) <= 1e-6


def commit_rounding_bound(state, slots, k, u, g, trees, accepted):
    """Elementwise bound on how far two fp32 evaluations of the commit may differ, in fp64.

    The fused and the separate commit compute the same ``h_a = exp(c_a) h0 + sum_j exp(c_a - c_j) u_j k_j^T``
    with different tiles and summation orders, so they agree to rounding only. With n = path length, each
    evaluation's sum of n + 1 products carries at most (n + 2) eps of the sum of the terms' magnitudes (the
    classic gamma_n summation bound, plus the product's rounding), and each decay factor exp(x) with x a sum of up
    to n fp32 log decays carries (n |x| + 1) eps more. Two evaluations differ by at most twice that. A bf16 state
    may also round the two fp32 results to neighbouring bf16 values: one bf16 step (2^-8 relative) more.
    Slots that no commit touches get a zero bound: they must match exactly.
    """
    eps = torch.finfo(torch.float32).eps
    bound = torch.zeros(state.shape, dtype=torch.float64)
    ratio = u.shape[1] // k.shape[1]
    start = 0
    for parents, slot, a in zip(trees, slots.tolist(), accepted.tolist()):
        if a >= 0 and slot >= 0:
            path = [a]
            while parents[path[-1]] >= 0:
                path.append(parents[path[-1]])
            n = len(path)
            log_decay = g[[start + j for j in path]].double().sum(0)  # c_a, [HV]
            terms = (log_decay.exp() * (n * log_decay.abs() + 1))[:, None, None] * state[slot].double().abs()
            for j in path:
                x = g[[start + i for i in path[: path.index(j)]]].double().sum(0)  # c_a - c_j
                factor = x.exp() * (n * x.abs() + 1)
                keys = k[start + j].double().abs().repeat_interleave(ratio, 0)  # [HV, K]
                terms += factor[:, None, None] * u[start + j].double().abs()[:, :, None] * keys[:, None, :]
            bound[slot] = 2 * (n + 2) * eps * terms
            if state.dtype == torch.bfloat16:
                bound[slot] += 2.0**-8 * state[slot].double().abs()  # the old value's scale is not the new one's
        start += len(parents)
    return bound


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_pending_commit_fused_into_next_verify(state_dtype):
    """Commit of step 1 inside step 2's verify == separate commit, then verify (state and outputs), to rounding."""
    prev, prev_inputs, pool, slots = packed_gdn(TREE_BATCH, seed=11)
    nxt, next_inputs, _, _ = packed_gdn(CHAIN_BATCH + [(-1,)], seed=12)
    accepted = torch.tensor([4, -1, 0, 2], dtype=torch.int32)
    pq, pk, pv, pg, pbeta = to_device(*prev_inputs)
    state = pool.to(state_dtype).to(DEVICE)
    dev_slots, dev_acc = slots.to(DEVICE), accepted.to(DEVICE)
    bounds = dict(max_nodes=prev.max_nodes, max_depth=prev.max_depth)
    _, u = verify_packed_triton(pq, pk, pv, pg, pbeta, state, dev_slots, prev.parents.to(DEVICE),
                                prev.cu_nodes.to(DEVICE), block_v=16, **bounds)
    before = state.cpu().clone()
    separate = state.clone()
    commit_packed_triton(separate, dev_slots, pk, u, pg, prev.parents.to(DEVICE), prev.cu_nodes.to(DEVICE), dev_acc,
                         block_v=16, **bounds)
    nq, nk, nv, ng, nbeta = to_device(*next_inputs)
    step = dict(max_nodes=nxt.max_nodes, chain=True, block_v=16, block_k=16)
    o_sep, u_sep = verify_packed_triton(nq, nk, nv, ng, nbeta, separate, dev_slots, nxt.parents.to(DEVICE),
                                        nxt.cu_nodes.to(DEVICE), **step)
    pending = PendingCommit(pk, u, pg, prev.parents.to(DEVICE), prev.cu_nodes.to(DEVICE), dev_acc, **bounds)
    o_fused, u_fused = verify_packed_triton(nq, nk, nv, ng, nbeta, state, dev_slots, nxt.parents.to(DEVICE),
                                            nxt.cu_nodes.to(DEVICE), pending=pending, **step)
    state, separate = state.cpu(), separate.cpu()
    bound = commit_rounding_bound(before, slots, pk.cpu(), u.cpu(), pg.cpu(), TREE_BATCH, accepted)
    assert bool(((state.double() - separate.double()).abs() <= bound).all())
    assert not torch.equal(state, before), "the fused commit must have written the accepted states"
    # The next verify is linear in h0 with coefficients of order one (normalised q, k, beta < 1): its outputs
    # inherit the state's relative difference, ~1e-7 for fp32 and one bf16 step for a bf16 state.
    tolerance = 1e-5 if state_dtype == torch.float32 else 2.0**-7
    assert relative_error(o_fused.cpu(), o_sep.cpu()) <= tolerance
    assert relative_error(u_fused.cpu(), u_sep.cpu()) <= tolerance


@pytest.mark.parametrize("build", [ancestor_table, ancestor_table_torch, ancestor_table_triton])
def test_ancestor_table_walks_parents(build):
    packed = pack_trees(TREE_BATCH)
    table = build(packed.parents.to(DEVICE), packed.cu_nodes.to(DEVICE), packed.max_depth).cpu()
    for b, parents in enumerate(TREE_BATCH):
        for i, row in enumerate(table[rows(packed, b)].tolist()):
            expected, cur = [], i
            for _ in range(packed.max_depth):
                expected.append(cur)
                cur = parents[cur] if cur >= 0 else -1
            assert row == expected


@settings(max_examples=25, deadline=None)
@given(batch=st.lists(trees(max_nodes=130, max_depth=12), min_size=1, max_size=4), depth=st.integers(1, 12))
def test_ancestor_table_kernel_matches_twin(batch, depth):
    """Random packed trees, past one 64-node block per request, depths clipped below and above the deepest path."""
    packed = pack_trees(batch)
    expected = ancestor_table_torch(packed.parents, packed.cu_nodes, depth)
    table = ancestor_table_triton(packed.parents.to(DEVICE), packed.cu_nodes.to(DEVICE), depth).cpu()
    assert torch.equal(table, expected)
