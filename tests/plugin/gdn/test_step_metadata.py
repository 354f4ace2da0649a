"""Per step, the GDN metadata builder decides which node each speculative slot commits inside its verify, and keeps
the slots' verified-node counts: a slot that a finished or preempted request left with a pending commit is never
committed into by the prefill that takes it next, nor by that request's first speculative step."""

import functools
from types import SimpleNamespace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from vllm.v1.attention.backends.gdn_attn import GDNAttentionMetadata, GDNAttentionMetadataBuilder

from vllm_treewy.kernels.bookkeeping import dispatch
from vllm_treewy.tree import DraftTree
from vllm_treewy.vllm_plugin.config import DraftShape, draft_shape_of
from vllm_treewy.vllm_plugin.gdn.layer import ReconstructGatedDeltaNetAttention
from vllm_treewy.vllm_plugin.gdn.sampling_tables import SamplingTables
from vllm_treewy.vllm_plugin.gdn.step_metadata import (
    GroupStepBuffers,
    ReconstructGDNAttentionMetadata,
    counts_layer,
    reconstruct_metadata,
    with_commit_nodes,
)
from vllm_treewy.vllm_plugin.trees.sampling import record_accepted_leaves

NUM_SLOTS, MAX_ROWS = 8, 16


@pytest.fixture(autouse=True, params=["torch", "triton"])
def count_updates(request, monkeypatch):
    """Every test on both paths: the torch ops (CPU) and the one-launch kernel (CUDA; here the interpreter)."""
    monkeypatch.setattr(dispatch, "launches_triton", lambda counts: request.param == "triton")
    return request.param


class FakeGDNLayer:
    """A reconstruct GDN layer as the builder and the runner's hooks see it: its KV-cache entries, read through the
    layer's own method, and what it keeps across steps."""

    verified_node_counts = ReconstructGatedDeltaNetAttention.verified_node_counts
    keeps_slot_counts = True

    def __init__(self, kv_cache, shape: DraftShape = DraftShape(None), runner_accepted_counts: bool = False,
                 prefix: str = "gdn.0"):
        self.kv_cache, self.prefix = kv_cache, prefix
        self.step_buffers = GroupStepBuffers(shape, runner_accepted_counts)
        self.sampling_tables = SamplingTables()


class FakeBuilder(SimpleNamespace):
    """vLLM's GDN metadata builder as `with_commit_nodes` sees it (weakly referenced, as vLLM's is)."""


def staged_buffers(builder) -> tuple[torch.Tensor, torch.Tensor]:
    """The builder's persistent slots and commit nodes (FULL graphs), kept by its group's counts layer."""
    return counts_layer(builder).step_buffers.staged(builder, builder.num_accepted_tokens.shape[0])


def _builder(full_graphs: bool, widths=None, threshold=None):
    # the count state inside each slot's KV-cache page, after the slot's other states: strided
    counts = torch.zeros(NUM_SLOTS, 3, dtype=torch.int32)[:, 2:]
    tree = None if widths is None else DraftTree.from_widths(widths)
    speculative_config = SimpleNamespace(is_draft_tree=tree is not None, draft_tree=tree,
                                         draft_tree_max_batch_size=threshold)
    layer = FakeGDNLayer((None, None, None, None, counts), draft_shape_of(speculative_config))
    builder = FakeBuilder(
        layer_names=["gdn.0"], use_full_cuda_graph=full_graphs, decode_cudagraph_max_bs=MAX_ROWS,
        num_accepted_tokens=torch.ones(MAX_ROWS, dtype=torch.int32),
        vllm_config=SimpleNamespace(compilation_config=SimpleNamespace(static_forward_context={"gdn.0": layer}),
                                    speculative_config=speculative_config),
    )
    builder._stage_spec_decode = functools.partial(GDNAttentionMetadataBuilder._stage_spec_decode, builder)
    return builder, counts.view(-1)


def _build(builder, metadata, tree_verify=True):
    """The wrapped build, then the step's count update, as the group's first GDN layer runs it in the forward
    (`tree_verify`: a tree config's step verifies its tree, `config.DraftShape.verifies_tree`)."""
    result = with_commit_nodes(builder, metadata, tree_verify)
    result.update_counts(counts_layer(builder))
    return result


