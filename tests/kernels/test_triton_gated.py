"""The fused GDN step after the conv (gates, q/k L2 norm, verify, gated RMSNorm, pending commit) against its torch
twin and the fp64 per-node reference, on random packed trees, shapes, gates and head counts (Triton interpreter on
CPU)."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_treewy.kernels.gated import gdn_commit_packed, gdn_step_packed
from vllm_treewy.kernels.reference import reference_gated_tree
from vllm_treewy.tree import pack_trees

from .tree_cases import chains, relative_error, trees
from .triton_cases import DEVICE, rows

from vllm_treewy.kernels.triton import GatedPending, gdn_commit_triton, gdn_step_triton  # noqa: E402

# a fp32 state keeps fp32 accuracy end to end (no tf32/bf16 rounding of the state products)
TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 2e-2}


def gated_inputs(batch, key_heads, ratio, key_dim, value_dim, seed, gate_scale=1.0, dtype=torch.float32):
    """Raw post-conv inputs as vLLM holds them: mixed_qkv, a, b, A_log, dt_bias, z, norm weight; a state pool."""
    gen = torch.Generator().manual_seed(seed)
    packed = pack_trees(batch)
    n, hv = packed.num_nodes, key_heads * ratio
    width = 2 * key_heads * key_dim + hv * value_dim
    mixed_qkv = torch.randn(n, width, generator=gen, dtype=torch.float64)
    a = torch.randn(n, hv, generator=gen, dtype=torch.float64) * 3 * gate_scale
    b = torch.randn(n, hv, generator=gen, dtype=torch.float64) * 2
    A_log = torch.randn(hv, generator=gen, dtype=torch.float64) * gate_scale
    dt_bias = torch.randn(hv, generator=gen, dtype=torch.float64)
    z = torch.randn(n, hv, value_dim, generator=gen, dtype=torch.float64)
    weight = 1 + 0.1 * torch.randn(value_dim, generator=gen, dtype=torch.float64)
    slots = torch.randperm(len(batch) + 2, generator=gen)[: len(batch)].to(torch.int32)
    pool = torch.randn(len(batch) + 2, hv, value_dim, key_dim, generator=gen, dtype=torch.float64) * 0.3
    inputs = [x.to(dtype) for x in (mixed_qkv, a, b)] + [A_log.float(), dt_bias.float(), z.to(dtype), weight.to(dtype)]
    return packed, inputs, pool, slots


def run_step(packed, inputs, state, slots, key_heads, chain=False, pending=None, **kw):
    dev = [x.to(DEVICE) for x in inputs]
    return gdn_step_triton(*dev, state, slots.to(DEVICE), packed.parents.to(DEVICE), packed.cu_nodes.to(DEVICE),
                           num_key_heads=key_heads, max_nodes=packed.max_nodes, max_depth=packed.max_depth,
                           chain=chain, pending=pending, **kw)


def check_against_reference(packed, inputs, pool_before, slots, batch, key_heads, out, factors, tolerance):
    for b, parents in enumerate(batch):
        r = rows(packed, b)
        expected = reference_gated_tree(*(x[r] for x in inputs[:3]), *inputs[3:5], inputs[5][r], inputs[6],
                                        pool_before[int(slots[b])], parents, key_heads)
        assert relative_error(out[r].cpu(), expected.out) <= tolerance
        assert relative_error(factors.u[r].cpu(), expected.recurrence.u) <= tolerance
        assert relative_error(factors.g[r].cpu(), expected.g) <= 1e-5


@settings(max_examples=8, deadline=None)
@given(
    batch=st.lists(trees(max_nodes=12, max_depth=5), min_size=1, max_size=3),
    key_heads=st.integers(1, 2),
    ratio=st.sampled_from([1, 2]),
    dims=st.sampled_from([(16, 16), (32, 16), (16, 32)]),
    state_dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    gate_scale=st.sampled_from([0.1, 1.0, 3.0]),
    seed=st.integers(0, 2**16),
    variant=st.sampled_from([{}, dict(row_sums=True, late_node_terms=True), dict(late_node_terms=True)]),
)
def test_gated_step_matches_reference_and_twin(batch, key_heads, ratio, dims, state_dtype, gate_scale, seed, variant):
    key_dim, value_dim = dims
    packed, inputs, pool, slots = gated_inputs(batch, key_heads, ratio, key_dim, value_dim, seed, gate_scale)
    state = pool.to(state_dtype).to(DEVICE)
    before = state.clone()
    out, factors = run_step(packed, inputs, state, slots, key_heads, block_k=4, **variant)
    assert torch.equal(state, before)  # verify never writes the state
    tolerance = TOLERANCE[state_dtype]
    check_against_reference(packed, inputs, state.cpu(), slots, batch, key_heads, out, factors, tolerance)
    twin_out, (_, twin_kscale, twin_u, twin_g) = gdn_step_packed(*inputs, state.cpu(), slots, packed.parents,
                                                                  packed.cu_nodes, num_key_heads=key_heads)
    assert relative_error(out.cpu(), twin_out) <= tolerance
    assert relative_error(factors.u.cpu(), twin_u) <= tolerance


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("next_chain", [True, False])
def test_pending_commit_inside_next_step(state_dtype, next_chain):
    """Step 1 (a tree batch), then step 2 with step 1's commit fused in == commit alone, then step 2; both match
    the fp64 reference's state after the accepted node."""
    key_heads, ratio, key_dim, value_dim = 2, 2, 16, 32
    first = [(-1, 0, 0, 1, 2), (-1, 0, 1), (-1,)]
    second = [(-1, 0, 1, 2), (-1, 0), (-1, 0, 1)] if next_chain else [(-1, 0, 0), (-1, -1), (-1, 0, 1, 1)]
    packed, inputs, pool, slots = gated_inputs(first, key_heads, ratio, key_dim, value_dim, seed=3)
    state = pool.to(state_dtype).to(DEVICE)
    h0 = state.cpu().clone()
    _, factors = run_step(packed, inputs, state, slots, key_heads, block_k=8)
    accepted = torch.tensor([3, -1, 0], dtype=torch.int32)
    pending = GatedPending(factors, packed.parents.to(DEVICE), packed.cu_nodes.to(DEVICE), accepted.to(DEVICE),
                           max_nodes=packed.max_nodes, max_depth=packed.max_depth)
    separate = state.clone()
    gdn_commit_triton(separate, slots.to(DEVICE), pending, num_key_heads=key_heads, block_k=8)
    # commit vs the fp64 reference state of the accepted node (a bf16 state is rounded once on the way out)
    state_tolerance = 2e-5 if state_dtype == torch.float32 else 1e-2
    for b, parents in enumerate(first):
        r = rows(packed, b)
        slot = int(slots[b])
        if accepted[b] < 0:
            assert torch.equal(separate[slot].cpu(), h0[slot])
            continue
        expected = reference_gated_tree(*(x[r] for x in inputs[:3]), *inputs[3:5], inputs[5][r], inputs[6],
                                        h0[slot], parents, key_heads)
        assert relative_error(separate[slot].cpu(), expected.recurrence.state[int(accepted[b])]) <= state_tolerance
    # torch twin of the commit
    twin = h0.clone()
    gdn_commit_packed(twin, slots, factors.k.cpu(), factors.k_scale.cpu(), factors.u.cpu(), factors.g.cpu(),
                      packed.parents, packed.cu_nodes, accepted)
    assert relative_error(separate.cpu(), twin.double()) <= state_tolerance
    nxt, next_inputs, _, _ = gated_inputs(second, key_heads, ratio, key_dim, value_dim, seed=4)
    out_sep, f_sep = run_step(nxt, next_inputs, separate, slots, key_heads, chain=next_chain, block_k=8)
    variant = dict(row_sums=True, late_node_terms=True) if next_chain else {}
    out_fused, f_fused = run_step(nxt, next_inputs, state, slots, key_heads, chain=next_chain, pending=pending,
                                  block_k=8, **variant)
    assert torch.equal(state, separate)
    if variant:  # other summation order: equal within fp32 rounding
        assert relative_error(out_fused.cpu(), out_sep.cpu().double()) <= 1e-5
        assert relative_error(f_fused.u.cpu(), f_sep.u.cpu().double()) <= 1e-5
    else:
        assert torch.equal(out_fused, out_sep) and torch.equal(f_fused.u, f_sep.u)


