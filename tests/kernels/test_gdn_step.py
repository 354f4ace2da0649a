"""The fused GDN step after the conv (gates, q/k L2 norm, verify, gated RMSNorm, the pending chain commit from the
slots' factor rows, along a chain or a static tree) against its torch twin and the fp64 per-node reference, on
random packed trees and chains, shapes, gates, head counts, padding and zero-node requests (Triton interpreter on
CPU)."""

import pytest
import torch
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st

from vllm_treewy.kernels.gated import gdn_commit_packed, gdn_step_packed, slot_factor_width, split_slot_factors
from vllm_treewy.kernels.reference import reference_gated_tree
from vllm_treewy.kernels.triton._tree import ancestor_table_torch
from vllm_treewy.tree import DraftTree, pack_trees

from .tree_cases import chains, relative_error, trees
from .triton_cases import DEVICE, rows

from vllm_treewy.kernels.triton import gdn_commit_triton, gdn_step_triton  # noqa: E402

# a fp32 state keeps fp32 accuracy end to end (no tf32/bf16 rounding of the state products)
TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 2e-2}
STATE_TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 1e-2}  # a bf16 state is rounded once on the way out
SPARE_SLOTS = 2


def one_kernel(**launch):
    """Launch options of the one-kernel step (`state_pass_rows` 0: the defaults take two launches up to 8 nodes)."""
    return dict(launch, state_pass_rows=0)


# the one kernel: the tensor-core layout, the one-row-per-thread layouts, 2xTF32 and 3xBF16 (where q/k are bf16),
# two value heads per program (where HV = 2H), the operands split in the accumulator layout (tf32 / tf32x3, 2xTF32,
# 3xBF16), the products one iteration late (2xTF32, 3xBF16 with two heads), the state chunks through TMA (2xTF32;
# lagged with two heads and two chunks ahead), the epilogue in the accumulator's layout (2xTF32; two heads); options
# left out come from `launch_defaults` (states with up to 8 nodes: that epilogue; 16-bit states: the bf16 pass), so
# the last entry pins the earlier epilogue and the tf32 pass there; that epilogue's solve by tensor-core products
# (trees; one head and two)
SOLVE_BY_DOTS = [one_kernel(block_k=16, state_dot=True, late_node_terms=True, split_state_tf32=True,
                            epilogue_in_mma_layout=True, solve_by_dots=True),
                 one_kernel(block_k=16, state_dot=True, late_node_terms=False, heads_per_program=2,
                            epilogue_in_mma_layout=True, solve_by_dots=True)]
# the state pass and the row epilogue in two launches (at most 8 nodes): 2xTF32 products, 16 value rows and 16 key
# columns a chunk (two programs and two chunks where V or K is 32), a one-warp epilogue; the bf16 pieces (3xBF16 for
# fp32 states), 8 rows, two warps, a dependent launch (a plain one in the interpreter); a whole head's rows a program
# the state pass and the path epilogue (any node count): 2 nodes a program over one warp with the bf16 pieces; 8
# nodes over two warps with 2xTF32 products as a dependent launch (a plain one in the interpreter)
PATH_EPILOGUE = [dict(split_state_bf16=True, state_pass_rows=16, state_pass_block_k=32, num_warps=1,
                      path_epilogue_nodes=2),
                 dict(split_state_tf32=True, state_pass_rows=8, state_pass_block_k=16, num_warps=2,
                      path_epilogue_nodes=8, dependent_launch=True)]
TWO_PASS = [dict(split_state_tf32=True, state_pass_rows=16, state_pass_block_k=16, num_warps=1),
            dict(split_state_bf16=True, state_pass_rows=8, state_pass_block_k=32, num_warps=2, dependent_launch=True),
            dict(split_state_bf16=True, state_pass_rows=128, state_pass_block_k=128, state_pass_warps=2,
                 num_warps=4)] + PATH_EPILOGUE
VARIANTS = SOLVE_BY_DOTS + [one_kernel(block_k=16, state_dot=True, late_node_terms=True),
            one_kernel(block_k=16, state_dot=True, late_node_terms=False),
            one_kernel(block_k=4, state_dot=False, late_node_terms=False),
            one_kernel(block_k=8, state_dot=False, row_sums=True, late_node_terms=True),
            one_kernel(block_k=16, state_dot=True, late_node_terms=True, split_state_tf32=True),
            one_kernel(block_k=16, state_dot=True, late_node_terms=True, heads_per_program=2),
            one_kernel(block_k=16, state_dot=True, late_node_terms=False, heads_per_program=2, split_state_tf32=True),
            one_kernel(block_k=16, state_dot=True, late_node_terms=True, split_state_bf16=True),
            one_kernel(block_k=16, state_dot=True, late_node_terms=True, split_in_mma_layout=True),
            one_kernel(block_k=32, state_dot=True, late_node_terms=True, split_state_tf32=True,
                       split_in_mma_layout=True),
            one_kernel(block_k=16, state_dot=True, late_node_terms=True, split_state_bf16=True,
                       split_in_mma_layout=True),
            one_kernel(block_k=16, state_dot=True, late_node_terms=True, split_state_tf32=True, lagged_products=True),
            one_kernel(block_k=16, state_dot=True, late_node_terms=False, heads_per_program=2, split_state_bf16=True,
                       lagged_products=True),
            one_kernel(block_k=16, state_dot=True, late_node_terms=True, split_state_tf32=True, tma_state=True),
            one_kernel(block_k=16, state_dot=True, late_node_terms=False, heads_per_program=2, prefetch=2,
                       lagged_products=True, tma_state=True),
            one_kernel(block_k=16, state_dot=True, late_node_terms=True, split_state_tf32=True,
                       epilogue_in_mma_layout=True),
            one_kernel(block_k=16, state_dot=True, late_node_terms=False, heads_per_program=2,
                       epilogue_in_mma_layout=True),
            one_kernel(block_k=16, state_dot=True, late_node_terms=True, epilogue_in_mma_layout=False,
                       split_state_bf16=False)]
