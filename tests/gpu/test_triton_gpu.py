"""Triton kernels on CUDA at Qwen3.5-35B-A3B sizes (H=16, HV=32, K=V=128) against the fp64 per-node reference and
the torch twin, at every launch of the step's launch table, and CUDA-graph capture and replay. Run on the H200:
`pytest -m gpu tests/gpu` (or `bash tests/gpu/run_sharded.sh DIR`)."""

import pytest
import torch

from vllm_treewy.kernels.conv_step_torch import conv_verify_packed
from vllm_treewy.kernels.factor_rows import slot_factor_width, split_slot_factors
from vllm_treewy.kernels.reference import reference_gated_tree, reference_tree_conv
from vllm_treewy.tree import DraftTree, pack_trees

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

from vllm_treewy.kernels.ancestor_table_triton import ancestor_table  # noqa: E402
from vllm_treewy.kernels.conv_step_triton import conv_step_triton  # noqa: E402
from vllm_treewy.kernels.gdn_step_triton import gdn_step_triton  # noqa: E402
from vllm_treewy.kernels.gdn_step_triton import step as gdn_step_module  # noqa: E402

H, HV, K, V = 16, 32, 128, 128


def relative_error(actual, expected):
    expected = expected.double().cpu()
    return float((actual.double().cpu() - expected).abs().max() / expected.abs().max())


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
                     commit_ancestors=ancestors, activation="silu")
    for b in range(len(batch)):
        rows = slice(int(packed.cu_nodes[b]), int(packed.cu_nodes[b + 1]))
        expected = reference_tree_conv(x[rows].cpu(), before[int(slots[b])].cpu(), weight.cpu(), bias.cpu(),
                                       shape, "silu")
        assert relative_error(out[rows], expected.out) <= tolerance
        after = conv_state[int(slots[b])].cpu()
        assert torch.equal(after, before[int(slots[b])].cpu() if accepted[b] < 0
                           else expected.history[int(accepted[b])].to(dtype))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_chain_conv_steps_without_parents_are_the_steps_with_them(dtype):
    """A chain's conv steps given no parents (the adapter's chain call: each node steps to the node before) compute
    bit for bit what they compute given a chain's parents: the outputs and committed history over two steps."""
    tokens, batch = 4, 3
    packed = pack_trees([DraftTree.from_widths([1] * tokens)] * batch, device="cuda")
    channels, history_len = 2 * H * K + HV * V, 3
    gen = torch.Generator().manual_seed(7)
    xs = [torch.randn(packed.num_nodes, channels, generator=gen).to(dtype).cuda() for _ in range(2)]
    weight = torch.randn(channels, 4, generator=gen).to(dtype).cuda()
    conv_state = torch.randn(batch + 2, history_len, channels, generator=gen).to(dtype).cuda().transpose(1, 2)
    slots = torch.tensor([3, 0, 4], dtype=torch.int32, device="cuda")
    accepted = torch.tensor([3, -1, 1], dtype=torch.int32, device="cuda")
    runs = []
    for parents in (packed.parents, None):
        state = conv_state.clone()
        inputs = torch.zeros(batch + 2, tokens, channels, dtype=dtype, device="cuda")
        first = conv_step_triton(xs[0], state, slots, weight, None, parents, packed.cu_nodes, inputs, None)
        second = conv_step_triton(xs[1], state, slots, weight, None, parents, packed.cu_nodes, inputs, accepted)
        runs.append((first, second, state))
    assert all(torch.equal(a, b) for a, b in zip(*runs))


def gated_batch(tokens, batch, state_dtype, seed, heads=(H, HV), dims=(K, V)):
    """Raw post-conv inputs at real sizes (what vLLM's fused MTP kernel takes) and a pool with shuffled slots."""
    (h, hv), (key_dim, value_dim) = heads, dims
    gen = torch.Generator().manual_seed(seed)
    n = tokens * batch
    mixed_qkv = torch.randn(n, 2 * h * key_dim + hv * value_dim, generator=gen).bfloat16()
    a, b = (torch.randn(n, hv, generator=gen) * 2).bfloat16(), torch.randn(n, hv, generator=gen).bfloat16()
    A_log, dt_bias = torch.randn(hv, generator=gen) * 0.5, torch.randn(hv, generator=gen)
    z = torch.randn(n, hv, value_dim, generator=gen).bfloat16()
    weight = (1 + 0.1 * torch.randn(value_dim, generator=gen)).bfloat16()
    slots = torch.randperm(batch + 3, generator=gen)[:batch].to(torch.int32)
    pool = (torch.randn(batch + 3, hv, value_dim, key_dim, generator=gen, dtype=torch.float64) * 0.3).to(state_dtype)
    inputs = [x.cuda() for x in (mixed_qkv, a, b, A_log, dt_bias, z, weight)]
    return inputs, pool.cuda(), slots.cuda()