def test_padding_request_untouched():
    batch = [(-1, 0, 1), (-1, 0), (-1, 0, 1, 2)]
    packed, inputs, pool, slots = gated_inputs(batch, 1, 2, 16, 16, seed=9)
    slots[1] = -1
    state = pool.float().to(DEVICE)
    before = state.clone()
    out = torch.full((packed.num_nodes, 2, 16), float("nan"), device=DEVICE)
    run_step(packed, inputs, state, slots, 1, chain=True, out=out, block_k=4)
    assert torch.equal(state, before)
    for b in range(len(batch)):
        r = rows(packed, b)
        assert bool(out[r].isnan().all() if b == 1 else out[r].isfinite().all())


@settings(max_examples=4, deadline=None)
@given(batch=st.lists(chains(max_nodes=8), min_size=1, max_size=3), seed=st.integers(0, 2**16),
       activation=st.sampled_from(["silu", "sigmoid"]))
def test_chain_flag_and_activation(batch, seed, activation):
    packed, inputs, pool, slots = gated_inputs(batch, 1, 2, 16, 16, seed)
    state = pool.float().to(DEVICE)
    by_chain, _ = run_step(packed, inputs, state, slots, 1, chain=True, activation=activation, block_k=4)
    by_walk, _ = run_step(packed, inputs, state, slots, 1, chain=False, activation=activation, block_k=4)
    assert relative_error(by_chain.cpu(), by_walk.cpu().double()) <= 1e-6
    twin, _ = gdn_step_packed(*inputs, state.cpu(), slots, packed.parents, packed.cu_nodes, num_key_heads=1,
                              activation=activation)
    assert relative_error(by_chain.cpu(), twin.double()) <= 2e-5
