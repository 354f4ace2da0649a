"""Model Runner V2's hooks (`vllm_plugin/v2/accepted_counts.py`), on vLLM's own GDN metadata builder where it matters:

- V2 builds the first GDN group's metadata and re-gathers each further group's state indices from it
  (`update_block_table`): every group still commits its own slots' pending nodes and keeps its own counts;
- chains commit from V2's own accepted counts (kept per request state, `num_accepted_tokens`) where their slot has a
  verify pending: nothing is recorded after sampling, and the commit nodes are those the recorded counts gave, also
  for a request that a step left out;
- a chain step of a tree config (`draft_tree_max_batch_size`) records its sampled counts after sampling, through V2's
  `idx_mapping` (batch row -> request state, whose block-table row V2 keeps for the request's life);
- draft trees run on V2 too (its feature check lists nothing for them, `tests/plugin/test_config.py`; their hooks are
  `v2.runner`'s, `tests/plugin/v2/test_runner.py`).

vLLM's CPU backend runs V1 (`tests/e2e/test_v2_chains_cpu.py` forces V2 on, interpreted, end to end); these tests run
V2's pieces with vLLM's CPU-importable modules and a stand-in runner holding what the hooks read."""

from types import SimpleNamespace

import pytest
import torch
from vllm.v1.kv_cache_interface import MambaSpec

from tests.plugin.gdn.test_step_metadata import FakeGDNLayer, staged_buffers
from vllm_treewy.kernels.bookkeeping import dispatch
from vllm_treewy.vllm_plugin.config import DraftShape, draft_shape_of
from vllm_treewy.vllm_plugin.gdn.step_metadata import uses_runner_accepted_counts
from vllm_treewy.vllm_plugin.v2 import accepted_counts as v2_accepted_counts
from vllm_treewy.vllm_plugin.patch_points import GDN_METADATA_UPDATE_BLOCK_TABLE

K, NUM_SLOTS, MAX_REQS = 3, 10, 6
LAYERS = ("gdn.0", "gdn.1")  # the first layer of each of two GDN groups


@pytest.fixture(autouse=True, params=["torch", "triton"])
def count_updates(request, monkeypatch):
    """Every test on both paths: the torch ops (CPU) and the one-launch kernels (CUDA; here the interpreter)."""
    monkeypatch.setattr(dispatch, "launches_triton", lambda counts: request.param == "triton")
    return request.param


@pytest.fixture(scope="module")
def v2_setup(tmp_path_factory):
    """vLLM's GDN builders of two groups (FULL graphs on, as on CUDA), their layers' count states (strided, as in
    the KV-cache pages), and a stand-in V2 runner: block tables per request state, KV-cache groups, layers."""
    from vllm.config import set_current_vllm_config
    from vllm.v1.attention.backends.gdn_attn import GDNAttentionMetadataBuilder

    from tests.plugin.test_config import engine_config
    from vllm_treewy.fixture import build_fixture
    from vllm_treewy.vllm_plugin import register

    register()
    config = engine_config(str(build_fixture(tmp_path_factory.mktemp("fixture"))),
                           {"method": "mtp", "num_speculative_tokens": K, "mamba_state_commit": "reconstruct"})
    spec = MambaSpec(block_size=512, shapes=((3, 64),), dtypes=(torch.bfloat16,), num_speculative_blocks=0)
    layers, builders = {"attn.0": SimpleNamespace()}, []
    for name in LAYERS:
        # a reconstruct chain on V2 without prefix caching: its count update commits from V2's accepted counts
        layers[name] = FakeGDNLayer((None,) * 4 + (torch.zeros(NUM_SLOTS, 3, dtype=torch.int32)[:, 2:],),
                                    runner_accepted_counts=True, prefix=name)
    config.compilation_config.static_forward_context.update(layers)
    with set_current_vllm_config(config):
        for name in LAYERS:
            builder = GDNAttentionMetadataBuilder(spec, [name], config, torch.device("cpu"))
            builder.use_full_cuda_graph = True  # as on CUDA (the CPU platform turns CUDA graphs off)
            builders.append(builder)
    groups = [SimpleNamespace(kv_cache_spec=object(), layer_names=["attn.0"])]
    groups += [SimpleNamespace(kv_cache_spec=spec, layer_names=[name]) for name in LAYERS]
    # a GDN group's row under reconstruct: one block per request (V2 sizes the rows by the spec's blocks)
    tables = [torch.zeros(MAX_REQS, width, dtype=torch.int32) for width in (8, 1, 1)]
    runner = SimpleNamespace(
        speculative_config=config.speculative_config, compilation_config=config.compilation_config,
        cache_config=SimpleNamespace(mamba_cache_mode="none"),  # align mode: tests/plugin/v2/test_prefix_caching.py
        kv_cache_config=SimpleNamespace(kv_cache_groups=groups),
        block_tables=SimpleNamespace(block_tables=[SimpleNamespace(gpu=t) for t in tables]),
        # V2's accepted count per request state (`MambaHybridModelState.num_accepted_tokens_gpu`: 1 when added)
        accepted_by_state=torch.ones(MAX_REQS, dtype=torch.int32),
    )
    return builders, runner


