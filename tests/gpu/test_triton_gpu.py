"""Triton kernels on CUDA at Qwen3.5-35B-A3B sizes (H=16, HV=32, K=V=128) against the fp64 per-node reference and
the torch twin, and CUDA-graph capture and replay. Run on the H200: `pytest -m gpu tests/gpu`."""

import pytest
import torch

from vllm_treewy.kernels.closed_form import commit_packed
from vllm_treewy.kernels.conv import conv_verify_packed
from vllm_treewy.kernels.reference import reference_tree_conv, reference_tree_recurrence
from vllm_treewy.tree import DraftTree, pack_trees

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

from vllm_treewy.kernels.triton import (  # noqa: E402
    PendingCommit,
    ancestor_table,
    commit_layers_triton,
    commit_packed_triton,
    conv_step_triton,
    serial_tree_triton,
    state_pool_table,
    verify_packed_triton,
)

H, HV, K, V = 16, 32, 128, 128
TREES = [
    DraftTree.from_widths([4, 2, 2]).with_root().parents,
    DraftTree.from_widths([2, 2, 1]).with_root().parents,
    (-1, 0, 1, 1, 3, -1, 5, 4, 2),
    DraftTree.from_widths([1] * 3).with_root().parents,
]
CHAINS = [DraftTree.from_widths([1] * 3).with_root().parents] * 3 + [(-1,)]


def relative_error(actual, expected):
    expected = expected.double().cpu()
    return float((actual.double().cpu() - expected).abs().max() / expected.abs().max())


def gdn_batch(trees, dtype, state_dtype, seed):
    """Packed inputs on the GPU (q, k normalised, q scaled; realistic gates) and a pool with shuffled slots."""
    gen = torch.Generator().manual_seed(seed)
    packed = pack_trees(trees, device="cuda")
    n = packed.num_nodes
    q = torch.nn.functional.normalize(torch.randn(n, H, K, generator=gen, dtype=torch.float64), dim=-1) * K**-0.5
    k = torch.nn.functional.normalize(torch.randn(n, H, K, generator=gen, dtype=torch.float64), dim=-1)
    v = torch.randn(n, HV, V, generator=gen, dtype=torch.float64)
    g = -torch.rand(n, HV, generator=gen, dtype=torch.float64) * 2
    beta = torch.rand(n, HV, generator=gen, dtype=torch.float64)
    slots = (torch.randperm(len(trees) + 3, generator=gen)[: len(trees)]).to(torch.int32)
    pool = torch.randn(len(trees) + 3, HV, V, K, generator=gen, dtype=torch.float64) * 0.1
    inputs = [x.to(dtype).cuda() for x in (q, k, v)] + [x.float().cuda() for x in (g, beta)]
    return packed, inputs, pool.to(state_dtype).cuda(), slots.cuda()


def reference(packed, inputs, pool, slots, trees, b):
    rows = slice(int(packed.cu_nodes[b]), int(packed.cu_nodes[b + 1]))
    return reference_tree_recurrence(*(x[rows].cpu() for x in inputs), pool[int(slots[b])].cpu(), trees[b]), rows


def bounds(packed, chain=False):
    return dict(max_nodes=packed.max_nodes, max_depth=packed.max_depth, chain=chain)