def _spec_step(slots, nodes, accepted, padding_rows=0):
    """A batch of speculative decodes only (FULL-graph eligible), `padding_rows` trailing rows in the null slot 0."""
    rows = len(slots) + padding_rows
    cu = torch.tensor([0, *torch.tensor(nodes).cumsum(0).tolist()] + [sum(nodes)] * padding_rows, dtype=torch.int32)
    return GDNAttentionMetadata(
        num_prefills=0, num_prefill_tokens=0, num_decodes=0, num_decode_tokens=0, num_spec_decodes=len(slots),
        num_spec_decode_tokens=sum(nodes), num_actual_tokens=sum(nodes),
        # vLLM's FULL-graph buffer has 1 + k columns and broadcasts the one block of each request into them
        spec_query_start_loc=cu,
        spec_state_indices_tensor=torch.tensor(slots + [0] * padding_rows)[:, None].expand(-1, 4),
        spec_sequence_masks=torch.ones(rows, dtype=torch.bool),
        num_accepted_tokens=torch.tensor(accepted + [1] * padding_rows, dtype=torch.int32),
    )


def _sampled(counts, slots, accepted):
    """What `v1.accepted_counts` records right after a step's sampling: each row's accepted count in its slot."""
    counts[torch.tensor(slots)] = torch.tensor(accepted, dtype=counts.dtype)


def _mixed_step(spec_slots, nodes, accepted, prefill_slots):
    metadata = _spec_step(spec_slots, nodes, accepted)
    metadata.num_prefills, metadata.num_prefill_tokens = len(prefill_slots), 5 * len(prefill_slots)
    metadata.non_spec_state_indices_tensor = torch.tensor(prefill_slots)
    return metadata


def test_commit_nodes_follow_the_accepted_counts_of_slots_with_a_pending_verify():
    builder, counts = _builder(full_graphs=False)
    first = _build(builder, _spec_step([3, 5], [4, 1], [1, 1]))
    assert isinstance(first, ReconstructGDNAttentionMetadata)
    # the kernels index the slots flat: one per row, whatever vLLM's column stride (a broadcast 1 + k here)
    assert first.state_indices.tolist() == [3, 5] and first.state_indices.is_contiguous()
    assert first.commit_nodes.tolist() == [-1, -1]  # fresh slots: nothing verified before
    assert counts[[3, 5]].tolist() == [4, 1]
    _sampled(counts, [3, 5], [3, 1])
    second = _build(builder, _spec_step([5, 3], [4, 4], [1, 3]))
    assert second.commit_nodes.tolist() == [0, 2]  # accepted count - 1, in this step's row order
    assert counts[[3, 5]].tolist() == [4, 4]


def test_the_metadata_subclass_is_vllms_metadata_and_ours_at_their_defaults():
    """Built without the dataclass __init__ (vLLM's metadata defines no __post_init__ to miss): the same objects as
    vLLM's fields, ours at their defaults, also from a copy of an instance of ours (V2's re-gathered group), whose
    derived per-node tensors are dropped."""
    import dataclasses

    assert not hasattr(GDNAttentionMetadata, "__post_init__") and not hasattr(GDNAttentionMetadata, "__slots__")
    vllm_metadata = _spec_step([3, 5], [4, 1], [1, 1])
    built = reconstruct_metadata(vllm_metadata)
    through_init = ReconstructGDNAttentionMetadata(**{f.name: getattr(vllm_metadata, f.name)
                                                      for f in dataclasses.fields(GDNAttentionMetadata)})
    assert type(built) is ReconstructGDNAttentionMetadata and vars(built).keys() == vars(through_init).keys()
    assert all(getattr(built, name) is getattr(through_init, name) for name in vars(through_init))
    builder, _ = _builder(full_graphs=False)
    ours = _build(builder, vllm_metadata)
    assert ours.node_indices is not None and "node_indices" in vars(ours)  # derived on first use
    again = reconstruct_metadata(ours)
    assert again.state_indices is None and again.counts_layer is None
    assert "node_indices" not in vars(again) and again.spec_query_start_loc is ours.spec_query_start_loc


def test_a_request_left_out_of_a_step_commits_its_recorded_node():
    """A running request that a step leaves unscheduled comes back with vLLM's accepted count reset to 1; the count
    recorded in its slot after its last sampling still says which node to commit."""
    builder, counts = _builder(full_graphs=False)
    _build(builder, _spec_step([3, 5], [4, 4], [1, 1]))
    _sampled(counts, [3, 5], [3, 2])
    _build(builder, _spec_step([5], [4], [2]))  # slot 3's request is left out of this step
    _sampled(counts, [5], [4])
    back = _build(builder, _spec_step([3, 5], [4, 4], [1, 4]))  # vLLM re-adds slot 3's row with 1
    assert back.commit_nodes.tolist() == [2, 3]


