"""The pseudo-value buffer: the commit's factors live in vLLM's KV-cache page, not in what a step was handed.

Under vLLM's CUDA graphs the GDN op's input `mixed_qkv` is a graph output in the graph pool, which later pieces of
the forward overwrite before the next step (whose verify runs the commit); the commit must not read it.
"""

from types import SimpleNamespace

import pytest
import torch
from vllm.model_executor.layers.mamba.mamba_utils import MambaStateShapeCalculator

from vllm_treewy.kernels.gdn_step_torch import gates, inverse_norm, split_qkv
from vllm_treewy.kernels.ancestor_table_torch import ancestor_table_torch
from vllm_treewy.tree import DraftTree, chain_parents
from vllm_treewy.vllm_plugin.gdn import reconstruct
from vllm_treewy.vllm_plugin.gdn.layer import ReconstructGatedDeltaNetAttention
from vllm_treewy.vllm_plugin.patch_points import MODEL_STATE_SHAPES
from vllm_treewy.vllm_plugin.gdn.pseudo_value_buffer import BufferLayout, PseudoValueBuffer, install
from vllm_treewy.vllm_plugin.gdn.step_metadata import commit_ancestor_table, verified_tree_ancestors

H, HV, K, V, WIDTH, NUM_SPEC, NUM_SLOTS = 2, 4, 8, 8, 4, 3, 5
CONV_DIM = 2 * H * K + HV * V
LAYOUT = BufferLayout.of_model(1, H, HV, K, V, NUM_SPEC)
# the verified block of draft_tree_widths [2, 2, 1]: root 0; 1, 2; 3, 4 (below 1), 5, 6 (below 2); 7 .. 10
TREE = DraftTree.from_widths([2, 2, 1]).with_root()
# the verified blocks of [3, 2, 2] (22 tokens: block 21 = node 20, below block 9 below block 3) and [4, 2]
BIG_TREES = (DraftTree.from_widths([3, 2, 2]).with_root(), DraftTree.from_widths([4, 2]).with_root())


def _layout(tree: DraftTree | None) -> BufferLayout:
    return LAYOUT if tree is None else BufferLayout.of_model(1, H, HV, K, V, tree.num_nodes - 1)


def _gdn_layer_stand_in():
    """What `gdn.reconstruct.step_torch` and `step_triton` read of a GDN layer."""
    return SimpleNamespace(activation="silu", conv1d=SimpleNamespace(bias=torch.randn(CONV_DIM) * 0.1),
                           A_log=torch.randn(HV) * 0.5, dt_bias=torch.randn(HV) * 0.5,
                           norm=SimpleNamespace(weight=torch.ones(V), activation="silu"), layer_norm_epsilon=1e-6)


def _empty_buffer(fill=float("nan"), layout=LAYOUT) -> PseudoValueBuffer:
    factors_shape, conv_shape, _ = layout.shapes()
    return PseudoValueBuffer(torch.full((NUM_SLOTS, *factors_shape), fill), torch.full((NUM_SLOTS, *conv_shape), fill),
                             layout)


def _step_metadata(slots, commit_nodes, tree: DraftTree | None = None):
    """Step metadata of requests in `slots`, each verifying a chain of 1 + NUM_SPEC nodes, or the block `tree`."""
    n = 1 + NUM_SPEC if tree is None else tree.num_nodes
    slots = torch.tensor(slots, dtype=torch.int32)
    cu = torch.arange(slots.shape[0] + 1, dtype=torch.int32) * n
    if tree is None:
        parents, ancestors, tree_ancestors = chain_parents(cu, int(cu[-1])), None, None
    else:
        parents = torch.tensor(tree.parents * len(slots), dtype=torch.int32)
        ancestors = ancestor_table_torch(parents, cu, tree.max_depth)
        tree_ancestors = ancestors[:n]
    return SimpleNamespace(state_indices=slots, spec_query_start_loc=cu, parents=parents, ancestors=ancestors,
                           tree_ancestors=tree_ancestors, commit_ancestors=tree_ancestors, verify_block_len=None,
                           commit_nodes=torch.tensor(commit_nodes, dtype=torch.int32),
                           node_slots=slots.long().repeat_interleave(n),
                           node_indices=torch.arange(n).repeat(len(slots)))