@pytest.mark.parametrize(
    "trees, chain, dtype, state_dtype, precision, tolerance",
    [
        (TREES, False, torch.bfloat16, torch.bfloat16, None, 1e-2),
        (TREES, False, torch.float32, torch.float32, "ieee", 2e-5),
        (TREES, False, torch.float32, torch.float32, "tf32x3", 1e-4),
        (TREES, False, torch.bfloat16, torch.float32, None, 2e-5),
        (CHAINS, True, torch.bfloat16, torch.bfloat16, None, 1e-2),
        (CHAINS, True, torch.float32, torch.float32, None, 2e-5),
    ],
)
@pytest.mark.parametrize("solve", ["neumann", "substitution"])
def test_verify_and_commit_vs_reference(trees, chain, dtype, state_dtype, precision, tolerance, solve):
    packed, inputs, pool, slots = gdn_batch(trees, dtype, state_dtype, seed=1)
    o, u = verify_packed_triton(*inputs, pool, slots, packed.parents, packed.cu_nodes, solve=solve,
                                precision=precision, **bounds(packed, chain))
    accepted = torch.tensor([len(t) - 1 for t in trees], dtype=torch.int32, device="cuda")
    committed = pool.clone()
    commit_packed_triton(committed, slots, inputs[1], u, inputs[3], packed.parents, packed.cu_nodes, accepted,
                         precision=precision, **bounds(packed, chain))
    twin = pool.clone()
    commit_packed(twin, slots, inputs[1], u, inputs[3], packed.parents, packed.cu_nodes, accepted)
    # a bf16 state is rounded once on the way out; anything beyond that is the kernel's error
    state_tolerance = max(tolerance, 1e-2 if state_dtype == torch.bfloat16 else 0)
    assert relative_error(committed, twin) <= state_tolerance
    o_tolerance = max(tolerance, 1e-2 if dtype == torch.bfloat16 else 0)  # o is stored in v's dtype
    for b in range(len(trees)):
        expected, rows = reference(packed, inputs, pool, slots, trees, b)
        assert relative_error(o[rows], expected.o) <= o_tolerance
        assert relative_error(u[rows], expected.u) <= tolerance
        assert relative_error(committed[int(slots[b])], expected.state[-1]) <= state_tolerance


def test_commit_layers_and_pending_commit():
    packed, inputs, pool, slots = gdn_batch(TREES, torch.bfloat16, torch.bfloat16, seed=2)
    layers = 3
    pools = [pool.clone() for _ in range(layers)]
    k = torch.stack([inputs[1]] * layers)
    g = torch.stack([inputs[3]] * layers)
    u = torch.stack([verify_packed_triton(*inputs, pool, slots, packed.parents, packed.cu_nodes,
                                          **bounds(packed))[1]] * layers)
    accepted = torch.tensor([20, 9, -1, 3], dtype=torch.int32, device="cuda")
    commit_layers_triton(state_pool_table(pools), slots, k, u, g, packed.parents, packed.cu_nodes, accepted,
                         pool_like=pools[0], **bounds(packed))
    single = pool.clone()
    commit_packed_triton(single, slots, k[0], u[0], g[0], packed.parents, packed.cu_nodes, accepted,
                         **bounds(packed))
    assert all(torch.equal(p, single) for p in pools)
    # the same commit fused into the next step's verify
    nxt, next_inputs, _, _ = gdn_batch(CHAINS, torch.bfloat16, torch.bfloat16, seed=3)
    separate = verify_packed_triton(*next_inputs, single, slots, nxt.parents, nxt.cu_nodes, **bounds(nxt, True))
    fused_pool = pool.clone()
    pending = PendingCommit(k[0], u[0], g[0], packed.parents, packed.cu_nodes, accepted, **bounds(packed))
    fused = verify_packed_triton(*next_inputs, fused_pool, slots, nxt.parents, nxt.cu_nodes, pending=pending,
                                 **bounds(nxt, True))
    # the fused and the separate commit run different tile shapes (VERIFY_CONFIGS["fused"] vs COMMIT_CONFIGS), whose
    # tensor-core rebuilds need not round alike: one bf16 rounding apart at most (bit-exact under equal tiles: the
    # interpreter test test_pending_commit_fused_into_next_verify)
    assert relative_error(fused_pool, single) <= 1e-2
    assert all(relative_error(a, b) <= 2e-2 for a, b in zip(fused, separate))


def test_serial_baseline_vs_reference():
    packed, inputs, pool, slots = gdn_batch(TREES, torch.float32, torch.float32, seed=4)
    o, states = serial_tree_triton(*inputs, pool, slots, packed.parents, packed.cu_nodes)
    for b in range(len(TREES)):
        expected, rows = reference(packed, inputs, pool, slots, TREES, b)
        assert relative_error(o[rows], expected.o) <= 2e-5
        assert relative_error(states[rows], expected.state) <= 2e-5