def test_a_prefill_clears_the_slot_a_finished_request_left_pending():
    builder, counts = _builder(full_graphs=False)
    _build(builder, _spec_step([3, 5], [4, 4], [1, 1]))
    _sampled(counts, [3, 5], [2, 2])
    # The request in slot 5 finished; a new request prefills there beside slot 3's next verify.
    mixed = _build(builder, _mixed_step([3], [4], [2], prefill_slots=[5]))
    assert mixed.commit_nodes.tolist() == [1]
    assert counts[5] == 0
    _sampled(counts, [3], [4])
    # Its first speculative step commits nothing, though vLLM's accepted count for it is 1.
    after = _build(builder, _spec_step([5, 3], [4, 4], [1, 4]))
    assert after.commit_nodes.tolist() == [-1, 3]


def test_a_speculative_batch_updates_its_counts_in_the_first_layers_forward_only():
    """With speculative rows the builder only names the layer that runs the count update: the group's first GDN layer
    runs it at the start of its forward (inside a FULL CUDA graph, a captured launch), once; the group's other layers
    read its commit nodes. A batch without speculative rows runs no speculative step, so the builder clears its slots
    itself."""
    builder, counts = _builder(full_graphs=True)
    builder.layer_names = ["gdn.0", "gdn.4"]
    _sampled(counts, [3], [3])
    metadata = with_commit_nodes(builder, _spec_step([3], [4], [3], padding_rows=1), False)
    assert counts[3] == 3 and metadata.counts_layer == "gdn.0"  # nothing ran yet
    metadata.update_counts(SimpleNamespace(prefix="gdn.4"))  # another layer of the group: nothing else read
    assert counts[3] == 3
    metadata.update_counts(counts_layer(builder))
    assert counts[3] == 4 and metadata.commit_nodes.tolist() == [2, -1]
    prefills = _mixed_step([], [], [], prefill_slots=[3])
    prefills.num_spec_decodes, prefills.spec_state_indices_tensor = 0, None
    assert with_commit_nodes(builder, prefills, False).counts_layer is None and counts[3] == 0


def test_the_count_state_must_sit_in_the_layer_that_runs_first():
    builder, _ = _builder(full_graphs=False)
    builder.layer_names = ["model.layers.4.linear_attn", "model.layers.1.linear_attn"]
    builder.vllm_config.compilation_config.static_forward_context[builder.layer_names[0]] = \
        builder.vllm_config.compilation_config.static_forward_context["gdn.0"]
    with pytest.raises(RuntimeError, match="layers.1.linear_attn runs first"):
        with_commit_nodes(builder, _spec_step([3], [4], [1]), False)


def test_each_node_has_its_own_block():
    """A store_all tree writes each verified node's state to its column of the request's blocks."""
    builder, _ = _builder(full_graphs=False, widths=[2, 1])
    step = _spec_step([3, 5], [3, 1], [1, 1])  # the second request verified its root alone
    step.spec_state_indices_tensor = torch.tensor([[7, 3, 9, 6, 8], [4, 1, 2, 0, 0]])
    assert _build(builder, step).node_blocks.tolist() == [7, 3, 9, 4]


def test_full_graph_batches_stage_the_commit_nodes_at_a_fixed_address():
    builder, counts = _builder(full_graphs=True)
    first = _build(builder, _spec_step([3], [4], [1], padding_rows=2))
    _sampled(counts, [3], [3])
    second = _build(builder, _spec_step([3], [4], [3], padding_rows=2))
    slots, commit_nodes = staged_buffers(builder)
    assert first.commit_nodes.data_ptr() == second.commit_nodes.data_ptr() == commit_nodes.data_ptr()
    assert first.state_indices.data_ptr() == second.state_indices.data_ptr() == slots.data_ptr()
    assert second.commit_nodes.tolist() == [2, -1, -1]  # padding rows (the null slot) commit nothing
    assert second.state_indices.tolist() == [3, 0, 0] and second.state_indices.is_contiguous()
    assert counts[0] == 0  # nor are they counted