def _stepping_layer(layout, triton: bool):
    """(layer stand-in, its caches with an empty pseudo-value buffer of `layout`, the caches' states before any step,
    `step(metadata, x, a, b)`: `gdn.reconstruct.step_torch`, or with `triton` `gdn.reconstruct.step_triton` (normed
    outputs) over a bf16 SSM state)."""
    layer = _gdn_layer_stand_in()
    caches = dict(conv_weight=torch.randn(CONV_DIM, WIDTH) * 0.3,
                  conv_history=torch.randn(NUM_SLOTS, CONV_DIM, WIDTH - 1),
                  ssm_state=torch.randn(NUM_SLOTS, HV, V, K) * 0.1,
                  buffer=_empty_buffer(layout=layout))
    if triton:
        caches["ssm_state"] = caches["ssm_state"].bfloat16()
    before = {name: caches[name].clone() for name in ("conv_history", "ssm_state")}

    def step(metadata, x, a, b):
        if not triton:
            return reconstruct.step_torch(layer, metadata, x, a, b, **caches)
        out = torch.full((x.shape[0], HV, V), float("nan"))
        reconstruct.step_triton(layer, metadata, x, a, b, torch.randn(x.shape[0], HV, V), out, **caches)
        return out

    return layer, caches, before, step


def _two_steps(inputs, clobber_inputs: bool, commit_nodes=(2, 0), tree: DraftTree | None = None, triton=False):
    """Step 1 verifies two requests (slots 3, 1); step 2 commits their accepted nodes `commit_nodes` and verifies
    again. The drafts are chains, or the verified block `tree` in both steps. `triton`: `gdn.reconstruct.step_triton`
    (normed outputs) with a bf16 SSM state (K = V = 8: tiles masked to heads narrower than a tensor-core dot)."""
    torch.manual_seed(1)
    layer, caches, before, step = _stepping_layer(_layout(tree), triton)
    first, second = inputs
    out1 = step(_step_metadata([3, 1], [-1, -1], tree), *first)
    assert torch.equal(caches["ssm_state"], before["ssm_state"])  # verify writes no state
    if clobber_inputs:  # what the next CUDA graph pieces do to the op's inputs before the next step
        for t in first:
            t.normal_()
    out2 = step(_step_metadata([3, 1], list(commit_nodes), tree), *second)
    return out1, out2, caches, before, layer


def test_next_steps_commit_reads_the_buffer_not_the_step_inputs():
    torch.manual_seed(0)
    inputs = [(torch.randn(8, CONV_DIM), torch.randn(8, HV), torch.randn(8, HV)) for _ in range(2)]
    copy = lambda: [tuple(t.clone() for t in step) for step in inputs]  # noqa: E731
    out1, out2, caches, before, _ = _two_steps(copy(), clobber_inputs=False)
    out1_c, out2_c, caches_c, _, _ = _two_steps(copy(), clobber_inputs=True)
    torch.testing.assert_close(out1_c, out1)
    torch.testing.assert_close(out2_c, out2)
    torch.testing.assert_close(caches_c["ssm_state"], caches["ssm_state"])
    # The conv history continues with the accepted path's inputs: slot 3 accepted node 2, slot 1 node 0.
    x = inputs[0][0]
    history = caches["conv_history"]
    torch.testing.assert_close(history[3], x[0:3].T)
    torch.testing.assert_close(history[1], torch.cat([before["conv_history"][1][:, 1:], x[4:5].T], dim=1))
    untouched = [0, 2, 4]
    torch.testing.assert_close(history[untouched], before["conv_history"][untouched])
    torch.testing.assert_close(caches["ssm_state"][untouched], before["ssm_state"][untouched])
    assert not torch.equal(caches["ssm_state"][[1, 3]], before["ssm_state"][[1, 3]])