@pytest.mark.parametrize("history_len, dtype", [(3, torch.bfloat16), (6, torch.float32)])
def test_conv_step_vs_reference(history_len, dtype):
    """Two conv steps of one static tree shape: the first convolves from the history, the second commits the first's
    accepted nodes (any node of the tree) and convolves again."""
    shape = DraftTree.from_widths([4, 2, 2]).with_root().parents
    batch = [shape] * 4
    channels, width, rows_per_slot = 2 * H * K + HV * V, 4, len(shape)
    packed = pack_trees(batch, device="cuda")
    gen = torch.Generator().manual_seed(5)
    x, x_next = (torch.randn(packed.num_nodes, channels, generator=gen).to(dtype).cuda() for _ in range(2))
    weight = torch.randn(channels, width, generator=gen).to(dtype).cuda()
    bias = torch.randn(channels, generator=gen).to(dtype).cuda()
    # vLLM's layout: [S, L, D] storage viewed as [S, D, L]
    conv_state = torch.randn(len(batch) + 2, history_len, channels, generator=gen).to(dtype).cuda().transpose(1, 2)
    before = conv_state.clone()
    inputs = torch.zeros(len(batch) + 2, rows_per_slot, channels, dtype=dtype, device="cuda")
    slots = torch.tensor([4, 0, 2, 5], dtype=torch.int32, device="cuda")
    ancestors = ancestor_table(packed.parents[:rows_per_slot], packed.cu_nodes[:2], len(shape)).contiguous()
    out = conv_step_triton(x, conv_state, slots, weight, bias, packed.parents, packed.cu_nodes, inputs, None,
                           activation="silu")
    twin = conv_verify_packed(x, before, slots, weight, bias, packed.parents, packed.cu_nodes, activation="silu")
    tolerance = 1e-2 if dtype == torch.bfloat16 else 1e-5
    assert relative_error(out, twin.float()) <= tolerance
    accepted = torch.tensor([28, 9, 0, -1], dtype=torch.int32, device="cuda")
    conv_step_triton(x_next, conv_state, slots, weight, bias, packed.parents, packed.cu_nodes, inputs, accepted,
                     pending_ancestors=ancestors, activation="silu")
    for b in range(len(batch)):
        rows = slice(int(packed.cu_nodes[b]), int(packed.cu_nodes[b + 1]))
        expected = reference_tree_conv(x[rows].cpu(), before[int(slots[b])].cpu(), weight.cpu(), bias.cpu(),
                                       shape, "silu")
        assert relative_error(out[rows], expected.out) <= tolerance
        after = conv_state[int(slots[b])].cpu()
        assert torch.equal(after, before[int(slots[b])].cpu() if accepted[b] < 0
                           else expected.history[int(accepted[b])].to(dtype))


@pytest.mark.parametrize("trees, chain", [(CHAINS, True), (TREES, False)])
def test_cuda_graph_capture_and_replay(trees, chain):
    packed, inputs, pool, slots = gdn_batch(trees, torch.bfloat16, torch.bfloat16, seed=6)
    o = torch.empty_like(inputs[2])
    u = torch.empty(inputs[2].shape, dtype=torch.float32, device="cuda")

    def step():
        verify_packed_triton(*inputs, pool, slots, packed.parents, packed.cu_nodes, o=o, u=u, **bounds(packed, chain))

    step()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for seed, order in ((7, trees), (8, trees[::-1])):
        # new data in the same buffers; the second replay also reorders the requests (other lengths per slot)
        repacked, fresh, fresh_pool, _ = gdn_batch(order, torch.bfloat16, torch.bfloat16, seed=seed)
        for static, new in zip([*inputs, pool, packed.parents, packed.cu_nodes],
                               [*fresh, fresh_pool, repacked.parents, repacked.cu_nodes]):
            static.copy_(new)
        o.fill_(float("nan"))
        graph.replay()
        replayed = (o.clone(), u.clone())
        step()
        assert torch.equal(replayed[0], o) and torch.equal(replayed[1], u)
        assert bool(o.isfinite().all())