def slot_factors(num_slots, tokens, hv=HV, key_dim=K, value_dim=V):
    """[S, T, F] as a strided view into larger pages, as the adapter keeps them in the KV cache."""
    width = slot_factor_width(hv, key_dim, value_dim)
    return torch.full((num_slots, tokens + 1, width + 32), float("nan"), device="cuda")[:, :tokens, :width]


# the launch table's launches by name; "default" (None) takes the table's for each test's batch and nodes
LAUNCHES = {"default": None, "rows_16": gdn_step_module.ROWS_16, "rows_64": gdn_step_module.ROWS_64,
            "rows_32": gdn_step_module.ROWS_32, "tree_rows_16": gdn_step_module.TREE_ROWS_16,
            "tree_rows_64": gdn_step_module.TREE_ROWS_64}
REQUEST_LAUNCHES = ["default", "rows_16", "rows_32", "rows_64"]
PATH_LAUNCHES = ["default", "tree_rows_16", "tree_rows_64"]


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens, launch", [(t, "default") for t in (2, 4, 8)] + [(t, "rows_64") for t in (2, 8)] + [
    (4, launch) for launch in REQUEST_LAUNCHES[1:] + ["tree_rows_64"]])
def test_gated_step_vs_reference(state_dtype, tokens, launch):
    """A chain step at the default and at every launch of the table (the path epilogue on chains too), vs fp64
    (`check_gated_two_steps`)."""
    check_gated_two_steps(DraftTree.from_widths([1] * tokens), True, state_dtype, LAUNCHES[launch])


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [3, 4])
@pytest.mark.parametrize("batch", [2, 6, 12])
def test_gated_step_default_launches(state_dtype, tokens, batch):
    """2, 6 and 12 requests of 3-4 nodes: the table's 16-, 64- and (16-bit) 128-row state passes, vs fp64."""
    check_gated_two_steps(DraftTree.from_widths([1] * tokens), True, state_dtype, None, batch=batch)


@pytest.mark.parametrize("launch", PATH_LAUNCHES)
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("widths", [(2, 2, 1), (4, 2), (3, 2, 2), (4, 2, 2)])
def test_gated_tree_step_vs_reference(widths, state_dtype, launch):
    """Draft trees as vLLM verifies them (root + N nodes), the commit along the tree's ancestor table
    (`check_gated_two_steps`)."""
    check_gated_two_steps(DraftTree.from_widths(list(widths)).with_root(), False, state_dtype, LAUNCHES[launch])


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("widths", [(2, 2, 1), (4, 2, 2)])
def test_gated_tree_step_default_many_requests(widths, state_dtype):
    """More than 4 requests of a tree: the table's 64-row state pass and path-epilogue programs of 4 nodes (the 3
    requests of `test_gated_tree_step_vs_reference` take its 16-row launch; `check_gated_two_steps`)."""
    check_gated_two_steps(DraftTree.from_widths(list(widths)).with_root(), False, state_dtype, None, batch=6)


@pytest.mark.parametrize("launch", ["default", "rows_64", "tree_rows_16"])
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("widths", [(2, 2), (2, 1, 1)])
def test_gated_small_tree_step(widths, state_dtype, launch):
    """Trees of 7 nodes (root included) through the state pass and the request or the path epilogue
    (`check_gated_two_steps`)."""
    check_gated_two_steps(DraftTree.from_widths(list(widths)).with_root(), False, state_dtype, LAUNCHES[launch])


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("widths", [(1, 1, 1), (2, 2, 1)])
def test_gated_step_narrow_heads(widths, state_dtype):
    """Heads of K = V = 8 (narrower than a tensor-core dot: the state pass's tiles masked to the head) at the
    defaults, a chain and a tree (`check_gated_two_steps`)."""
    tree = DraftTree.from_widths(list(widths))
    tree = tree if widths == (1, 1, 1) else tree.with_root()
    check_gated_two_steps(tree, widths == (1, 1, 1), state_dtype, None, heads=(2, 4), dims=(8, 8))