OUT_TOLERANCE_BF16 = 1e-2  # outputs stored in bf16


def within(actual, expected, tolerance):
    """relative_error <= tolerance; an empty batch (all requests without nodes) is trivially within."""
    return actual.numel() == 0 or relative_error(actual, expected) <= tolerance


def within_one_bf16_step(actual, expected):
    """Elementwise at most one bf16 spacing (8 significant bits) apart: fp32 results that differ in their last bits
    round to neighbouring bf16 values where they straddle a rounding boundary."""
    a, e = actual.double(), expected.double()
    step = torch.ldexp(torch.ones_like(e), torch.frexp(torch.maximum(a.abs(), e.abs()))[1] - 8)
    return bool(((a - e).abs() <= step).all())


def gated_inputs(batch, key_heads, ratio, key_dim, value_dim, seed, gate_scale=1.0, padding=(), dtype=torch.float32):
    """Raw post-conv inputs as vLLM holds them: mixed_qkv, a, b, A_log, dt_bias, z, norm weight; a state pool in
    fp64 and shuffled slots (-1 for the requests in `padding`)."""
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
    slots = torch.randperm(len(batch) + SPARE_SLOTS, generator=gen)[: len(batch)].to(torch.int32)
    slots[list(padding)] = -1
    pool = torch.randn(len(batch) + SPARE_SLOTS, hv, value_dim, key_dim, generator=gen, dtype=torch.float64) * 0.3
    inputs = [x.to(dtype) for x in (mixed_qkv, a, b)] + [A_log.float(), dt_bias.float(), z.to(dtype), weight.to(dtype)]
    return packed, inputs, pool, slots


def slot_factor_page(num_slots, rows_per_slot, hv, key_dim, value_dim, seed):
    """factors [S, T, F] as a strided view into a larger page (row and slot strides past F), filled with random
    sentinels so untouched rows can be told apart."""
    width = slot_factor_width(hv, key_dim, value_dim)
    page = torch.randn(num_slots, rows_per_slot + 1, width + 3, generator=torch.Generator().manual_seed(seed))
    return page.to(DEVICE)[:, :rows_per_slot, :width]


def on_device(x):
    return None if x is None else x.to(DEVICE)


def run_step(packed, inputs, state, slots, key_heads, factors, chain=False, pending=None, pending_ancestors=None,
             **kw):
    dev = [x.to(DEVICE) for x in inputs]
    return gdn_step_triton(*dev, state, slots.to(DEVICE), packed.parents.to(DEVICE), packed.cu_nodes.to(DEVICE),
                           factors=factors, pending_nodes=on_device(pending),
                           pending_ancestors=on_device(pending_ancestors),
                           num_key_heads=key_heads, max_nodes=max(1, packed.max_nodes), max_depth=packed.max_depth,
                           chain=chain, **kw)


def reference_of(packed, inputs, h0, slots, batch, key_heads, b):
    r = rows(packed, b)
    return reference_gated_tree(*(x[r] for x in inputs[:3]), *inputs[3:5], inputs[5][r], inputs[6],
                                h0[int(slots[b])], batch[b], key_heads)


def written_rows(packed, slots, num_slots, rows_per_slot):
    """[S, T] bool: the factor rows a step writes (live requests' nodes)."""
    mask = torch.zeros(num_slots, rows_per_slot, dtype=torch.bool)
    for b in range(len(slots)):
        if slots[b] >= 0:
            mask[int(slots[b]), : int(packed.cu_nodes[b + 1] - packed.cu_nodes[b])] = True
    return mask


def check_step(packed, inputs, h0, slots, batch, key_heads, out, factors, before, tolerance, out_tolerance=None):
    """Outputs and written factor rows vs the fp64 reference from h0; every other row, and padding requests'
    outputs (NaN before), untouched."""
    hv, value_dim, key_dim = h0.shape[1:]
    k_raw, k_scale, u, g = (x.cpu() for x in split_slot_factors(factors, hv, key_dim, value_dim))
    ratio = hv // key_heads
    for b, parents in enumerate(batch):
        r = rows(packed, b)
        slot, n = int(slots[b]), len(parents)
        if slot < 0:
            assert bool(out[r].isnan().all())
            continue
        if n == 0:
            continue
        expected = reference_of(packed, inputs, h0, slots, batch, key_heads, b)
        assert within(out[r].cpu(), expected.out, out_tolerance or tolerance)
        assert within(u[slot, :n], expected.recurrence.u, tolerance)
        assert within(g[slot, :n], expected.g, 1e-5)
        keys = inputs[0][r, key_heads * key_dim: 2 * key_heads * key_dim].unflatten(1, (key_heads, key_dim)).float()
        assert torch.equal(k_raw[slot, :n], keys.repeat_interleave(ratio, 1))
        assert relative_error(k_scale[slot, :n], keys.double().pow(2).sum(-1).add(1e-6).rsqrt()
                              .repeat_interleave(ratio, 1)) <= 1e-6
    kept = ~written_rows(packed, slots, factors.shape[0], factors.shape[1])
    assert torch.equal(factors.cpu()[kept], before.cpu()[kept])


# head counts, head dims, state dtype, gate magnitude, seed and launch layout that both step tests draw
STEP_SHAPES = dict(
    key_heads=st.integers(1, 2),
    ratio=st.sampled_from([1, 2]),
    dims=st.sampled_from([(16, 16), (32, 16), (16, 32)]),
    state_dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    gate_scale=st.sampled_from([0.1, 1.0, 3.0]),
    seed=st.integers(0, 2**16),
    variant=st.sampled_from(VARIANTS),
)