def gated_batch(tokens, batch, state_dtype, seed):
    """Raw post-conv inputs at real sizes (what vLLM's fused MTP kernel takes) and a pool with shuffled slots."""
    gen = torch.Generator().manual_seed(seed)
    n = tokens * batch
    mixed_qkv = torch.randn(n, 2 * H * K + HV * V, generator=gen).bfloat16()
    a, b = (torch.randn(n, HV, generator=gen) * 2).bfloat16(), torch.randn(n, HV, generator=gen).bfloat16()
    A_log, dt_bias = torch.randn(HV, generator=gen) * 0.5, torch.randn(HV, generator=gen)
    z = torch.randn(n, HV, V, generator=gen).bfloat16()
    weight = (1 + 0.1 * torch.randn(V, generator=gen)).bfloat16()
    slots = torch.randperm(batch + 3, generator=gen)[:batch].to(torch.int32)
    pool = (torch.randn(batch + 3, HV, V, K, generator=gen, dtype=torch.float64) * 0.3).to(state_dtype)
    inputs = [x.cuda() for x in (mixed_qkv, a, b, A_log, dt_bias, z, weight)]
    return inputs, pool.cuda(), slots.cuda()


def slot_factors(num_slots, tokens):
    """[S, T, F] as a strided view into larger pages, as the adapter keeps them in the KV cache."""
    from vllm_treewy.kernels.triton import slot_factor_width

    width = slot_factor_width(HV, K, V)
    return torch.full((num_slots, tokens + 1, width + 32), float("nan"), device="cuda")[:, :tokens, :width]


# launch variants: the defaults, and each layout explicitly (the bf16 x bf16 tensor-core dot runs only on a GPU);
# tf32x3, 2xTF32 and 3xBF16 (fp32 states; a bf16 state runs its one exact pass) and two value heads per program.
# The explicit one-kernel ones pin the epilogue, the state products and the one kernel (`PINNED`): left out, they would
# come from `launch_defaults` (up to 8 nodes: two launches, epilogue_in_mma_layout; 16-bit states: split_state_bf16)
PINNED = dict(epilogue_in_mma_layout=False, split_state_bf16=False, state_pass_rows=0)
GATED_VARIANTS = {
    "default": {},
    "tma_state": dict(block_k=32, num_warps=8, prefetch=1, state_dot=True, late_node_terms=True,
                      split_state_tf32=True, tma_state=True, **PINNED),
    "split_in_mma_layout": dict(block_k=32, num_warps=8, prefetch=1, state_dot=True, late_node_terms=True,
                                split_state_tf32=True, split_in_mma_layout=True, **PINNED),
    "lagged_products": dict(block_k=32, num_warps=8, prefetch=1, state_dot=True, late_node_terms=True,
                            split_state_tf32=True, lagged_products=True, **PINNED),
    "rows": dict(block_k=8, num_warps=4, prefetch=2, row_sums=True, late_node_terms=True, state_dot=False, **PINNED),
    "dot": dict(block_k=32, num_warps=8, prefetch=1, state_dot=True, late_node_terms=True, split_state_tf32=False,
                **PINNED),
    "split": dict(block_k=32, num_warps=8, prefetch=1, state_dot=True, late_node_terms=True, split_state_tf32=True,
                  **PINNED),
    "split_bf16": dict(block_k=32, num_warps=8, prefetch=1, state_dot=True, late_node_terms=True,
                       split_state_bf16=True, epilogue_in_mma_layout=False, state_pass_rows=0),
    "two_heads": dict(block_k=16, num_warps=8, prefetch=1, state_dot=True, late_node_terms=True, heads_per_program=2,
                      split_state_tf32=True, **PINNED),
    "epilogue_in_mma_layout": dict(block_k=32, num_warps=8, prefetch=1, state_dot=True, late_node_terms=True,
                                   split_state_tf32=True, epilogue_in_mma_layout=True, split_state_bf16=False,
                                   state_pass_rows=0),
    "solve_by_dots": dict(block_k=32, num_warps=8, prefetch=1, state_dot=True, late_node_terms=True,
                          split_state_tf32=True, epilogue_in_mma_layout=True, solve_by_dots=True,
                          split_state_bf16=False, state_pass_rows=0),
    # the state pass and the row epilogue in two launches (at most 8 nodes), the second after the first or as its
    # programmatic dependent (wgmma products at 64 and 128 rows, mma.sync at 16; 2xTF32 / 3xBF16 / the bf16 pass)
    "row_epilogue": dict(split_state_bf16=True, state_pass_rows=64, state_pass_block_k=64, state_pass_warps=4,
                         num_warps=1, dependent_launch=False),
    "row_epilogue_dependent": dict(split_state_bf16=True, state_pass_rows=128, state_pass_block_k=128,
                                   state_pass_warps=8, num_warps=2, dependent_launch=True),
    "row_epilogue_16_rows": dict(split_state_tf32=True, split_state_bf16=False, state_pass_rows=16,
                                 state_pass_block_k=128, state_pass_warps=2, num_warps=1, dependent_launch=True),
    # the state pass and the path epilogue (any node count): a program per 8 nodes as a dependent, per 2 after it
    "path_epilogue": dict(split_state_bf16=True, state_pass_rows=128, state_pass_block_k=128, state_pass_warps=8,
                          num_warps=4, dependent_launch=True, path_epilogue_nodes=8),
    "path_epilogue_2": dict(split_state_bf16=True, state_pass_rows=64, state_pass_block_k=64, state_pass_warps=4,
                            num_warps=1, dependent_launch=False, path_epilogue_nodes=2),
}