def _counts(runner, name):
    return runner.compilation_config.static_forward_context[name].verified_node_counts()


def _set_requests(runner, slots_per_group: dict[int, list[int]]):
    """Request states 0.. hold these slots in GDN groups 1 and 2 (their block tables' column 0)."""
    for group, slots in slots_per_group.items():
        runner.block_tables.block_tables[group].gpu[: len(slots), 0] = torch.tensor(slots, dtype=torch.int32)


def _common(block_table, query_lens, seq_lens, prefilling=None):
    from vllm.v1.attention.backend import CommonAttentionMetadata

    cu = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    return CommonAttentionMetadata(
        query_start_loc=cu, query_start_loc_cpu=cu.clone(), seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        seq_lens_cpu_upper_bound=torch.tensor(seq_lens, dtype=torch.int32),
        num_reqs=len(query_lens), num_actual_tokens=int(cu[-1]), max_query_len=max(query_lens),
        max_seq_len=max(seq_lens), block_table_tensor=block_table, slot_mapping=torch.zeros(int(cu[-1]),
                                                                                              dtype=torch.int64),
        is_prefilling=None if prefilling is None else torch.tensor(prefilling),
    )


def _step(builders, runner, idx_mapping, query_lens, seq_lens, drafts):
    """One V2 step's metadata: group 1 built, group 2 re-gathered from it (V2's `build_attn_metadata`), each
    group's count update run as its first layer's forward runs it. `drafts`: V2's num_decode_draft_tokens (-1:
    not a speculative row), or None for a batch without speculation; the rows' accepted counts are V2's, gathered
    by request state (`MambaHybridModelState.prepare_attn`)."""
    update_block_table = v2_accepted_counts._regathering_commit_nodes(GDN_METADATA_UPDATE_BLOCK_TABLE.original())
    rows = torch.tensor(idx_mapping)
    tables = [runner.block_tables.block_tables[g].gpu[rows] for g in (1, 2)]  # V2's gathered input block tables
    common = _common(tables[0], query_lens, seq_lens, None if drafts is not None else [True] * len(query_lens))
    kwargs = {} if drafts is None else dict(num_accepted_tokens=runner.accepted_by_state[rows],
                                            num_decode_draft_tokens_cpu=torch.tensor(drafts, dtype=torch.int32))
    first = builders[0].build(0, common, **kwargs)
    second = update_block_table(builders[1], first, tables[1], common.slot_mapping)
    for metadata, name in zip((first, second), LAYERS):
        metadata.update_counts(runner.compilation_config.static_forward_context[name])
    return first, second


def _v2_postprocess_sampled(runner, idx_mapping, sampled_tokens, num_sampled, num_rejected):
    """What V2's own `postprocess_sampled` does with the counts (`MambaHybridModelState.postprocess_state`): each
    request state's accepted count, max(num_sampled, 1), rows marked -1 skipped."""
    for row, state in enumerate(idx_mapping.tolist()):
        if state >= 0:
            runner.accepted_by_state[state] = max(int(num_sampled[row]), 1)


def _sample(runner, idx_mapping, num_sampled):
    postprocess = v2_accepted_counts._recording_sampled_counts(_v2_postprocess_sampled)
    postprocess(runner, torch.tensor(idx_mapping), None, torch.tensor(num_sampled, dtype=torch.int32), None)


def test_v2_chains_without_prefix_caching_commit_from_v2s_accepted_counts():
    config = SimpleNamespace(use_v2_model_runner=True, cache_config=SimpleNamespace(mamba_cache_mode="none"))
    assert uses_runner_accepted_counts(config, DraftShape(None))
    assert not uses_runner_accepted_counts(SimpleNamespace(**{**vars(config), "use_v2_model_runner": False}),
                                           DraftShape(None))  # V1 records its counts after sampling
    assert not uses_runner_accepted_counts(config, DraftShape(object()))  # trees: the accepted leaf, not a count
    align = SimpleNamespace(use_v2_model_runner=True, cache_config=SimpleNamespace(mamba_cache_mode="align"))
    assert not uses_runner_accepted_counts(align, DraftShape(None))  # the slot moves; V2's counts stay 1