@settings(max_examples=8, deadline=None)
@given(
    batch=st.lists(trees(max_nodes=12, max_depth=5), min_size=1, max_size=3),
    **STEP_SHAPES,
)
def test_gated_step_matches_reference_and_twin(batch, key_heads, ratio, dims, state_dtype, gate_scale, seed, variant):
    """A tree step without a pending commit: outputs and factor rows vs fp64 and the twin; the state only read."""
    check_tree_step(batch, key_heads, ratio, dims, state_dtype, gate_scale, seed, variant)


@settings(max_examples=6, deadline=None)
@given(
    batch=st.lists(trees(max_nodes=24, max_depth=6), min_size=1, max_size=3),
    **dict(STEP_SHAPES, variant=st.sampled_from(PATH_EPILOGUE)),
)
def test_path_epilogue_past_eight_nodes(batch, key_heads, ratio, dims, state_dtype, gate_scale, seed, variant):
    """`test_gated_step_matches_reference_and_twin` for trees of up to 24 nodes through the state pass and the path
    epilogue (the row epilogue stops at 8)."""
    check_tree_step(batch, key_heads, ratio, dims, state_dtype, gate_scale, seed, variant)


def check_tree_step(batch, key_heads, ratio, dims, state_dtype, gate_scale, seed, variant):
    assume(ratio % variant.get("heads_per_program", 1) == 0)
    key_dim, value_dim = dims
    packed, inputs, pool, slots = gated_inputs(batch, key_heads, ratio, key_dim, value_dim, seed, gate_scale)
    state = pool.to(state_dtype).to(DEVICE)
    before = state.clone()
    factors = slot_factor_page(state.shape[0], packed.max_nodes, key_heads * ratio, key_dim, value_dim, seed)
    factors_before = factors.clone()
    out = run_step(packed, inputs, state, slots, key_heads, factors, **variant)
    assert torch.equal(state, before)  # verify never writes the state
    tolerance = TOLERANCE[state_dtype]
    check_step(packed, inputs, state.cpu(), slots, batch, key_heads, out, factors, factors_before, tolerance)
    twin_factors = factors_before.cpu()
    twin_out = gdn_step_packed(*inputs, state.cpu(), slots, packed.parents, packed.cu_nodes, num_key_heads=key_heads,
                               factors=twin_factors)
    assert within(out.cpu(), twin_out, tolerance)
    assert within(factors.cpu(), twin_factors.double(), tolerance)


@st.composite
def two_step_batches(draw):
    """(first drafts, their static tree or None for chains, second trees, accepted node of each first draft or -1,
    padding requests): the first step is chains of any lengths or one tree shape for every request; zero-node
    requests in either step, padding requests anywhere."""
    size = draw(st.integers(1, 4))
    first_tree = draw(st.one_of(st.none(), trees(max_nodes=8, max_depth=4)))
    drafts = chains(max_nodes=6) if first_tree is None else st.just(first_tree)
    first = draw(st.lists(st.one_of(st.just(()), drafts), min_size=size, max_size=size))
    second = draw(st.lists(st.one_of(st.just(()), trees(max_nodes=8, max_depth=4)), min_size=size, max_size=size))
    accepted = [draw(st.integers(-1, len(c) - 1)) for c in first]
    padding = draw(st.lists(st.integers(0, size - 1), max_size=size - 1, unique=True))
    return first, first_tree, second, accepted, padding


@settings(max_examples=8, deadline=None)
@given(
    steps=two_step_batches(),
    **STEP_SHAPES,
    input_dtype=st.sampled_from([torch.float32, torch.bfloat16]),
)
def test_two_steps_with_pending_commit(steps, key_heads, ratio, dims, state_dtype, gate_scale, seed, variant,
                                       input_dtype):
    """Step 1 (chains, or one tree shape) writes its factor rows; step 2 commits step 1's accepted node (along its
    path: `pending_ancestors` for the tree) inside its verify. Holds:
    (1) fused == commit alone then step; (2) kernel == twin == fp64 (the committed state is the reference's state
    after the accepted node); (3) rows, slots and padding requests outside the batch untouched; (4) step 2's
    outputs and factors match the fp64 recurrence continued from that state."""
    check_two_steps(steps, key_heads, ratio, dims, state_dtype, gate_scale, seed, variant, input_dtype)


@settings(max_examples=6, deadline=None)
@given(
    steps=two_step_batches(),
    **dict(STEP_SHAPES, variant=st.sampled_from(SOLVE_BY_DOTS)),
    input_dtype=st.sampled_from([torch.float32, torch.bfloat16]),
)
def test_two_steps_solved_by_dots(steps, key_heads, ratio, dims, state_dtype, gate_scale, seed, variant,
                                  input_dtype):
    """`test_two_steps_with_pending_commit` with the solve by tensor-core products every time (the general test draws
    it among all variants)."""
    check_two_steps(steps, key_heads, ratio, dims, state_dtype, gate_scale, seed, variant, input_dtype)