def check_gated_two_steps(tree, chain, state_dtype, launch, batch=3, heads=(H, HV), dims=(K, V)):
    """gdn_step_triton on `batch` requests of `tree` vs the fp64 reference: outputs, u in the slot rows, and the
    state the commit inside the next step writes (the tree's last node, a leaf at full depth, committed; one
    request with nothing to commit)."""
    (h, hv), (key_dim, value_dim) = heads, dims
    nodes = tree.num_nodes
    inputs, pool, slots = gated_batch(nodes, batch, state_dtype, seed=nodes, heads=heads, dims=dims)
    packed = pack_trees([tree] * batch, device="cuda")
    before = pool.clone()
    factors = slot_factors(pool.shape[0], nodes, hv, key_dim, value_dim)
    if chain:
        ancestors = commit_ancestors = None
    else:
        one = pack_trees([tree], device="cuda")
        ancestors = ancestor_table(packed.parents, packed.cu_nodes, packed.max_depth)
        commit_ancestors = ancestor_table(one.parents, one.cu_nodes, one.max_depth)
    kw = dict(num_key_heads=h, max_nodes=nodes, ancestors=ancestors, factors=factors, launch=launch)
    out = gdn_step_triton(*inputs, pool, slots, packed.cu_nodes, **kw)
    assert torch.equal(pool, before)
    _, _, u, _ = split_slot_factors(factors, hv, key_dim, value_dim)
    tolerance = 2e-5 if state_dtype == torch.float32 else 2e-2
    leaf = nodes - 1
    states = []
    for b in range(batch):
        rows = slice(b * nodes, (b + 1) * nodes)
        ref = reference_gated_tree(*(x[rows].cpu() for x in inputs[:3]), inputs[3].cpu(), inputs[4].cpu(),
                                   inputs[5][rows].cpu(), inputs[6].cpu(), before[int(slots[b])].cpu(),
                                   list(tree.parents), h)
        assert relative_error(out[rows], ref.out) <= 1e-2  # stored in bf16
        assert relative_error(u[int(slots[b])], ref.recurrence.u) <= tolerance
        states.append(ref.recurrence.state[leaf])
    commit_nodes = torch.full((batch,), leaf, dtype=torch.int32, device="cuda")
    commit_nodes[1] = -1
    fresh, _, _ = gated_batch(nodes, batch, state_dtype, seed=nodes + 100, heads=heads, dims=dims)
    gdn_step_triton(*fresh, pool, slots, packed.cu_nodes, commit_nodes=commit_nodes,
                    commit_ancestors=commit_ancestors, **kw)
    state_tolerance = 2e-5 if state_dtype == torch.float32 else 1e-2
    for b in range(batch):
        if b == 1:
            assert torch.equal(pool[int(slots[b])], before[int(slots[b])])
        else:
            assert relative_error(pool[int(slots[b])], states[b]) <= state_tolerance


@pytest.mark.parametrize("launch", ["default", "rows_64", "tree_rows_64"])
def test_gated_step_graph_capture(launch):
    """The step captured in a CUDA graph (its two launches, the dependent one included, and its workspace) replays
    as it runs eagerly on new data in the same buffers."""
    launch = LAUNCHES[launch]
    inputs, pool, slots = gated_batch(4, 2, torch.float32, seed=5)
    packed = pack_trees([DraftTree.from_widths([1] * 4)] * 2, device="cuda")
    out = torch.empty(8, HV, V, dtype=torch.bfloat16, device="cuda")
    factors = slot_factors(pool.shape[0], 4)
    commit_nodes = torch.tensor([3, 1], dtype=torch.int32, device="cuda")

    def step():
        return gdn_step_triton(*inputs, pool, slots, packed.cu_nodes, num_key_heads=H, max_nodes=4,
                               out=out, factors=factors, commit_nodes=commit_nodes, launch=launch)

    gdn_step_triton(*inputs, pool, slots, packed.cu_nodes, num_key_heads=H, max_nodes=4,
                    out=out, factors=factors, launch=launch)  # rows to commit
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


def test_gated_split_products_accuracy():
    """An fp32 state's products in three bf16 pieces against bf16 q/k (the default): u within 1e-6 of fp64 at
    K = 128, the committed state within 2e-5 (`state_pass._state_products`: 2^-27 a product)."""
    tokens, batch = 4, 5
    inputs, pool, slots = gated_batch(tokens, batch, torch.float32, seed=11)
    packed = pack_trees([DraftTree.from_widths([1] * tokens)] * batch, device="cuda")
    factors = slot_factors(pool.shape[0], tokens)
    before = pool.clone()
    gdn_step_triton(*inputs, pool, slots, packed.cu_nodes, num_key_heads=H, max_nodes=tokens,
                    factors=factors)
    u = split_slot_factors(factors, HV, K, V)[2]
    for b in range(batch):
        rows = slice(b * tokens, (b + 1) * tokens)
        ref = reference_gated_tree(*(x[rows].cpu() for x in inputs[:3]), inputs[3].cpu(), inputs[4].cpu(),
                                   inputs[5][rows].cpu(), inputs[6].cpu(), before[int(slots[b])].cpu(),
                                   [-1, 0, 1, 2], H)
        assert relative_error(u[int(slots[b])], ref.recurrence.u) <= 1e-6