# a bf16 state with split_state_tf32 runs "dot"'s one tf32 pass (not repeated); with split_state_bf16, one bf16 pass
@pytest.mark.parametrize("state_dtype, variant", [
    (dtype, variant) for variant in GATED_VARIANTS for dtype in (torch.float32, torch.bfloat16)
    if not (variant in ("split", "split_in_mma_layout", "lagged_products") and dtype == torch.bfloat16)])
@pytest.mark.parametrize("tokens", [2, 4, 8])
def test_gated_step_vs_reference(state_dtype, tokens, variant):
    """A chain step with the tuned launch defaults and each layout (`check_gated_two_steps`)."""
    check_gated_two_steps(DraftTree.from_widths([1] * tokens), True, state_dtype, GATED_VARIANTS[variant])


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [3, 4])
@pytest.mark.parametrize("batch", [2, 12])
def test_gated_step_default_two_launches(state_dtype, tokens, batch):
    """2 and more than 8 requests of 3-4 nodes: the default's two launches (`launch_defaults`), vs fp64."""
    check_gated_two_steps(DraftTree.from_widths([1] * tokens), True, state_dtype, {}, batch=batch)


@pytest.mark.parametrize("variant", ["default", "solve_by_dots", "path_epilogue", "path_epilogue_2"])
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("widths", [(2, 2, 1), (4, 2), (3, 2, 2), (4, 2, 2)])
def test_gated_tree_step_vs_reference(widths, state_dtype, variant):
    """Draft trees as vLLM verifies them (root + N nodes), the commit along the tree's ancestor table
    (`check_gated_two_steps`)."""
    check_gated_two_steps(DraftTree.from_widths(list(widths)).with_root(), False, state_dtype,
                          GATED_VARIANTS[variant])


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("widths", [(2, 2, 1), (4, 2, 2)])
def test_gated_tree_step_default_many_requests(widths, state_dtype):
    """More than 4 requests of a tree: the default's 64-row state pass and path-epilogue programs of 4 nodes (the 3
    requests of `test_gated_tree_step_vs_reference` take its 16-row rule; `check_gated_two_steps`)."""
    check_gated_two_steps(DraftTree.from_widths(list(widths)).with_root(), False, state_dtype, {}, batch=6)


@pytest.mark.parametrize("variant", ["row_epilogue", "row_epilogue_dependent", "path_epilogue"])
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("widths", [(2, 2), (2, 1, 1)])
def test_gated_small_tree_row_epilogue(widths, state_dtype, variant):
    """Trees of 7 nodes (root included) through the state pass and the row or the path epilogue
    (`check_gated_two_steps`)."""
    check_gated_two_steps(DraftTree.from_widths(list(widths)).with_root(), False, state_dtype,
                          GATED_VARIANTS[variant])