def check_two_steps(steps, key_heads, ratio, dims, state_dtype, gate_scale, seed, variant, input_dtype):
    assume(ratio % variant.get("heads_per_program", 1) == 0)
    first, first_tree, second, accepted, padding = steps
    if first_tree is None:
        pending_ancestors = None
    else:
        pending_ancestors = ancestor_table_torch(torch.tensor(first_tree, dtype=torch.int32),
                                                 torch.tensor([0, len(first_tree)]), DraftTree(first_tree).max_depth)
    key_dim, value_dim = dims
    hv = key_heads * ratio
    packed1, inputs1, pool, slots = gated_inputs(first, key_heads, ratio, key_dim, value_dim, seed, gate_scale,
                                                 padding, input_dtype)
    packed2, inputs2, _, _ = gated_inputs(second, key_heads, ratio, key_dim, value_dim, seed + 1, gate_scale,
                                          dtype=input_dtype)
    rows_per_slot = max(1, packed1.max_nodes, packed2.max_nodes, len(first_tree or ()))
    state = pool.to(state_dtype).to(DEVICE)
    h0 = state.cpu().clone()
    factors = slot_factor_page(state.shape[0], rows_per_slot, hv, key_dim, value_dim, seed)
    twin_factors = factors.cpu().clone()
    run_step(packed1, inputs1, state, slots, key_heads, factors, chain=first_tree is None, **variant)
    gdn_step_packed(*inputs1, h0.clone(), slots, packed1.parents, packed1.cu_nodes, num_key_heads=key_heads,
                    factors=twin_factors)
    tolerance, state_tolerance = TOLERANCE[state_dtype], STATE_TOLERANCE[state_dtype]
    out_tolerance = max(tolerance, OUT_TOLERANCE_BF16) if input_dtype == torch.bfloat16 else tolerance
    assert within(factors.cpu(), twin_factors.double(), tolerance)
    pending = torch.tensor(accepted, dtype=torch.int32)

    # (1) the commit alone, then the step, on copies
    separate, separate_factors = state.clone(), factors.clone()
    gdn_commit_triton(separate, slots.to(DEVICE), separate_factors, pending.to(DEVICE), num_key_heads=key_heads,
                      pending_ancestors=on_device(pending_ancestors), block_k=variant.get("block_k"),
                      heads_per_program=variant.get("heads_per_program"),
                      state_pass_rows=variant.get("state_pass_rows"),
                      state_pass_block_k=variant.get("state_pass_block_k"))
    assert torch.equal(separate_factors, factors)  # the commit writes no factors
    committed = separate.cpu().clone()
    out_separate = torch.full((packed2.num_nodes, hv, value_dim), float("nan"), device=DEVICE)
    run_step(packed2, inputs2, separate, slots, key_heads, separate_factors, out=out_separate, **variant)
    between = factors.clone()
    out = torch.full_like(out_separate, float("nan"))
    run_step(packed2, inputs2, state, slots, key_heads, factors, pending=pending, pending_ancestors=pending_ancestors,
             out=out, **variant)
    assert torch.equal(state, separate)
    assert torch.equal(factors, separate_factors)
    if not variant.get("row_sums"):  # same summation order in both calls
        assert torch.equal(out.nan_to_num(0.0), out_separate.nan_to_num(0.0))
    else:
        assert within(out.nan_to_num(0.0).cpu(), out_separate.nan_to_num(0.0).cpu().double(), 1e-5)

    # (2) the committed state vs the fp64 state after the accepted node, and vs the twin
    for b in range(len(first)):
        slot = int(slots[b])
        if slot < 0:
            continue
        if accepted[b] < 0:
            assert torch.equal(committed[slot], h0[slot])
            continue
        reference = reference_of(packed1, inputs1, h0, slots, first, key_heads, b)
        assert within(committed[slot], reference.recurrence.state[accepted[b]], state_tolerance)
    twin_state = h0.clone()
    twin_committed_factors = twin_factors.clone()
    gdn_commit_packed(twin_state, slots, twin_committed_factors, pending, pending_ancestors)
    assert torch.equal(twin_committed_factors, twin_factors)
    assert within(committed, twin_state.double(), state_tolerance)
    twin_out = gdn_step_packed(*inputs2, h0.clone(), slots, packed2.parents, packed2.cu_nodes,
                               num_key_heads=key_heads, factors=twin_factors, pending_nodes=pending,
                               pending_ancestors=pending_ancestors)
    live = torch.repeat_interleave(slots >= 0, packed2.cu_nodes.diff().long())
    assert within(out.cpu()[live], twin_out[live].double(), out_tolerance)

    # (3) untouched: slots outside the batch, and padding requests' state; (4) step 2 vs fp64 from `committed`
    for slot in set(range(state.shape[0])) - {int(s) for s in slots if s >= 0}:
        assert torch.equal(state[slot].cpu(), h0[slot])
    check_step(packed2, inputs2, committed, slots, second, key_heads, out, factors, between, tolerance, out_tolerance)


@settings(max_examples=4, deadline=None)
@given(batch=st.lists(chains(max_nodes=8), min_size=1, max_size=3), seed=st.integers(0, 2**16),
       activation=st.sampled_from(["silu", "sigmoid"]))
def test_chain_flag_and_activation(batch, seed, activation):
    packed, inputs, pool, slots = gated_inputs(batch, 1, 2, 16, 16, seed)
    state = pool.float().to(DEVICE)
    factors = slot_factor_page(state.shape[0], packed.max_nodes, 2, 16, 16, seed)
    by_chain = run_step(packed, inputs, state, slots, 1, factors, chain=True, activation=activation, block_k=16)
    by_walk = run_step(packed, inputs, state, slots, 1, factors.clone(), chain=False, activation=activation,
                       block_k=16)
    assert within(by_chain.cpu(), by_walk.cpu().double(), 1e-6)
    twin = gdn_step_packed(*inputs, state.cpu(), slots, packed.parents, packed.cu_nodes, num_key_heads=1,
                           factors=factors.cpu().clone(), activation=activation)
    assert within(by_chain.cpu(), twin.double(), 2e-5)


def test_state_products_mode():
    """A split of the state only where q/k are exact in tf32 and the state is not (the bf16 pieces: bf16 q/k); one
    pass where both are exact."""
    from vllm_treewy.kernels.triton.gated import _state_products_mode as mode

    assert mode(torch.float32, torch.bfloat16, True, False) == "2xtf32"
    assert mode(torch.float32, torch.float16, True, False) == "2xtf32"
    assert mode(torch.float32, torch.bfloat16, False, False) == "tf32x3"
    assert mode(torch.float32, torch.float32, True, True) == "tf32x3"  # fp32 q/k: not exact in tf32, stays tf32x3
    assert mode(torch.bfloat16, torch.float32, True, False) == "tf32x3"
    assert mode(torch.bfloat16, torch.bfloat16, True, False) == "tf32"
    assert mode(torch.bfloat16, torch.bfloat16, True, True) == "bf16"  # a bf16 state's one bf16 piece
    assert mode(torch.float16, torch.bfloat16, False, True) == "tf32"  # an fp16 state is not exact in bf16
    assert mode(torch.float32, torch.bfloat16, True, True) == "3xbf16"  # asked for: wins over the default's split
    assert mode(torch.float32, torch.float16, False, True) == "tf32x3"  # fp16 q/k are not exact in bf16


