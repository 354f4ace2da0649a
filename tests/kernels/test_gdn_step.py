"""The GDN step after the conv (gates, q/k L2 norm, verify, gated RMSNorm, the commit of the previous step's node
from the slots' factor rows, along a chain or a static tree) against its torch twin and the fp64 per-node
reference, on random packed trees and chains, shapes, gates, head counts, padding and zero-node requests, at every
launch of the launch table and at tiles that split a head over programs and chunks (Triton interpreter on CPU)."""

import math

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from vllm_treewy.kernels.ancestor_table_torch import ancestor_table_torch
from vllm_treewy.kernels.factor_rows import slot_factor_width, split_slot_factors
from vllm_treewy.kernels.gdn_step_torch import gdn_commit_packed, gdn_step_packed
from vllm_treewy.kernels.reference import reference_gated_tree
from vllm_treewy.tree import DraftTree, pack_trees

from .tree_cases import chains, relative_error, trees
from .triton_cases import DEVICE, rows

from vllm_treewy.kernels.gdn_step_triton import StepLaunch, gdn_commit_triton, gdn_step_triton  # noqa: E402
from vllm_treewy.kernels.gdn_step_triton import step as gdn_step_module  # noqa: E402

# a fp32 state keeps fp32 accuracy end to end (the state products split to fp32 accuracy)
TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 2e-2}
STATE_TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 1e-2}  # a bf16 state is rounded once on the way out
SPARE_SLOTS = 2

TABLE_LAUNCHES = sorted({row[-1] for row in gdn_step_module.LAUNCH_TABLE}, key=str)
# tiles the test heads (K, V of 16 or 32) are split by: two value-row programs and two key chunks, one warp
SPLIT_HEAD = [StepLaunch(16, 16, 1, 1), StepLaunch(16, 16, 2, 2, path_nodes=2)]
LAUNCHES = TABLE_LAUNCHES + SPLIT_HEAD
REQUEST_LAUNCHES = [launch for launch in LAUNCHES if not launch.path_nodes]
PATH_LAUNCHES = [launch for launch in LAUNCHES if launch.path_nodes]
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


def tree_table(packed):
    """The packed batch's ancestor table, the kernel's tree signal (chains pass None)."""
    return ancestor_table_torch(packed.parents, packed.cu_nodes, packed.max_depth).to(DEVICE)


def run_step(packed, inputs, state, slots, key_heads, factors, chain=False, commit=None, commit_ancestors=None,
             **kw):
    """The Triton step on the packed batch: as chains (no ancestor table) or, by default, through its table."""
    dev = [x.to(DEVICE) for x in inputs]
    return gdn_step_triton(*dev, state, slots.to(DEVICE), packed.cu_nodes.to(DEVICE),
                           factors=factors, commit_nodes=on_device(commit),
                           commit_ancestors=on_device(commit_ancestors),
                           num_key_heads=key_heads, max_nodes=max(1, packed.max_nodes),
                           ancestors=None if chain else tree_table(packed), **kw)


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


# head counts, head dims, state dtype, gate magnitude and seed that the step tests draw
STEP_SHAPES = dict(
    key_heads=st.integers(1, 2),
    ratio=st.sampled_from([1, 2]),
    dims=st.sampled_from([(16, 16), (32, 16), (16, 32), (8, 8)]),
    state_dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    gate_scale=st.sampled_from([0.1, 1.0, 3.0]),
    seed=st.integers(0, 2**16),
)


@settings(max_examples=8, deadline=None)
@given(batch=st.lists(trees(max_nodes=8, max_depth=5), min_size=1, max_size=3), launch=st.sampled_from(LAUNCHES),
       **STEP_SHAPES)
def test_step_matches_reference_and_twin(batch, key_heads, ratio, dims, state_dtype, gate_scale, seed, launch):
    """A step of trees of up to 8 nodes without a commit, every launch: outputs and factor rows vs fp64 and the
    twin; the state only read."""
    check_tree_step(batch, key_heads, ratio, dims, state_dtype, gate_scale, seed, launch)


@settings(max_examples=6, deadline=None)
@given(batch=st.lists(trees(max_nodes=24, max_depth=6), min_size=1, max_size=3),
       launch=st.sampled_from(PATH_LAUNCHES), **STEP_SHAPES)