def _path_recurrence(layer, conv_weight, history, h, x, a, b, path):
    """fp64, node by node along `path` (packed rows, root first) from conv history `[D, W-1]` and SSM state h: each
    node's conv window (history, then the path's inputs), then the gated delta rule. The state and the conv
    history after the path's last node."""
    window = torch.cat([history.T, x[path]]).double()  # [W-1+P, D]
    conv = torch.stack([(window[i : i + WIDTH] * conv_weight.T.double()).sum(0) for i in range(len(path))])
    q, k, v = split_qkv(torch.nn.functional.silu(conv + layer.conv1d.bias.double()), H, K, V)
    g, beta = gates(a[path], b[path], layer.A_log, layer.dt_bias, torch.float64)
    h = h.double()
    for t in range(len(path)):
        kt = (k[t] * inverse_norm(k[t])[:, None]).repeat_interleave(HV // H, dim=0)  # [HV, K]
        h = torch.exp(g[t])[:, None, None] * h
        u = beta[t][:, None] * (v[t] - torch.einsum("hvk,hk->hv", h, kt))
        h = h + u[..., None] * kt[:, None, :]
    return h, window[-(WIDTH - 1):].T


def _path(tree: DraftTree, node: int) -> list[int]:
    """Local indices of `node` and its ancestors, root first."""
    path = [node]
    while tree.parents[path[0]] >= 0:
        path.insert(0, tree.parents[path[0]])
    return path


@pytest.mark.parametrize("triton", [False, True], ids=["torch", "triton"])
@pytest.mark.parametrize("tree, commit_nodes", [
    (None, (2, 0)),
    # slot 3 accepts 9 (path 0, 2, 5, 9: the root's second branch), slot 1 accepts 4 (path 0, 1, 4)
    (TREE, (9, 4)),
    (BIG_TREES[0], (21, 12)),  # leaves: on the last branch; slot 1 under the root's second child
    (BIG_TREES[1], (12, 0)),  # the last leaf; slot 1 accepted nothing (the root alone)
], ids=["chains", "tree", "tree-3x2x2", "tree-4x2"])
def test_committed_state_is_the_accepted_nodes_recurrent_state(tree, commit_nodes, triton):
    """The SSM state and conv history that step 2 commits and verifies from are step 1's after its accepted node,
    node by node along the accepted node's path (a chain prefix, or a path through the tree)."""
    torch.manual_seed(0)
    block = tree or DraftTree.from_widths([1] * (1 + NUM_SPEC))
    n = block.num_nodes
    inputs = [(torch.randn(2 * n, CONV_DIM), torch.randn(2 * n, HV), torch.randn(2 * n, HV)) for _ in range(2)]
    _, out2, caches, before, layer = _two_steps(inputs, clobber_inputs=False, commit_nodes=commit_nodes, tree=tree,
                                                triton=triton)
    assert not bool(out2.isnan().any())
    tolerance = dict(rtol=1e-2, atol=1e-3) if triton else dict(rtol=1e-5, atol=1e-6)  # bf16 state for triton
    for request, (slot, accepted) in enumerate(zip((3, 1), commit_nodes)):
        path = [request * n + node for node in _path(block, accepted)]
        h, history = _path_recurrence(layer, caches["conv_weight"], before["conv_history"][slot],
                                      before["ssm_state"][slot], *inputs[0], path)
        torch.testing.assert_close(caches["ssm_state"][slot].double(), h, **tolerance)
        torch.testing.assert_close(caches["conv_history"][slot].double(), history, rtol=0, atol=0)


def test_buffer_round_trip_keeps_each_node_in_its_slot_row():
    factors_shape, conv_shape, count_shape = LAYOUT.shapes()
    assert factors_shape == (1 + NUM_SPEC, HV * K + HV + HV * V + HV) and conv_shape == (1 + NUM_SPEC, CONV_DIM)
    assert count_shape == (1,)
    buffer = _empty_buffer(fill=0.0)
    slots, nodes = torch.tensor([4, 4, 0]), torch.tensor([0, 1, 0])
    keys, key_scales, values, decays = torch.randn(3, H, K), torch.rand(3, H), torch.randn(3, HV, V), -torch.rand(3, HV)
    buffer.write_factors(slots, nodes, keys, key_scales, values, decays)
    read = buffer.slot_factors(torch.tensor([0, 4]))
    ratio = HV // H
    expected = (keys.repeat_interleave(ratio, 1), key_scales.repeat_interleave(ratio, 1), values, decays)
    for got, want in zip(read, expected):
        torch.testing.assert_close(got[0, 0], want[2])
        torch.testing.assert_close(got[1, :2], want[:2])
    assert buffer.factors[[1, 2, 3]].abs().sum() == 0 and buffer.factors[4, 2:].abs().sum() == 0


def _speculative_config(strategy: str, tree: bool = False):
    widths = [2, 1] if tree else None
    return SimpleNamespace(num_speculative_tokens=NUM_SPEC, mamba_state_commit=strategy, is_draft_tree=tree,
                           draft_tree=DraftTree.from_widths(widths) if tree else None)


def _layer_for_binding(strategy: str, tree: bool = False):
    layer = object.__new__(ReconstructGatedDeltaNetAttention)
    torch.nn.Module.__init__(layer)
    layer.speculative_config = _speculative_config(strategy, tree)
    layer.reconstructs_state = strategy == "reconstruct"
    layer.keeps_slot_counts = layer.reconstructs_state or tree
    layer.tp_size, layer.num_k_heads, layer.num_v_heads, layer.head_k_dim, layer.head_v_dim = 1, H, HV, K, V
    layer.conv_kernel_size, layer.num_spec = WIDTH, NUM_SPEC
    layer.model_config = SimpleNamespace(dtype=torch.bfloat16)
    layer.cache_config = SimpleNamespace(mamba_cache_dtype="auto", mamba_ssm_cache_dtype="float32")
    return layer


def test_buffer_views_follow_vllms_states_on_the_page():
    layer = _layer_for_binding("reconstruct")
    conv_shape, ssm_shape = layer.get_state_shape()
    layout = layer.buffer_layout()
    state_bytes = torch.Size(conv_shape).numel() * 2 + torch.Size(ssm_shape).numel() * 4
    buffer_bytes = layout.num_nodes * (layout.factor_width * 4 + layout.conv_dim * 2) + 4
    page = state_bytes + buffer_bytes + 64  # vLLM pads pages to the attention page
    raw = torch.zeros(NUM_SLOTS, 1, 1, page, dtype=torch.int8)
    layer.bind_kv_cache(raw)
    conv, ssm, factors, conv_inputs, counts = layer.kv_cache
    assert factors.shape == (NUM_SLOTS, *layout.shapes()[0]) and factors.dtype == torch.float32
    assert conv_inputs.shape == (NUM_SLOTS, *layout.shapes()[1]) and conv_inputs.dtype == torch.bfloat16
    assert counts.shape == (NUM_SLOTS, 1) and counts.dtype == torch.int32
    factors.fill_(1.0)
    conv_inputs.fill_(2.0)
    counts.fill_(3)
    assert conv.abs().sum() == 0 and ssm.abs().sum() == 0  # the buffer does not overlap vLLM's states
    assert int(raw[:, 0, 0, state_bytes + buffer_bytes:].abs().sum()) == 0  # nor the padding
    assert layer.verified_node_counts().tolist() == [3] * NUM_SLOTS
    plain = _layer_for_binding("store_all")
    plain.bind_kv_cache(torch.zeros(NUM_SLOTS, 1, 1, page, dtype=torch.int8))
    assert len(plain.kv_cache) == 2 and plain.verified_node_counts() is None


def test_a_store_all_tree_page_holds_the_count_alone():
    """The store_all tree baseline keeps no buffer (a state block per node instead), only each slot's count: the
    block of the node it accepted."""
    layer = _layer_for_binding("store_all", tree=True)
    conv_shape, ssm_shape = layer.get_state_shape()
    state_bytes = torch.Size(conv_shape).numel() * 2 + torch.Size(ssm_shape).numel() * 4
    raw = torch.zeros(NUM_SLOTS, 1, 1, state_bytes + 4 + 64, dtype=torch.int8)
    layer.bind_kv_cache(raw)
    conv, ssm, counts = layer.kv_cache
    assert counts.shape == (NUM_SLOTS, 1) and counts.dtype == torch.int32
    layer.verified_node_counts().fill_(7)
    assert counts.view(-1).tolist() == [7] * NUM_SLOTS and conv.abs().sum() == 0 and ssm.abs().sum() == 0
    assert int(raw[:, 0, 0, state_bytes + 4:].abs().sum()) == 0


@pytest.mark.parametrize("strategy,tree", [("store_all", False), ("reconstruct", False), ("store_all", True)])
def test_model_state_shapes_match_the_layers_page(strategy, tree):
    """vLLM sizes the attention pages from the model's classmethods: they must hold the buffer too."""
    install()
    hf = SimpleNamespace(linear_num_key_heads=H, linear_num_value_heads=HV, linear_key_head_dim=K,
                         linear_value_head_dim=V, linear_conv_kernel_dim=WIDTH)
    vllm_config = SimpleNamespace(
        model_config=SimpleNamespace(hf_text_config=hf, dtype=torch.bfloat16),
        parallel_config=SimpleNamespace(tensor_parallel_size=1),
        cache_config=SimpleNamespace(mamba_cache_dtype="auto", mamba_ssm_cache_dtype="float32"),
        speculative_config=_speculative_config(strategy, tree),
    )
    layer = _layer_for_binding(strategy, tree)
    base = MambaStateShapeCalculator.gated_delta_net_state_shape(1, H, HV, K, V, WIDTH, NUM_SPEC)
    expected = (*base, *layer._extra_page_states()[0])
    assert len(expected) == {"store_all": 2 + tree, "reconstruct": 5}[strategy]
    for model_cls in {point.resolve().__self__ for point in MODEL_STATE_SHAPES}:
        assert model_cls.get_mamba_state_shape_from_config(vllm_config) == expected
        dtypes = model_cls.get_mamba_state_dtype_from_config(vllm_config)
        assert len(dtypes) == len(expected)


# draft_tree_max_batch_size: the [2, 2, 1] tree (N = 10) at small batches, the chain of its depth (D = 3) above;
# a slot commits what it verified last, of either shape, through one table (`commit_ancestor_table`).
THRESHOLD_TREE = DraftTree.from_widths([2, 2, 1])
N_NODES, DEPTH = THRESHOLD_TREE.num_nodes, THRESHOLD_TREE.max_depth


def _shape_metadata(slots, commit_nodes, shape: str, commit_ancestors):
    """Step metadata of requests in `slots`, each verifying the tree's block (`shape` "tree") or the chain of its
    depth ("chain"), committing `commit_nodes` (rows of `commit_ancestors`)."""
    if shape == "tree":
        metadata = _step_metadata(slots, commit_nodes, THRESHOLD_TREE.with_root())
    else:
        n = 1 + DEPTH
        cu = torch.arange(len(slots) + 1, dtype=torch.int32) * n
        metadata = SimpleNamespace(state_indices=torch.tensor(slots, dtype=torch.int32), spec_query_start_loc=cu,
                                   parents=chain_parents(cu, int(cu[-1])), ancestors=None, tree_ancestors=None,
                                   verify_block_len=n,
                                   commit_nodes=torch.tensor(commit_nodes, dtype=torch.int32),
                                   node_slots=torch.tensor(slots).repeat_interleave(n),
                                   node_indices=torch.arange(n).repeat(len(slots)))
    metadata.commit_ancestors = commit_ancestors
    return metadata


@pytest.mark.parametrize("triton", [False, True], ids=["torch", "triton"])
@pytest.mark.parametrize("first, second, accepted", [
    # slot 3 accepted chain block 3 (the whole chain), slot 1 block 2
    ("chain", "tree", (("chain", 3), ("chain", 2))),
    ("chain", "chain", (("chain", 1), ("chain", 0))),
    # slot 3 accepted tree block 9 (path 0, 2, 5, 9), slot 1 block 4 (path 0, 1, 4)
    ("tree", "chain", (("tree", 9), ("tree", 4))),
], ids=["chain-then-tree", "chain-then-chain", "tree-then-chain"])
def test_a_slot_commits_the_shape_it_verified_last(first, second, accepted, triton):
    """A chain step of a tree config verifies the chain while its commit follows the previous step's tree, and the
    other way round: the committed SSM state and conv history are the fp64 recurrence along the accepted path of
    what the slot verified last. Commit nodes are the combined table's rows: tree block b is row b, chain block j
    row N + 1 + j (a recorded count c = 1 + row)."""
    torch.manual_seed(0)
    table = commit_ancestor_table(THRESHOLD_TREE, "cpu")
    assert table.shape == ((1 + N_NODES) + (1 + DEPTH), DEPTH + 1)
    assert torch.equal(table[: 1 + N_NODES], verified_tree_ancestors(THRESHOLD_TREE, "cpu"))
    assert table[1 + N_NODES + 3].tolist() == [3, 2, 1, 0] and table[1 + N_NODES].tolist() == [0, -1, -1, -1]
    block = THRESHOLD_TREE.with_root()
    sizes = {"tree": block.num_nodes, "chain": 1 + DEPTH}
    layer, caches, before, step = _stepping_layer(_layout(block), triton)
    inputs = [(torch.randn(2 * sizes[shape], CONV_DIM), torch.randn(2 * sizes[shape], HV),
               torch.randn(2 * sizes[shape], HV)) for shape in (first, second)]

    step(_shape_metadata([3, 1], [-1, -1], first, table), *inputs[0])
    commit_nodes = [node if shape == "tree" else 1 + N_NODES + node for shape, node in accepted]
    out2 = step(_shape_metadata([3, 1], commit_nodes, second, table), *inputs[1])
    assert not bool(out2.isnan().any())
    tolerance = dict(rtol=1e-2, atol=1e-3) if triton else dict(rtol=1e-5, atol=1e-6)
    n = sizes[first]
    for request, (slot, (shape, node)) in enumerate(zip((3, 1), accepted)):
        assert shape == first
        local = _path(block, node) if shape == "tree" else list(range(node + 1))
        path = [request * n + i for i in local]
        h, history = _path_recurrence(layer, caches["conv_weight"], before["conv_history"][slot],
                                      before["ssm_state"][slot], *inputs[0], path)
        torch.testing.assert_close(caches["ssm_state"][slot].double(), h, **tolerance)
        torch.testing.assert_close(caches["conv_history"][slot].double(), history, rtol=0, atol=0)