@settings(max_examples=4, deadline=None)
@given(batch=st.lists(st.one_of(chains(max_nodes=6), trees(max_nodes=8, max_depth=4)), min_size=1, max_size=3),
       seed=st.integers(0, 2**16), gate_scale=st.sampled_from([0.1, 1.0, 3.0]))
@pytest.mark.parametrize("split", ["split_state_tf32", "split_state_bf16"])
@pytest.mark.parametrize("operands", [{}, dict(split_in_mma_layout=True), dict(lagged_products=True),
                                      dict(epilogue_in_mma_layout=True)])
def test_split_state(split, operands, batch, seed, gate_scale):
    """2xTF32 or 3xBF16 (fp32 state, raw bf16 q/k), the pieces split in the load's layout, in the accumulator layout
    (tf32 pieces there with reordered columns) or one iteration ahead of their products: outputs and u vs the fp64
    reference at the fp32 tolerance, and u within 2e-7 of the one-pass fp32 products (the interpreter runs every dot
    in fp32), the bounds of `_state_products` (2^-22, 2^-27 per product) with room for the fp32 sums: both measure
    3-7e-8 here, a split into two bf16 pieces (2^-18) 3-8e-7."""
    packed, inputs, pool, slots = gated_inputs(batch, 2, 2, 32, 32, seed, gate_scale, dtype=torch.bfloat16)
    state = pool.float().to(DEVICE)
    h0 = state.cpu().clone()
    factors = slot_factor_page(state.shape[0], max(1, packed.max_nodes), 4, 32, 32, seed)
    before = factors.clone()
    launch = one_kernel(block_k=16, state_dot=True, late_node_terms=True)
    out = run_step(packed, inputs, state, slots, 2, factors, **{split: True}, **operands, **launch)
    check_step(packed, inputs, h0, slots, batch, 2, out, factors, before, TOLERANCE[torch.float32],
               OUT_TOLERANCE_BF16)
    exact_factors = before.clone()
    run_step(packed, inputs, state, slots, 2, exact_factors, split_state_tf32=False, split_state_bf16=False, **launch)
    u = split_slot_factors(factors.cpu(), 4, 32, 32)[2]
    u_exact = split_slot_factors(exact_factors.cpu(), 4, 32, 32)[2]
    assert within(u, u_exact.double(), 2e-7)


@settings(max_examples=4, deadline=None)
@given(batch=st.lists(st.one_of(chains(max_nodes=6), trees(max_nodes=8, max_depth=4)), min_size=1, max_size=3),
       seed=st.integers(0, 2**16), gate_scale=st.sampled_from([0.1, 1.0, 3.0]))
@example(batch=[(-1, 0, 1)], seed=0, gate_scale=3.0)  # an output a bf16 step from the tf32 pass's (a random draw)
@pytest.mark.parametrize("operands", [{}, dict(split_in_mma_layout=True), dict(lagged_products=True),
                                      dict(epilogue_in_mma_layout=True)])
def test_bf16_state_one_bf16_pass(operands, batch, seed, gate_scale):
    """A bf16 state with bf16 q/k and `split_state_bf16`: one bf16 pass, exact products as the one tf32 pass (the
    interpreter runs both dots in fp32) summed in another order: factor rows within 1e-6 of the tf32 pass's (measured
    2e-8), the bf16 outputs within one bf16 step of them (one of 384 a step apart at seed 0, gate scale 3, chain of
    three), and both vs the fp64 reference."""
    packed, inputs, pool, slots = gated_inputs(batch, 2, 2, 32, 32, seed, gate_scale, dtype=torch.bfloat16)
    state = pool.to(torch.bfloat16).to(DEVICE)
    factors = slot_factor_page(state.shape[0], max(1, packed.max_nodes), 4, 32, 32, seed)
    before = factors.clone()
    launch = one_kernel(block_k=16, state_dot=True, late_node_terms=True)
    out = run_step(packed, inputs, state, slots, 2, factors, split_state_bf16=True, **operands, **launch)
    check_step(packed, inputs, state.cpu(), slots, batch, 2, out, factors, before, TOLERANCE[torch.bfloat16],
               OUT_TOLERANCE_BF16)
    tf32_factors = before.clone()
    # the tf32 pass asked for (3-4 nodes default to the bf16 pass, `launch_defaults`), in the same epilogue: another
    # one rounds the bf16 outputs elsewhere
    epilogue = operands.get("epilogue_in_mma_layout", False)
    tf32_out = run_step(packed, inputs, state, slots, 2, tf32_factors, split_state_bf16=False,
                        epilogue_in_mma_layout=epilogue, **launch)
    assert within_one_bf16_step(out.cpu(), tf32_out.cpu())
    assert within(factors.cpu(), tf32_factors.cpu().double(), 1e-6)


@settings(max_examples=4, deadline=None)
@given(first=st.lists(chains(max_nodes=6), min_size=1, max_size=3),
       second=st.lists(st.one_of(chains(max_nodes=6), trees(max_nodes=8, max_depth=4)), min_size=3, max_size=3),
       seed=st.integers(0, 2**16), state_dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       input_dtype=st.sampled_from([torch.float32, torch.bfloat16]), late_node_terms=st.booleans())