def test_path_epilogue_past_eight_nodes(batch, key_heads, ratio, dims, state_dtype, gate_scale, seed, launch):
    """`test_step_matches_reference_and_twin` for trees of up to 24 nodes, through the path epilogue (the request
    epilogue stops at 8)."""
    check_tree_step(batch, key_heads, ratio, dims, state_dtype, gate_scale, seed, launch)


def check_tree_step(batch, key_heads, ratio, dims, state_dtype, gate_scale, seed, launch):
    key_dim, value_dim = dims
    packed, inputs, pool, slots = gated_inputs(batch, key_heads, ratio, key_dim, value_dim, seed, gate_scale)
    state = pool.to(state_dtype).to(DEVICE)
    before = state.clone()
    factors = slot_factor_page(state.shape[0], packed.max_nodes, key_heads * ratio, key_dim, value_dim, seed)
    factors_before = factors.clone()
    out = run_step(packed, inputs, state, slots, key_heads, factors, launch=launch)
    assert torch.equal(state, before)  # verify never writes the state
    tolerance = TOLERANCE[state_dtype]
    check_step(packed, inputs, state.cpu(), slots, batch, key_heads, out, factors, factors_before, tolerance)
    twin_factors = factors_before.cpu()
    twin_out = gdn_step_packed(*inputs, state.cpu(), slots, packed.parents, packed.cu_nodes, num_key_heads=key_heads,
                               factors=twin_factors)
    assert within(out.cpu(), twin_out, tolerance)
    assert within(factors.cpu(), twin_factors.double(), tolerance)


@st.composite
def two_step_batches(draw, max_nodes=8):
    """(first drafts, their static tree or None for chains, second trees, commit node of each first draft or -1,
    padding requests): the first step is chains of any lengths or one tree shape for every request; zero-node
    requests in either step, padding requests anywhere."""
    size = draw(st.integers(1, 4))
    first_tree = draw(st.one_of(st.none(), trees(max_nodes=max_nodes, max_depth=4)))
    drafts = chains(max_nodes=6) if first_tree is None else st.just(first_tree)
    first = draw(st.lists(st.one_of(st.just(()), drafts), min_size=size, max_size=size))
    second = draw(st.lists(st.one_of(st.just(()), trees(max_nodes=max_nodes, max_depth=4)), min_size=size,
                           max_size=size))
    commit = [draw(st.integers(-1, len(c) - 1)) for c in first]
    padding = draw(st.lists(st.integers(0, size - 1), max_size=size - 1, unique=True))
    return first, first_tree, second, commit, padding