def test_each_builder_of_a_group_stages_into_its_own_buffers():
    """vLLM makes one builder per microbatch where it splits batches: each captures graphs on its own buffers, so
    the group's counts layer keeps a set per builder, and nothing on the builders."""
    builder, _ = _builder(full_graphs=True)
    other = FakeBuilder(**vars(builder))
    other._stage_spec_decode = functools.partial(GDNAttentionMetadataBuilder._stage_spec_decode, other)
    first, second = _build(builder, _spec_step([3], [4], [1])), _build(other, _spec_step([5], [4], [1]))
    assert first.commit_nodes.data_ptr() != second.commit_nodes.data_ptr()
    assert first.state_indices.tolist() == [3] and second.state_indices.tolist() == [5]
    assert _build(builder, _spec_step([3], [4], [1])).state_indices.data_ptr() == first.state_indices.data_ptr()
    assert [name for name in vars(builder) if "treewy" in name] == []


def test_a_builders_staged_buffers_go_with_it():
    """The buffers are found by the builder's id: a builder made after another one went (which may get its id) gets
    buffers of its own, and nothing is kept for the one that went."""
    import gc

    builder, _ = _builder(full_graphs=True)
    buffers = counts_layer(builder).step_buffers
    first = buffers.staged(builder, 4)
    assert buffers.staged(builder, 4)[0] is first[0]  # the batch size's views, kept
    kwargs = {name: value for name, value in vars(builder).items() if name != "_stage_spec_decode"}  # (holds it)
    del builder
    gc.collect()
    assert buffers._staged == {}
    again = FakeBuilder(**kwargs)
    assert buffers.staged(again, 4)[0].data_ptr() != first[0].data_ptr()


def test_the_null_block_never_commits():
    """CUDA-graph capture batches put every row in the null block 0: none of them may commit there (they would all
    write the one slot at once), however often captures repeat."""
    builder, counts = _builder(full_graphs=True)
    for _ in range(2):
        capture = _build(builder, _spec_step([0, 0, 0], [4, 4, 4], [4, 4, 4]))
        assert capture.commit_nodes.tolist() == [-1, -1, -1]
    assert counts[0] == 0


def test_every_non_speculative_row_clears_its_slot():
    """A new owner's first step may be a one-token row that vLLM counts as a decode (no prefill in the batch): its
    slot's count is cleared too, so its first speculative step commits nothing of the previous owner."""
    builder, counts = _builder(full_graphs=False)
    _build(builder, _spec_step([3], [4], [1]))
    step = _spec_step([3], [4], [1])
    no_spec = GDNAttentionMetadata(
        num_prefills=0, num_prefill_tokens=0, num_decodes=1, num_decode_tokens=1, num_spec_decodes=0,
        num_spec_decode_tokens=0, num_actual_tokens=1, non_spec_state_indices_tensor=torch.tensor([3]),
    )
    _build(builder, no_spec)
    assert counts[3] == 0
    assert _build(builder, step).commit_nodes.tolist() == [-1]


def test_no_counts_before_the_kv_cache_is_bound():
    builder, _ = _builder(full_graphs=False)
    builder.vllm_config.compilation_config.static_forward_context["gdn.0"].kv_cache = (torch.empty(0),) * 2
    assert _build(builder, _spec_step([3], [4], [2])).commit_nodes.tolist() == [-1]


class _ScalarAssignments(TorchDispatchMode):
    """Records copies and index puts whose source is a fresh 0-dim tensor (not a view of one of the step's tensors):
    what `t[i] = 0` and `t[index] = 0` dispatch. On a CUDA tensor that value comes from the host, a blocking copy
    that waits for the device."""

    def __init__(self):
        super().__init__()
        self.found = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (torch.ops.aten.copy_.default, torch.ops.aten.index_put_.default, torch.ops.aten.index_put.default):
            source = args[1] if func is torch.ops.aten.copy_.default else args[2]
            if source.dim() == 0 and not source._is_view():
                self.found.append(func)
        return func(*args, **kwargs)


def test_the_builder_never_assigns_a_host_scalar():
    """The wrapped build runs every step outside the CUDA graphs, while the device may still run the previous step
    (vLLM's async scheduling): a host sync there idles the GPU for the rest of the step's preparation."""
    builder, counts = _builder(full_graphs=True)
    with _ScalarAssignments() as assignments:
        _build(builder, _spec_step([0, 0, 0], [4, 4, 4], [4, 4, 4]))  # a capture: null-block rows
        _build(builder, _spec_step([3], [4], [1], padding_rows=2))
        _build(builder, _mixed_step([3], [4], [2], prefill_slots=[5]))
    assert assignments.found == []