def test_two_heads_per_program_equal_one(first, second, seed, state_dtype, input_dtype, late_node_terms):
    """heads_per_program=2 runs each head's arithmetic as heads_per_program=1 does: a chain step, then a step of
    chains or trees that commits the first step's accepted nodes; outputs, factor rows and committed states equal
    (bit for bit in the interpreter), and the commit alone likewise."""
    second = second[: len(first)]
    packed1, inputs1, pool, slots = gated_inputs(first, 2, 2, 32, 16, seed, dtype=input_dtype)
    packed2, inputs2, _, _ = gated_inputs(second, 2, 2, 32, 16, seed + 1, dtype=input_dtype)
    rows_per_slot = max(1, packed1.max_nodes, packed2.max_nodes)
    accepted = torch.tensor([len(c) - 1 for c in first], dtype=torch.int32)
    results = []
    for heads in (1, 2):
        state = pool.to(state_dtype).to(DEVICE)
        factors = slot_factor_page(state.shape[0], rows_per_slot, 4, 32, 16, seed)
        launch = one_kernel(block_k=16, state_dot=True, late_node_terms=late_node_terms, heads_per_program=heads)
        out1 = run_step(packed1, inputs1, state, slots, 2, factors, chain=True, **launch)
        out2 = run_step(packed2, inputs2, state, slots, 2, factors, pending=accepted, **launch)
        alone = state.clone()
        gdn_commit_triton(alone, slots.to(DEVICE), factors, accepted.to(DEVICE), num_key_heads=2, block_k=16,
                          heads_per_program=heads, state_pass_rows=0)
        results.append((out1, out2, state, factors, alone))
    for one, two in zip(*results):
        assert torch.equal(one.nan_to_num(0.0), two.nan_to_num(0.0))


@settings(max_examples=2, deadline=None)
@given(first=st.lists(chains(max_nodes=6), min_size=1, max_size=3),
       second=st.lists(chains(max_nodes=4), min_size=3, max_size=3), seed=st.integers(0, 2**16), data=st.data())
@pytest.mark.parametrize("launch", [one_kernel(block_k=16, state_dot=True, late_node_terms=True, split_state_tf32=True),
                                    one_kernel(block_k=16, state_dot=True, late_node_terms=False, lagged_products=True),
                                    one_kernel(block_k=8, state_dot=False, row_sums=True, late_node_terms=True)])
def test_pending_key_rows_prefetched(launch, first, second, seed, data):
    """The pending key rows arrive `prefetch` chunks ahead of their commit, as the state chunks do (a schedule, not
    arithmetic): with K = 64 (4 or 8 chunks), prefetch 1, 2 and 3 commit bit for bit alike, alone and fused into a
    step, and the committed state is the fp64 state after the accepted node."""
    second = second[: len(first)]
    accepted = torch.tensor([data.draw(st.integers(-1, len(c) - 1)) for c in first], dtype=torch.int32)
    packed1, inputs1, pool, slots = gated_inputs(first, 1, 2, 64, 16, seed)
    packed2, inputs2, _, _ = gated_inputs(second, 1, 2, 64, 16, seed + 1)
    h0 = pool.float()
    rows_per_slot = max(packed1.max_nodes, packed2.max_nodes)
    results = []
    for prefetch in (1, 2, 3):
        state = h0.to(DEVICE).clone()
        factors = slot_factor_page(state.shape[0], rows_per_slot, 2, 64, 16, seed)
        run_step(packed1, inputs1, state, slots, 1, factors, chain=True, prefetch=prefetch, **launch)
        alone = state.clone()
        gdn_commit_triton(alone, slots.to(DEVICE), factors, accepted.to(DEVICE), num_key_heads=1,
                          block_k=launch["block_k"], prefetch=prefetch, state_pass_rows=0)
        out = run_step(packed2, inputs2, state, slots, 1, factors, pending=accepted, prefetch=prefetch, **launch)
        results.append((alone, state, out))
    for alone, state, out in results[1:]:
        assert torch.equal(alone, results[0][0]) and torch.equal(state, results[0][1])
        assert torch.equal(out.nan_to_num(0.0), results[0][2].nan_to_num(0.0))
    committed = results[0][0].cpu()
    for b in range(len(first)):
        slot = int(slots[b])
        if accepted[b] < 0:
            assert torch.equal(committed[slot], h0[slot])
        else:
            reference = reference_of(packed1, inputs1, h0, slots, first, 1, b)
            assert within(committed[slot], reference.recurrence.state[int(accepted[b])], STATE_TOLERANCE[torch.float32])


@settings(max_examples=3, deadline=None)
@given(first=st.lists(chains(max_nodes=8), min_size=1, max_size=3),
       second=st.lists(st.one_of(chains(max_nodes=8), trees(max_nodes=8, max_depth=4)), min_size=3, max_size=3),
       seed=st.integers(0, 2**16), gate_scale=st.sampled_from([0.1, 1.0, 3.0]), data=st.data())