@settings(max_examples=8, deadline=None)
@given(steps=two_step_batches(), launch=st.sampled_from(REQUEST_LAUNCHES), **STEP_SHAPES,
       input_dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_two_steps_with_commit(steps, key_heads, ratio, dims, state_dtype, gate_scale, seed, launch, input_dtype):
    """Step 1 (chains, or one tree shape) writes its factor rows; step 2 commits step 1's node (along its path:
    `commit_ancestors` for the tree) inside its verify. Holds:
    (1) fused == commit alone then step, bit for bit; (2) kernel == twin == fp64 (the committed state is the
    reference's state after the commit node); (3) rows, slots and padding requests outside the batch untouched;
    (4) step 2's outputs and factors match the fp64 recurrence continued from that state."""
    check_two_steps(steps, key_heads, ratio, dims, state_dtype, gate_scale, seed, launch, input_dtype)


@settings(max_examples=4, deadline=None)
@given(steps=two_step_batches(max_nodes=16), launch=st.sampled_from(PATH_LAUNCHES), **STEP_SHAPES,
       input_dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_two_tree_steps_through_the_path_epilogue(steps, key_heads, ratio, dims, state_dtype, gate_scale, seed,
                                                   launch, input_dtype):
    """`test_two_steps_with_commit` with trees of up to 16 nodes, through the path epilogue."""
    check_two_steps(steps, key_heads, ratio, dims, state_dtype, gate_scale, seed, launch, input_dtype)


def check_two_steps(steps, key_heads, ratio, dims, state_dtype, gate_scale, seed, launch, input_dtype):
    first, first_tree, second, commit_list, padding = steps
    if first_tree is None:
        commit_ancestors = None
    else:
        commit_ancestors = ancestor_table_torch(torch.tensor(first_tree, dtype=torch.int32),
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
    run_step(packed1, inputs1, state, slots, key_heads, factors, chain=first_tree is None, launch=launch)
    gdn_step_packed(*inputs1, h0.clone(), slots, packed1.parents, packed1.cu_nodes, num_key_heads=key_heads,
                    factors=twin_factors)
    tolerance, state_tolerance = TOLERANCE[state_dtype], STATE_TOLERANCE[state_dtype]
    out_tolerance = max(tolerance, OUT_TOLERANCE_BF16) if input_dtype == torch.bfloat16 else tolerance
    assert within(factors.cpu(), twin_factors.double(), tolerance)
    commit = torch.tensor(commit_list, dtype=torch.int32)

    # (1) the commit alone, then the step, on copies
    separate, separate_factors = state.clone(), factors.clone()
    gdn_commit_triton(separate, slots.to(DEVICE), separate_factors, commit.to(DEVICE), num_key_heads=key_heads,
                      commit_ancestors=on_device(commit_ancestors), launch=launch)
    assert torch.equal(separate_factors, factors)  # the commit writes no factors
    committed = separate.cpu().clone()
    out_separate = torch.full((packed2.num_nodes, hv, value_dim), float("nan"), device=DEVICE)
    run_step(packed2, inputs2, separate, slots, key_heads, separate_factors, out=out_separate, launch=launch)
    between = factors.clone()
    out = torch.full_like(out_separate, float("nan"))
    run_step(packed2, inputs2, state, slots, key_heads, factors, commit=commit, commit_ancestors=commit_ancestors,
             out=out, launch=launch)
    assert torch.equal(state, separate)
    assert torch.equal(factors, separate_factors)
    assert torch.equal(out.nan_to_num(0.0), out_separate.nan_to_num(0.0))  # the same sums in the same order

    # (2) the committed state vs the fp64 state after the commit node, and vs the twin
    for b in range(len(first)):
        slot = int(slots[b])
        if slot < 0:
            continue
        if commit_list[b] < 0:
            assert torch.equal(committed[slot], h0[slot])
            continue
        reference = reference_of(packed1, inputs1, h0, slots, first, key_heads, b)
        assert within(committed[slot], reference.recurrence.state[commit_list[b]], state_tolerance)
    twin_state = h0.clone()
    twin_committed_factors = twin_factors.clone()
    gdn_commit_packed(twin_state, slots, twin_committed_factors, commit, commit_ancestors)
    assert torch.equal(twin_committed_factors, twin_factors)
    assert within(committed, twin_state.double(), state_tolerance)
    twin_out = gdn_step_packed(*inputs2, h0.clone(), slots, packed2.parents, packed2.cu_nodes,
                               num_key_heads=key_heads, factors=twin_factors, commit_nodes=commit,
                               commit_ancestors=commit_ancestors)
    live = torch.repeat_interleave(slots >= 0, packed2.cu_nodes.diff().long())
    assert within(out.cpu()[live], twin_out[live].double(), out_tolerance)

    # (3) untouched: slots outside the batch, and padding requests' state; (4) step 2 vs fp64 from `committed`
    for slot in set(range(state.shape[0])) - {int(s) for s in slots if s >= 0}:
        assert torch.equal(state[slot].cpu(), h0[slot])
    check_step(packed2, inputs2, committed, slots, second, key_heads, out, factors, between, tolerance, out_tolerance)


@settings(max_examples=4, deadline=None)
@given(batch=st.lists(chains(max_nodes=8), min_size=1, max_size=3), seed=st.integers(0, 2**16),
       activation=st.sampled_from(["silu", "sigmoid"]))
def test_chain_without_table_and_activation(batch, seed, activation):
    """Chains without an ancestor table (the chain signal) equal the same chains through their table; the twin's
    chains without parents (None) are its chains with them, bit for bit."""
    packed, inputs, pool, slots = gated_inputs(batch, 1, 2, 16, 16, seed)
    state = pool.float().to(DEVICE)
    factors = slot_factor_page(state.shape[0], packed.max_nodes, 2, 16, 16, seed)
    chain_factors = factors.clone()
    by_chain = run_step(packed, inputs, state, slots, 1, chain_factors, chain=True, activation=activation)
    by_walk = run_step(packed, inputs, state, slots, 1, factors.clone(), chain=False, activation=activation)
    assert within(by_chain.cpu(), by_walk.cpu().double(), 1e-6)
    twin_factors = factors.cpu().clone()
    twin = gdn_step_packed(*inputs, state.cpu(), slots, packed.parents, packed.cu_nodes, num_key_heads=1,
                           factors=twin_factors, activation=activation)
    assert within(by_chain.cpu(), twin.double(), 2e-5)
    twin_no_parents_factors = factors.cpu().clone()
    twin_no_parents = gdn_step_packed(*inputs, state.cpu(), slots, None, packed.cu_nodes, num_key_heads=1,
                                      factors=twin_no_parents_factors, activation=activation)
    assert torch.equal(twin_no_parents, twin) and torch.equal(twin_no_parents_factors, twin_factors)


def test_state_products_mode():
    """Exact one-pass products where both operands are exact (bf16 with bf16 in bf16, else tf32), an fp32 state
    split against 16-bit q/k, tf32x3 against fp32 q/k."""
    mode = gdn_step_module.state_products_mode
    assert mode(torch.bfloat16, torch.bfloat16) == "bf16"
    assert mode(torch.bfloat16, torch.float16) == "tf32"
    assert mode(torch.float16, torch.bfloat16) == "tf32"  # an fp16 state is not exact in bf16
    assert mode(torch.float32, torch.bfloat16) == "3xbf16"
    assert mode(torch.float32, torch.float16) == "2xtf32"  # fp16 q/k are not exact in bf16
    assert mode(torch.float32, torch.float32) == "tf32x3"
    assert mode(torch.bfloat16, torch.float32) == "tf32x3"


@settings(max_examples=4, deadline=None)
@given(batch=st.lists(st.one_of(chains(max_nodes=6), trees(max_nodes=8, max_depth=4)), min_size=1, max_size=3),
       seed=st.integers(0, 2**16), gate_scale=st.sampled_from([0.1, 1.0, 3.0]))
@example(batch=[(-1, 0, 1)], seed=0, gate_scale=3.0)
@pytest.mark.parametrize("state_dtype, qkv_dtype", [(torch.float32, torch.bfloat16), (torch.float32, torch.float16),
                                                    (torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16)])
def test_split_products_match_fp32_products(state_dtype, qkv_dtype, batch, seed, gate_scale):
    """3xBF16 and 2xTF32 (an fp32 state against bf16 / fp16 q/k), the one bf16 pass (a bf16 state) and the one tf32
    pass (an fp16 state): u within 2e-7 of the same step on the same values in fp32 q/k/v (tf32x3, which the
    interpreter runs as fp32 dots), the bounds of `_state_products` (2^-27, 2^-22 per product; exact) with room for
    the fp32 sums; and vs fp64."""
    packed, inputs, pool, slots = gated_inputs(batch, 2, 2, 32, 32, seed, gate_scale, dtype=qkv_dtype)
    state = pool.to(state_dtype).to(DEVICE)
    factors = slot_factor_page(state.shape[0], max(1, packed.max_nodes), 4, 32, 32, seed)
    before = factors.clone()
    out = run_step(packed, inputs, state, slots, 2, factors)
    check_step(packed, inputs, state.cpu(), slots, batch, 2, out, factors, before, TOLERANCE[state_dtype],
               OUT_TOLERANCE_BF16)
    fp32_factors = before.clone()
    run_step(packed, [x.float() for x in inputs], state, slots, 2, fp32_factors)
    u = split_slot_factors(factors.cpu(), 4, 32, 32)[2]
    u_fp32 = split_slot_factors(fp32_factors.cpu(), 4, 32, 32)[2]
    assert within(u, u_fp32.double(), 2e-7)


def test_launch_table_covers_every_step():
    """Exactly one row of the launch table holds for every state dtype, batch and node count."""
    for states in ("fp32", "16-bit"):
        for batch in range(0, 300):
            for nodes in range(0, 70):
                holding = [row for row in gdn_step_module.LAUNCH_TABLE if row[0] in ("any", states)
                           and row[1][0] <= batch <= row[1][1] and row[2][0] <= nodes <= row[2][1]]
                assert len(holding) == 1, (states, batch, nodes, holding)


def test_launch_table_measured_choices():
    """The H200's choices (bench/results/kernels/README.md, "Launch table"): 16-row state-pass programs (128 key columns, 2
    warps) except fp32 states with 3-4 nodes above 4 requests and with 1-2 nodes at 5-8 requests (64 rows, 64
    columns, 4 warps) and 16-bit states with 3-4 nodes above 4 requests (5-8: 64 / 64 / 4; more: 32 rows, 128
    columns, 1 warp, the H100's choice); one-warp request epilogues up to 8 nodes; trees of more than 8 nodes the
    path epilogue, 4 nodes a program over 2 warps after a 64 / 64 / 4 state pass, up to 4 requests 8 nodes over 4
    warps after the 16-row one. fp16 states as bf16."""
    rows_16, rows_64, rows_32 = StepLaunch(16, 128, 2, 1), StepLaunch(64, 64, 4, 1), StepLaunch(32, 128, 1, 1)
    step_launch = gdn_step_module.step_launch
    for batch in (1, 4, 5, 8, 9, 64, 256):
        for nodes in (1, 2, 3, 4, 5, 8):
            fp32_64 = nodes in (3, 4) and batch > 4 or nodes <= 2 and 4 < batch <= 8
            assert step_launch(torch.float32, batch, nodes) == (rows_64 if fp32_64 else rows_16)
            half = (rows_32 if nodes in (3, 4) and batch > 8 else
                    rows_64 if nodes in (3, 4) and batch > 4 else rows_16)
            for dtype in (torch.bfloat16, torch.float16):
                assert step_launch(dtype, batch, nodes) == half
        for nodes in (9, 16, 17, 32):
            for dtype in (torch.float32, torch.bfloat16, torch.float16):
                assert step_launch(dtype, batch, nodes) == (
                    StepLaunch(16, 128, 2, 4, path_nodes=8) if batch <= 4 else StepLaunch(64, 64, 4, 2, path_nodes=4))


def table_row_cases():
    """Per launch-table row, a (state dtype, batch, nodes) inside it: the row's smallest batch and node count
    (chains up to 8 nodes, trees of more)."""
    cases = []
    for states, (b_lo, _), (n_lo, _), launch in gdn_step_module.LAUNCH_TABLE:
        for dtype in ((torch.float32, torch.bfloat16) if states == "any" else
                      (torch.float32,) if states == "fp32" else (torch.bfloat16,)):
            cases.append(pytest.param(dtype, max(1, b_lo), max(2, n_lo), launch,
                                      id=f"{states}-{dtype}-{max(1, b_lo)}x{max(2, n_lo)}"))
    return cases


@pytest.mark.parametrize("dims", [(32, 16), (8, 8)])
@pytest.mark.parametrize("state_dtype, batch, nodes, launch", table_row_cases())
def test_default_launch_of_every_table_row(state_dtype, batch, nodes, launch, dims):
    """No launch argument (as the adapter calls it), bf16 q/k/v as in vLLM, for every row of the launch table:
    the launches are that row's (the state pass, then the request epilogue or the path epilogue), and two steps,
    the second committing the first's nodes (one request's none), match the fp64 reference: outputs, factor rows,
    the committed state. Chains up to 8 nodes, trees of more; heads of 16 and more key columns and of 8 (narrower
    than a tensor-core dot: the tiles masked to the head)."""
    key_dim, value_dim = dims
    if nodes <= 8:
        tree = DraftTree.from_widths([1] * nodes)
    else:
        tree = DraftTree.from_widths([2, 2, 1]).with_root()
    first = [tree.parents] * batch
    commit = [tree.num_nodes - 1 - b % 2 for b in range(batch)]
    commit[batch // 2] = -1
    chain = nodes <= 8
    commit_ancestors = None if chain else ancestor_table_torch(
        torch.tensor(tree.parents, dtype=torch.int32), torch.tensor([0, tree.num_nodes]), tree.max_depth)
    packed1, inputs1, pool, slots = gated_inputs(first, 1, 2, key_dim, value_dim, 5, dtype=torch.bfloat16)
    packed2, inputs2, _, _ = gated_inputs(first, 1, 2, key_dim, value_dim, 6, dtype=torch.bfloat16)
    state = pool.to(state_dtype).to(DEVICE)
    h0 = state.cpu().clone()
    factors = slot_factor_page(state.shape[0], tree.num_nodes, 2, key_dim, value_dim, 5)
    before = factors.clone()
    launches, _ = gdn_step_module.step_launches(
        *(x.to(DEVICE) for x in inputs1), state, slots.to(DEVICE), packed1.cu_nodes.to(DEVICE), factors, None, None, num_key_heads=1, max_nodes=packed1.max_nodes,
        scale=None, norm_eps=1e-6, activation="silu", ancestors=None if chain else tree_table(packed1),
        out=None, launch=None)
    assert gdn_step_module.step_launch(state_dtype, batch, tree.num_nodes) == launch
    (state_pass, grid, _, pass_kwargs), (epilogue, epilogue_grid, _, epilogue_kwargs) = launches
    rows_per_program = max(16, min(launch.state_rows, value_dim))
    assert state_pass.fn.__name__ == "_state_pass_kernel" and pass_kwargs["BV"] == rows_per_program
    assert grid == (math.ceil(value_dim / rows_per_program), 2, batch)
    assert pass_kwargs["BK"] == max(16, min(launch.state_block_k, key_dim))
    assert pass_kwargs["num_warps"] == launch.state_warps and epilogue_kwargs["num_warps"] == launch.epilogue_warps
    assert pass_kwargs["STATE_PRODUCTS"] == ("3xbf16" if state_dtype == torch.float32 else "bf16")
    if launch.path_nodes:
        assert epilogue.fn.__name__ == "_path_epilogue_kernel" and epilogue_kwargs["NB"] == launch.path_nodes
        assert epilogue_grid == (2, batch, math.ceil(tree.num_nodes / launch.path_nodes))
    else:
        assert epilogue.fn.__name__ == "_request_epilogue_kernel" and epilogue_grid == (2, batch)
    # a dependent launch on the GPU; the interpreter launches plainly
    assert not epilogue_kwargs["DEPENDENT_LAUNCH"] and not pass_kwargs["LAUNCH_DEPENDENTS"]

    tolerance, state_tolerance = TOLERANCE[state_dtype], STATE_TOLERANCE[state_dtype]
    out_tolerance = max(tolerance, OUT_TOLERANCE_BF16)
    out1 = run_step(packed1, inputs1, state, slots, 1, factors, chain=chain)
    check_step(packed1, inputs1, h0, slots, first, 1, out1, factors, before, tolerance, out_tolerance)
    between = factors.clone()
    out2 = run_step(packed2, inputs2, state, slots, 1, factors, chain=chain,
                    commit=torch.tensor(commit, dtype=torch.int32), commit_ancestors=commit_ancestors)
    committed = state.cpu().clone()  # the verify only reads it
    for b, node in enumerate(commit):
        slot = int(slots[b])
        if node < 0:
            assert torch.equal(committed[slot], h0[slot])
        else:
            reference = reference_of(packed1, inputs1, h0, slots, first, 1, b)
            assert within(committed[slot], reference.recurrence.state[node], state_tolerance)
    check_step(packed2, inputs2, committed, slots, first, 1, out2, factors, between, tolerance, out_tolerance)


def test_request_epilogue_refuses_more_than_eight_nodes():
    packed, inputs, pool, slots = gated_inputs([DraftTree.from_widths([2, 2, 1]).parents], 1, 1, 16, 16, 0)
    factors = slot_factor_page(pool.shape[0], packed.max_nodes, 1, 16, 16, 0)
    with pytest.raises(AssertionError, match="request epilogue"):
        run_step(packed, inputs, pool.float(), slots, 1, factors, launch=StepLaunch(16, 16, 1, 1))