def test_tree_steps_commit_the_leaf_the_sampler_recorded_and_carry_the_tree():
    """Trees: vLLM's accepted count does not say which branch; the slot's count, rewritten after acceptance, does."""
    builder, counts = _builder(full_graphs=False, widths=[2, 1])  # nodes 0, 1 at depth 1; 2 under 0; 3 under 1
    first = _build(builder, _spec_step([3, 5], [5, 1], [1, 1]))  # slot 5: a decode without drafts
    # block parents: root -1, nodes 0 and 1 under the root (block 0), node 2 under block 1, node 3 under block 2
    assert first.parents.tolist() == [-1, 0, 0, 1, 2, -1]
    assert first.ancestors[4].tolist() == [4, 2, 0] and first.tree_ancestors.shape == (5, 3)
    # Slot 3 accepted node 1 then node 3 (block index 4); slot 5 verified only its root.
    accepted = SimpleNamespace(last_accepted_node=torch.tensor([3]))
    record_accepted_leaves(counts, torch.tensor([3]), accepted)
    second = _build(builder, _spec_step([3, 5], [5, 5], [3, 1]))
    assert second.commit_nodes.tolist() == [4, 0]  # not vLLM's accepted count - 1 (2): the recorded leaf


def test_tree_tables_of_a_node_are_derived_in_the_forward_from_the_staged_batch():
    """A FULL CUDA graph captures the GDN forward once and replays it on later batches staged into the builder's
    persistent buffers: the per-node tables (parents, ancestors) must be computed in the forward from those buffers,
    never built by the builder (outside the graph, into memory a replay would not see)."""
    builder, _ = _builder(full_graphs=True, widths=[2, 1])
    step = _spec_step([3, 5], [5, 5], [1, 1])
    metadata = _build(builder, step)
    assert "ancestors" not in metadata.__dict__ and "parents" not in metadata.__dict__
    assert "node_indices" not in metadata.__dict__
    # A replay's batch staged into the same buffer before the forward reads it: a root-only row, then a whole tree,
    # then 4 padding tokens (counted as the last request's nodes 5 .. 8, past its 5-row block).
    metadata.spec_query_start_loc.copy_(torch.tensor([0, 1, 6], dtype=torch.int32))
    assert metadata.parents.tolist()[:6] == [-1, -1, 0, 0, 1, 2]
    assert metadata.ancestors[5].tolist() == [4, 2, 0]
    assert metadata.ancestors.shape == (10, 3) and bool((metadata.ancestors[6:] < 5).all())
    again = _build(builder, step)
    assert again.tree_ancestors is metadata.tree_ancestors  # one table per group: a stable address


def test_vllms_own_builder_in_full_graph_mode_hands_the_kernels_flat_slots(tmp_path):
    """vLLM's GDN builder stages a FULL-graph decode batch in a [rows, 1 + k] buffer, broadcasting reconstruct's one
    block per request into it: its column 0 is strided. The kernels index slots flat, so the wrapped build must hand
    them a contiguous copy (on the H200 every request of a batch read the first request's slot before it did)."""
    from vllm.config import set_current_vllm_config
    from vllm.v1.attention.backend import CommonAttentionMetadata
    from vllm.v1.attention.backends.gdn_attn import GDNAttentionMetadataBuilder
    from vllm.v1.kv_cache_interface import MambaSpec

    from tests.plugin.test_config import engine_config
    from vllm_treewy.fixture import build_fixture
    from vllm_treewy.vllm_plugin import register

    register()
    k = 3
    config = engine_config(str(build_fixture(tmp_path / "fixture")),
                           {"method": "mtp", "num_speculative_tokens": k, "mamba_state_commit": "reconstruct"})
    counts = torch.zeros(NUM_SLOTS, 1, dtype=torch.int32)
    config.compilation_config.static_forward_context["gdn.0"] = FakeGDNLayer((None,) * 4 + (counts,))
    with set_current_vllm_config(config):
        spec = MambaSpec(block_size=512, shapes=((3, 64),), dtypes=(torch.bfloat16,), num_speculative_blocks=0)
        builder = GDNAttentionMetadataBuilder(spec, ["gdn.0"], config, torch.device("cpu"))
    builder.use_full_cuda_graph = True  # as on CUDA (the CPU platform turns CUDA graphs off)
    cu = torch.arange(4, dtype=torch.int32) * (1 + k)
    common = CommonAttentionMetadata(
        query_start_loc=cu, query_start_loc_cpu=cu.clone(), seq_lens=torch.tensor([20, 30, 40], dtype=torch.int32),
        num_reqs=3, num_actual_tokens=int(cu[-1]), max_query_len=1 + k, max_seq_len=40,
        block_table_tensor=torch.tensor([[7], [2], [5]], dtype=torch.int32),
        slot_mapping=torch.zeros(int(cu[-1]), dtype=torch.int64),
    )
    counts[[7, 2], 0] = torch.tensor([2, 4], dtype=torch.int32)  # accepted counts recorded after sampling; slot 5:
    # a request's first speculative step
    metadata = builder.build(0, common, num_accepted_tokens=torch.tensor([2, 4, 1], dtype=torch.int32),
                             num_decode_draft_tokens_cpu=torch.tensor([k, k, k], dtype=torch.int32))
    metadata.update_counts(counts_layer(builder))  # the first GDN layer's forward
    assert metadata.spec_state_indices_tensor.stride(0) == 1 + k  # vLLM's staged buffer, strided column 0
    assert metadata.state_indices.tolist() == [7, 2, 5] and metadata.state_indices.is_contiguous()
    assert metadata.state_indices.data_ptr() == staged_buffers(builder)[0].data_ptr()
    assert metadata.commit_nodes.tolist() == [1, 3, -1]