@pytest.mark.parametrize("heads", [1, 2])
def test_epilogue_in_mma_layout(heads, first, second, seed, gate_scale, data):
    """`epilogue_in_mma_layout` (interleaved q/k columns, the solve as products with a small inverse) against the
    default epilogue: a chain step (vs fp64), then a step of chains or trees committing the first step's accepted
    nodes; factor rows and committed states within 1e-6 of the default's (different rounding: u from the inverse's
    products, not the forward substitution's), the bf16 outputs within one rounding; one and two value heads per
    program."""
    second = second[: len(first)]
    accepted = torch.tensor([data.draw(st.integers(-1, len(c) - 1)) for c in first], dtype=torch.int32)
    packed1, inputs1, pool, slots = gated_inputs(first, 2, 2, 32, 32, seed, gate_scale, dtype=torch.bfloat16)
    packed2, inputs2, _, _ = gated_inputs(second, 2, 2, 32, 32, seed + 1, gate_scale, dtype=torch.bfloat16)
    rows_per_slot = max(packed1.max_nodes, packed2.max_nodes)
    launch = one_kernel(block_k=16, state_dot=True, late_node_terms=True, split_state_tf32=True,
                        heads_per_program=heads)
    results = []
    for epilogue in (False, True):
        state = pool.float().to(DEVICE)
        factors = slot_factor_page(state.shape[0], rows_per_slot, 4, 32, 32, seed)
        before = factors.clone()
        out1 = run_step(packed1, inputs1, state, slots, 2, factors, chain=True, epilogue_in_mma_layout=epilogue,
                        **launch)
        check_step(packed1, inputs1, pool.float(), slots, first, 2, out1, factors, before, TOLERANCE[torch.float32],
                   OUT_TOLERANCE_BF16)
        out2 = run_step(packed2, inputs2, state, slots, 2, factors, pending=accepted,
                        epilogue_in_mma_layout=epilogue, **launch)
        results.append((out1, out2, state, factors))
    for default, option, tolerance in zip(*results, (OUT_TOLERANCE_BF16, OUT_TOLERANCE_BF16, 1e-6, 1e-6)):
        assert within(option.nan_to_num(0.0).cpu(), default.nan_to_num(0.0).cpu().double(), tolerance)


def test_launch_defaults_measured_choices():
    """The H200 choices of bench/results/2026-12-02d (kernels.md; earlier ones in the comments of `gated`): chains and
    trees of up to 8 nodes take two launches, the state pass and the one-warp row epilogue as its dependent, with
    16-row state-pass programs (128 key columns, 2 warps) except fp32 states with 3-4 nodes above 4 requests and with
    1-2 nodes at 5-8 requests (64 rows, 64 columns, 4 warps, 3xBF16) and 16-bit states with 3-4 nodes above 4
    requests (5-8: 64 rows, 64 columns, 4 warps; more: 128 rows, 128 columns, 8 warps; the bf16 pass); trees of more
    than 8 nodes two launches too, the state pass at 64 rows, 64 columns, 4 warps and the path epilogue, 4 nodes a
    program over 2 warps, up to 4 requests 16 rows, 128 columns, 2 warps and 8 nodes over 4 warps (2026-12-03b);
    narrow heads one value row per thread."""
    from vllm_treewy.kernels.triton.gated import (
        FP32_STATE_LAUNCH, HALF_STATE_LAUNCH, NARROW_HEAD_LAUNCH, launch_defaults)

    fp32_two = dict(FP32_STATE_LAUNCH, epilogue_in_mma_layout=True, split_state_bf16=True, num_warps=1,
                    state_pass_rows=64, state_pass_block_k=64, state_pass_warps=4, dependent_launch=True)
    half_two = dict(HALF_STATE_LAUNCH, block_k=32, split_state_bf16=True, max_registers=0, epilogue_in_mma_layout=True,
                    num_warps=1, state_pass_rows=128, state_pass_block_k=128, state_pass_warps=8,
                    dependent_launch=True)
    rows_16 = dict(state_pass_rows=16, state_pass_block_k=128, state_pass_warps=2)
    rows_64 = dict(state_pass_rows=64, state_pass_block_k=64, state_pass_warps=4)
    for batch in (1, 4, 5, 8, 9, 64, 256):
        for nodes in (1, 2, 3, 4, 5, 8):
            fp32_64 = nodes in (3, 4) and batch > 4 or nodes <= 2 and 4 < batch <= 8
            assert launch_defaults(torch.float32, batch, 128, nodes) == (
                fp32_two if fp32_64 else dict(fp32_two, **rows_16))
            half = (half_two if nodes in (3, 4) and batch > 8 else
                    dict(half_two, **rows_64) if nodes in (3, 4) and batch > 4 else dict(half_two, **rows_16))
            for dtype in (torch.bfloat16, torch.float16):
                assert launch_defaults(dtype, batch, 128, nodes) == half
        for nodes in (9, 16, 17, 32):
            for dtype in (torch.float32, torch.bfloat16, torch.float16):
                tree = (dict(fp32_two, **rows_16, num_warps=4, path_epilogue_nodes=8) if batch <= 4 else
                        dict(fp32_two, num_warps=2, path_epilogue_nodes=4))
                assert launch_defaults(dtype, batch, 128, nodes) == tree
        for dtype, nodes in ((torch.float32, 4), (torch.bfloat16, 4), (torch.float32, 2), (torch.float32, 16)):
            assert launch_defaults(dtype, batch, 8, nodes) == NARROW_HEAD_LAUNCH