def check_gated_two_steps(tree, chain, state_dtype, launch, batch=3):
    """gdn_step_triton at H=16, HV=32, K=V=128 on `batch` requests of `tree` vs the fp64 reference: outputs, u in the
    slot rows, and the state the pending commit inside the next step writes (the tree's last node, a leaf at full
    depth, accepted; one request with nothing pending)."""
    from vllm_treewy.kernels.reference import reference_gated_tree
    from vllm_treewy.kernels.triton import gdn_step_triton, split_slot_factors

    nodes = tree.num_nodes
    inputs, pool, slots = gated_batch(nodes, batch, state_dtype, seed=nodes)
    packed = pack_trees([tree] * batch, device="cuda")
    before = pool.clone()
    factors = slot_factors(pool.shape[0], nodes)
    if chain:
        ancestors = pending_ancestors = None
    else:
        one = pack_trees([tree], device="cuda")
        ancestors = ancestor_table(packed.parents, packed.cu_nodes, packed.max_depth)
        pending_ancestors = ancestor_table(one.parents, one.cu_nodes, one.max_depth)
    kw = dict(num_key_heads=H, max_nodes=nodes, max_depth=None if chain else packed.max_depth, chain=chain,
              ancestors=ancestors, factors=factors, **launch)
    out = gdn_step_triton(*inputs, pool, slots, packed.parents, packed.cu_nodes, **kw)
    assert torch.equal(pool, before)
    _, _, u, _ = split_slot_factors(factors, HV, K, V)
    tolerance = 2e-5 if state_dtype == torch.float32 else 2e-2
    leaf = nodes - 1
    states = []
    for b in range(batch):
        rows = slice(b * nodes, (b + 1) * nodes)
        ref = reference_gated_tree(*(x[rows].cpu() for x in inputs[:3]), inputs[3].cpu(), inputs[4].cpu(),
                                   inputs[5][rows].cpu(), inputs[6].cpu(), before[int(slots[b])].cpu(),
                                   list(tree.parents), H)
        assert relative_error(out[rows], ref.out) <= 1e-2  # stored in bf16
        assert relative_error(u[int(slots[b])], ref.recurrence.u) <= tolerance
        states.append(ref.recurrence.state[leaf])
    accepted = torch.full((batch,), leaf, dtype=torch.int32, device="cuda")
    accepted[1] = -1
    fresh, _, _ = gated_batch(nodes, batch, state_dtype, seed=nodes + 100)
    gdn_step_triton(*fresh, pool, slots, packed.parents, packed.cu_nodes, pending_nodes=accepted,
                    pending_ancestors=pending_ancestors, **kw)
    state_tolerance = 2e-5 if state_dtype == torch.float32 else 1e-2
    for b in range(batch):
        if b == 1:
            assert torch.equal(pool[int(slots[b])], before[int(slots[b])])
        else:
            assert relative_error(pool[int(slots[b])], states[b]) <= state_tolerance


@pytest.mark.parametrize("variant", ["default", "row_epilogue", "row_epilogue_dependent"])
def test_gated_step_graph_capture(variant):
    from vllm_treewy.kernels.triton import gdn_step_triton

    launch = GATED_VARIANTS[variant]

    inputs, pool, slots = gated_batch(4, 2, torch.float32, seed=5)
    packed = pack_trees([DraftTree.from_widths([1] * 4)] * 2, device="cuda")
    out = torch.empty(8, HV, V, dtype=torch.bfloat16, device="cuda")
    factors = slot_factors(pool.shape[0], 4)
    pending = torch.tensor([3, 1], dtype=torch.int32, device="cuda")

    def step():
        return gdn_step_triton(*inputs, pool, slots, packed.parents, packed.cu_nodes, num_key_heads=H, max_nodes=4,
                               chain=True, out=out, factors=factors, pending_nodes=pending, **launch)

    gdn_step_triton(*inputs, pool, slots, packed.parents, packed.cu_nodes, num_key_heads=H, max_nodes=4,
                    chain=True, out=out, factors=factors, **launch)  # rows to commit
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    fresh, fresh_pool, _ = gated_batch(4, 2, torch.float32, seed=6)
    for static, new in zip([*inputs, pool], [*fresh, fresh_pool]):
        static.copy_(new)
    rows = factors.clone()
    out.fill_(float("nan"))
    graph.replay()
    replayed, replayed_pool = out.clone(), pool.clone()
    pool.copy_(fresh_pool)
    factors.copy_(rows)
    step()
    assert torch.equal(replayed, out) and torch.equal(replayed_pool, pool) and bool(out.isfinite().all())