def test_each_gdn_group_commits_its_own_slots_when_v2_regathers_its_metadata(v2_setup):
    builders, runner = v2_setup
    _set_requests(runner, {1: [7, 2, 5], 2: [3, 6, 1]})
    for name, pending in zip(LAYERS, ({7: 1 + K, 2: 1 + K}, {3: 1 + K, 6: 2})):  # node counts of the last verify
        counts = _counts(runner, name)
        counts.zero_()
        for slot, count in pending.items():
            counts[slot] = count
    runner.accepted_by_state[:3] = torch.tensor([2, 4, 3], dtype=torch.int32)  # V2's, after that step's sampling
    first, second = _step(builders, runner, [0, 1, 2], [1 + K] * 3, [20, 30, 40], [K] * 3)
    # request 2's slots have nothing pending (a new request): no commit, whatever V2's count says
    assert first.state_indices.tolist() == [7, 2, 5] and first.commit_nodes.tolist() == [1, 3, -1]
    # the slot's pending node count bounds the commit (a count above it would be no node of the verified block)
    assert second.state_indices.tolist() == [3, 6, 1] and second.commit_nodes.tolist() == [1, 1, -1]
    # each group's FULL-graph buffers are its own builder's (a graph replays them at a fixed address)
    staged = staged_buffers(builders[1])[0]
    assert second.state_indices.data_ptr() == staged.data_ptr() != first.state_indices.data_ptr()
    assert second.spec_state_indices_tensor.data_ptr() == builders[1].spec_state_indices_tensor.data_ptr()
    assert second.counts_layer == "gdn.1" and first.counts_layer == "gdn.0"
    # the step's counts: every speculative row's node count in its own group's slots
    for name, slots in zip(LAYERS, ([7, 2, 5], [3, 6, 1])):
        assert _counts(runner, name)[slots].tolist() == [1 + K] * 3


def test_the_next_step_commits_v2s_accepted_counts_and_nothing_is_recorded_after_sampling(v2_setup):
    builders, runner = v2_setup
    _set_requests(runner, {1: [4, 8, 9, 3], 2: [5, 2, 7, 9]})
    for name in LAYERS:
        _counts(runner, name).zero_()
    runner.accepted_by_state.fill_(1)
    # step 1: request states 2 and 0 speculate (batch rows 0, 1), state 3 prefills its last chunk (row 2)
    _step(builders, runner, [2, 0, 3], [1 + K, 1 + K, 7], [30, 20, 7], [K, K, -1])
    assert _counts(runner, "gdn.0")[[9, 4, 3]].tolist() == [1 + K, 1 + K, 0]
    _sample(runner, [2, 0, 3], [3, 1, 1])  # row 0 accepted 2 drafts, row 1 none; the prefill sampled its first token
    assert _counts(runner, "gdn.0")[[9, 4, 3]].tolist() == [1 + K, 1 + K, 0]  # nothing of ours ran
    assert _counts(runner, "gdn.1")[[7, 5, 9]].tolist() == [1 + K, 1 + K, 0]
    # step 2: state 0 is left out (its token budget spent), state 2 and 3 speculate in other batch rows
    first, second = _step(builders, runner, [3, 2], [1 + K, 1 + K], [8, 33], [K, K])
    assert first.commit_nodes.tolist() == [-1, 2] and second.commit_nodes.tolist() == [-1, 2]
    _sample(runner, [3, 2, -1], [4, 2, 5])  # V2 marks a row to skip with -1
    # step 3: state 0 is back and commits the node step 1 accepted for it
    first, second = _step(builders, runner, [0, 2, 3], [1 + K] * 3, [24, 35, 12], [K, K, K])
    assert first.commit_nodes.tolist() == [0, 1, 3] and second.commit_nodes.tolist() == [0, 1, 3]


def test_v2_refuses_chain_layers_built_to_commit_from_recorded_counts(v2_setup, monkeypatch):
    """Layers built for the V1 runner (their count update reads counts recorded after sampling, which V2's hook does
    not record) would commit stale nodes: the hook says so instead."""
    builders, runner = v2_setup
    for name in LAYERS:
        monkeypatch.setattr(runner.compilation_config.static_forward_context[name].step_buffers,
                            "runner_accepted_counts", False)
    with pytest.raises(RuntimeError, match="built for another runner"):
        _sample(runner, [0], [2])