def test_the_wrapped_build_verifies_rows_longer_than_the_chain_as_the_tree():
    """The build's wrapper hands `DraftShape.verifies_tree` the speculative rows' tokens: a capture dummy's rows of
    1 + N tokens with draft counts of 0 launch the tree's verify (the chain's launch is sized for 1 + D a row)."""
    from vllm_treewy.vllm_plugin.gdn.step_metadata import _building_commit_nodes

    builder, _ = _builder(full_graphs=False, widths=[2, 1], threshold="auto")  # N = 4, depth 2
    for nodes, tree in (([5, 5], True), ([3, 3], False)):
        metadata = _spec_step([3, 5], nodes, [1, 1])
        build = _building_commit_nodes(lambda self, *args, **kwargs: metadata)
        built = build(builder, 0, None, None, num_decode_draft_tokens_cpu=torch.zeros(2, dtype=torch.int32))
        assert (built.tree_ancestors is not None) is tree and (built.verify_block_len is None) is tree


def test_a_chain_step_of_a_tree_threshold_verifies_a_chain_and_commits_through_both_shapes():
    """draft_tree_max_batch_size: a step verifies the tree where some row holds it (vLLM's per-row draft counts),
    else chains of the tree's depth (no tree table, the chain's length for the verify launch); both commit through
    the one table of both shapes, at one address."""
    from vllm_treewy.vllm_plugin.gdn.step_metadata import commit_ancestor_table

    builder, counts = _builder(full_graphs=True, widths=[2, 1], threshold=2)  # N = 4, depth 2
    config = builder.vllm_config.speculative_config
    shape = draft_shape_of(config)
    chain_drafts = torch.tensor([2, 1])
    chain = _build(builder, _spec_step([3, 5], [3, 2], [1, 1]), shape.verifies_tree(chain_drafts))
    assert chain.tree_ancestors is None and chain.ancestors is None and chain.verify_block_len == 3
    assert chain.parents.tolist() == [-1, 0, 1, -1, 0]
    assert torch.equal(chain.commit_ancestors, commit_ancestor_table(config.draft_tree, "cpu"))
    _sampled(counts, [3, 5], [1 + 4 + 3, 1 + 4 + 1])  # chain counts, offset by 1 + N: blocks 2 and 0
    tree = _build(builder, _spec_step([3, 5], [5, 5], [1, 1]), shape.verifies_tree(torch.tensor([4, 4])))
    assert tree.commit_nodes.tolist() == [7, 5]  # the commit table's chain rows 5 + 2 and 5 + 0
    assert tree.tree_ancestors.shape == (5, 3) and tree.verify_block_len is None
    assert tree.commit_ancestors is chain.commit_ancestors
    assert tree.commit_ancestors[7].tolist() == [2, 1, 0] and tree.commit_ancestors[5].tolist() == [0, -1, -1]