def check_default_chain_steps(state_dtype, first, second, accepted, seed):
    """Two chain steps at the launch defaults (no options, as the adapter calls them; bf16 q/k/v as in vLLM, one key
    head, two value heads, K = 64, V = 32), the second committing `accepted` (a node per request, -1 for none)
    inside its verify, against the fp64 reference: outputs, factor rows, the committed state (untouched where
    nothing is accepted). Returns step 1's launches as the launcher resolves them."""
    from vllm_treewy.kernels.triton import gated as gated_module

    key_dim, value_dim, hv = 64, 32, 2
    packed1, inputs1, pool, slots = gated_inputs(first, 1, 2, key_dim, value_dim, seed, dtype=torch.bfloat16)
    packed2, inputs2, _, _ = gated_inputs(second, 1, 2, key_dim, value_dim, seed + 1, dtype=torch.bfloat16)
    state = pool.to(state_dtype).to(DEVICE)
    h0 = state.cpu().clone()
    factors = slot_factor_page(state.shape[0], max(packed1.max_nodes, packed2.max_nodes), hv, key_dim, value_dim,
                               seed)
    before = factors.clone()
    launches, _ = gated_module._launch_arguments(
        *(x.to(DEVICE) for x in inputs1), state, slots.to(DEVICE), packed1.parents.to(DEVICE),
        packed1.cu_nodes.to(DEVICE), factors, None, None, num_key_heads=1, max_nodes=packed1.max_nodes,
        max_depth=None, chain=True, scale=None, norm_eps=1e-6, activation="silu", ancestors=None, out=None,
        do_verify=True)

    tolerance, state_tolerance = TOLERANCE[state_dtype], STATE_TOLERANCE[state_dtype]
    out_tolerance = max(tolerance, OUT_TOLERANCE_BF16)
    out1 = run_step(packed1, inputs1, state, slots, 1, factors, chain=True)
    check_step(packed1, inputs1, h0, slots, first, 1, out1, factors, before, tolerance, out_tolerance)
    between = factors.clone()
    out2 = run_step(packed2, inputs2, state, slots, 1, factors, chain=True,
                    pending=torch.tensor(accepted, dtype=torch.int32))
    committed = state.cpu().clone()  # the verify only reads it
    for b, node in enumerate(accepted):
        slot = int(slots[b])
        if node < 0:
            assert torch.equal(committed[slot], h0[slot])
        else:
            reference = reference_of(packed1, inputs1, h0, slots, first, 1, b)
            assert within(committed[slot], reference.recurrence.state[node], state_tolerance)
    check_step(packed2, inputs2, committed, slots, second, 1, out2, factors, between, tolerance, out_tolerance)
    return launches


@settings(max_examples=6, deadline=None)
@given(
    steps=two_step_batches(),
    **dict(STEP_SHAPES, variant=st.sampled_from(TWO_PASS)),
    input_dtype=st.sampled_from([torch.float32, torch.bfloat16]),
)
def test_two_steps_in_two_passes(steps, key_heads, ratio, dims, state_dtype, gate_scale, seed, variant, input_dtype):
    """`test_two_steps_with_pending_commit` with the state pass and the epilogue in two launches every time (the
    commit alone: the state pass without products)."""
    check_two_steps(steps, key_heads, ratio, dims, state_dtype, gate_scale, seed, variant, input_dtype)


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("variant", TWO_PASS)
def test_two_passes_commit_as_one_kernel(state_dtype, variant):
    """From the same factor rows, the state pass commits with the one-kernel step's sums in its order: the same
    committed state bit for bit; outputs and factor rows within fp32 rounding of its (the products' sums are
    chunked differently)."""
    first = [DraftTree.from_widths([1] * n).parents for n in (4, 3, 2)]
    second = [DraftTree.from_widths(w).parents for w in ([2, 1], [1, 1, 1], [1])]
    packed1, inputs1, pool, slots = gated_inputs(first, 1, 2, 32, 32, 3, dtype=torch.bfloat16)
    packed2, inputs2, _, _ = gated_inputs(second, 1, 2, 32, 32, 4, dtype=torch.bfloat16)
    accepted = torch.tensor([3, -1, 0], dtype=torch.int32)
    single = {**{k: v for k, v in variant.items() if not k.startswith("state_pass")}, "state_pass_rows": 0}
    results = []
    for launch in (variant, single):
        state = pool.to(state_dtype).to(DEVICE)
        factors = slot_factor_page(state.shape[0], 4, 2, 32, 32, 3)
        run_step(packed1, inputs1, state, slots, 1, factors, chain=True, **single)
        out = run_step(packed2, inputs2, state, slots, 1, factors, pending=accepted, **launch)
        results.append((state.cpu(), out.cpu(), factors.cpu()))
    (state, out, factors), (state_one, out_one, factors_one) = results
    assert torch.equal(state, state_one)
    assert within(out, out_one.double(), 1e-5 if state_dtype == torch.float32 else OUT_TOLERANCE_BF16)
    assert within(factors, factors_one.double(), 1e-5)


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("requests, tokens", [(2, 4), (9, 4), (3, 8)])
def test_default_two_launches(state_dtype, requests, tokens):
    """No launch options (as the adapter calls it), bf16 q/k/v as in vLLM: at 2 and 9 requests of up to 4 nodes and 3
    of up to 8, the state pass and the one-warp row epilogue as its dependent, as `launch_defaults` gives them; two
    chain steps, the second committing the first's accepted nodes (one request's none), match the fp64 reference:
    outputs, factor rows, the committed state."""
    from vllm_treewy.kernels.triton.gated import launch_defaults

    first = [DraftTree.from_widths([1] * (tokens - b % 2)).parents for b in range(requests)]
    second = [DraftTree.from_widths([1] * (tokens - b % 3)).parents for b in range(requests)]
    accepted = [len(p) - 1 - b % 2 for b, p in enumerate(first)]
    accepted[requests // 2] = -1
    launches = check_default_chain_steps(state_dtype, first, second, accepted, seed=5)
    (state_pass, grid, _, pass_kwargs), (epilogue, epilogue_grid, _, epilogue_kwargs) = launches
    default = launch_defaults(state_dtype, requests, 64, tokens)
    rows = min(default["state_pass_rows"], 32)  # V = 32 here
    assert state_pass.fn.__name__ == "_state_pass_kernel" and epilogue.fn.__name__ == "_row_epilogue_kernel"
    assert grid == (32 // rows, 2, requests) and pass_kwargs["BV"] == rows and pass_kwargs["BK"] == 64
    assert pass_kwargs["STATE_PRODUCTS"] == ("3xbf16" if state_dtype == torch.float32 else "bf16")
    assert pass_kwargs["num_warps"] == default["state_pass_warps"] and pass_kwargs["BT"] == tokens
    assert epilogue_grid == (2, requests) and epilogue_kwargs["num_warps"] == 1
    # a dependent launch on the GPU; the interpreter launches plainly
    assert default["dependent_launch"] and not epilogue_kwargs["DEPENDENT_LAUNCH"]
    assert not pass_kwargs["LAUNCH_DEPENDENTS"]