def test_a_batch_without_speculation_clears_every_groups_slots_in_the_builder(v2_setup):
    """Prefills take slots that finished requests left with a pending count: each group's count update runs in
    its builder (no speculative layer forward runs it), the re-gathered group's too."""
    builders, runner = v2_setup
    _set_requests(runner, {1: [6, 1], 2: [8, 4]})
    for name in LAYERS:
        _counts(runner, name).fill_(3)
    first, second = _step(builders, runner, [0, 1], [9, 5], [9, 5], None)
    assert first.counts_layer is None and second.counts_layer is None
    assert _counts(runner, "gdn.0")[[6, 1]].tolist() == [0, 0] and _counts(runner, "gdn.1")[[8, 4]].tolist() == [0, 0]
    _sample(runner, [0, 1], [1, 1])  # their first tokens: no slot holds a count, none is recorded
    assert _counts(runner, "gdn.0")[[6, 1]].tolist() == [0, 0] and _counts(runner, "gdn.1")[[8, 4]].tolist() == [0, 0]


def _with_config(monkeypatch, runner, speculative_config) -> None:
    """The runner's speculative config, and its draft shape and commit source in every GDN layer's step buffers (as
    each layer reads them at its construction, on V2 without prefix caching)."""
    monkeypatch.setattr(runner, "speculative_config", speculative_config)
    shape = draft_shape_of(speculative_config)
    v2 = SimpleNamespace(use_v2_model_runner=True, cache_config=runner.cache_config)
    for name in LAYERS:
        buffers = runner.compilation_config.static_forward_context[name].step_buffers
        monkeypatch.setattr(buffers, "shape", shape)
        monkeypatch.setattr(buffers, "runner_accepted_counts", uses_runner_accepted_counts(v2, shape))


def test_store_all_and_trees_leave_the_v2_hooks_alone(v2_setup, monkeypatch):
    builders, runner = v2_setup
    _set_requests(runner, {1: [2], 2: [3]})
    for name in LAYERS:
        _counts(runner, name).fill_(4)
    for config in (SimpleNamespace(mamba_state_commit="store_all"),
                   SimpleNamespace(mamba_state_commit="reconstruct", is_draft_tree=True, draft_tree=object())):
        _with_config(monkeypatch, runner, config)
        _sample(runner, [0], [2])
        assert _counts(runner, "gdn.0")[2] == 4 and _counts(runner, "gdn.1")[3] == 4


def test_a_chain_step_of_a_tree_threshold_records_its_counts_past_the_trees(v2_setup, monkeypatch):
    """draft_tree_max_batch_size: after a chain step (no tree acceptance handed to the drafter) the sampled counts
    go in offset by 1 + N (the commit table's chain rows); after a tree step they are the tree sampler's."""
    from vllm_treewy.tree import DraftTree

    builders, runner = v2_setup
    tree = DraftTree.from_widths([2, 2, 1])
    _with_config(monkeypatch, runner, SimpleNamespace(
        mamba_state_commit="reconstruct", is_draft_tree=True, draft_tree=tree, draft_tree_max_batch_size=2))
    state = SimpleNamespace(accepted=None)
    monkeypatch.setattr(runner, "speculator", SimpleNamespace(tree_state=state), raising=False)
    _set_requests(runner, {1: [2, 6, 8], 2: [3, 5, 7]})
    for name in LAYERS:
        counts = _counts(runner, name)
        counts.zero_()
    _counts(runner, "gdn.0")[[2, 6]] = 4  # the step's provisional counts: rows 0 and 1 verified a chain of 3
    _counts(runner, "gdn.1")[[3, 5]] = 4
    _sample(runner, [0, 1, 2], [3, 0, 1])  # row 1: a prompt tail run as a decode, nothing sampled (its root)
    assert _counts(runner, "gdn.0")[[2, 6, 8]].tolist() == [14, 12, 0]
    assert _counts(runner, "gdn.1")[[3, 5, 7]].tolist() == [14, 12, 0]
    state.accepted = object()  # a tree step: its leaves were recorded by the tree sampler
    _sample(runner, [0, 1, 2], [2, 2, 2])
    assert _counts(runner, "gdn.0")[[2, 6, 8]].tolist() == [14, 12, 0]