def gated_two_steps(state_dtype, launch, tokens=4, batch=5, seed=11):
    """A chain step, then a step that commits its whole chain (one request with nothing pending): (outputs of both
    steps, u rows after each, the committed pool)."""
    from vllm_treewy.kernels.triton import gdn_step_triton, split_slot_factors

    inputs, pool, slots = gated_batch(tokens, batch, state_dtype, seed=seed)
    fresh, _, _ = gated_batch(tokens, batch, state_dtype, seed=seed + 1)
    packed = pack_trees([DraftTree.from_widths([1] * tokens)] * batch, device="cuda")
    factors = slot_factors(pool.shape[0], tokens)
    kw = dict(num_key_heads=H, max_nodes=tokens, chain=True, factors=factors, **launch)
    out1 = gdn_step_triton(*inputs, pool, slots, packed.parents, packed.cu_nodes, **kw)
    u1 = split_slot_factors(factors, HV, K, V)[2][slots.long()].clone()
    accepted = torch.full((batch,), tokens - 1, dtype=torch.int32, device="cuda")
    accepted[2] = -1
    out2 = gdn_step_triton(*fresh, pool, slots, packed.parents, packed.cu_nodes, pending_nodes=accepted, **kw)
    u2 = split_slot_factors(factors, HV, K, V)[2][slots.long()].clone()
    return (out1, out2), (u1, u2), pool, (inputs, slots, packed)


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_gated_two_heads_per_program_vs_one(state_dtype):
    """heads_per_program=2 against 1 at the same tiles and passes: u and committed states to fp32 rounding,
    outputs to one bf16 rounding (different programs may contract or order the epilogue's fp32 math differently)."""
    launch = dict(block_k=16, num_warps=8, prefetch=1, state_dot=True, late_node_terms=True, split_state_tf32=True,
                  state_pass_rows=0)
    one = gated_two_steps(state_dtype, launch)
    two = gated_two_steps(state_dtype, dict(launch, heads_per_program=2))
    for a, b in zip(one[0], two[0]):
        assert relative_error(b, a) <= 4e-3
    for a, b in zip(one[1], two[1]):
        assert relative_error(b, a) <= 1e-6
    assert relative_error(two[2], one[2]) <= (1e-6 if state_dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize("split", ["split_state_tf32", "split_state_bf16"])
def test_gated_split_state_accuracy(split):
    """2xTF32 or 3xBF16 on an fp32 state (bf16 q/k): u within 1e-6 of fp64 and of tf32x3 (bounds 2^-22 and 2^-27
    per product, `_state_products`), at K=128."""
    from vllm_treewy.kernels.reference import reference_gated_tree

    launch = dict(block_k=32, num_warps=8, prefetch=1, state_dot=True, late_node_terms=True, split_state_tf32=False,
                  state_pass_rows=0)
    split = gated_two_steps(torch.float32, dict(launch, **{split: True}))
    three = gated_two_steps(torch.float32, launch)
    for a, b in zip(split[1], three[1]):
        assert relative_error(a, b) <= 1e-6
    inputs, slots, _ = split[3]
    pool = gated_batch(4, 5, torch.float32, seed=11)[1]  # the untouched pool of the first step
    for b in range(5):
        rows = slice(b * 4, (b + 1) * 4)
        ref = reference_gated_tree(*(x[rows].cpu() for x in inputs[:3]), inputs[3].cpu(), inputs[4].cpu(),
                                   inputs[5][rows].cpu(), inputs[6].cpu(), pool[int(slots[b])].cpu(),
                                   [-1, 0, 1, 2], H)
        assert relative_error(split[1][0][b], ref.recurrence.u) <= 1e-6
