"""Reconstruct with prefix caching of GDN states (align mode) on Model Runner V2 (`gdn.prefix_caching`'s V2 hooks):

- right after sampling (`postprocess_sampled`), every GDN layer's counts and block-boundary states are V1's
  (`record_accepted_and_boundaries_torch` on the batch's rows) for V2's batch: rows reach their request's block-table
  row through `idx_mapping`, the step's seq lens come from V2's persistent input buffer, the drafts from the first
  group's slot counts, the accepted counts from V2's `num_sampled`; the running slot is the request's column
  (seq_len - 1) // block_size, not column 0 (where the no-prefix-caching hook would write);
- V2's `postprocess_state` keeps its accepted counts at 1 and skips store_all's boundary copy under reconstruct (its
  pre-copy then migrates at offset 0), and runs as it is otherwise;
- V2's `initialize_kv_cache` builds its fused pre-copy's state table with the pseudo-value buffer's three states
  after the conv and SSM states: whole-block copies of the buffer's views.

V2 does not run on vLLM's CPU backend (nor do its Triton kernels there); these tests run vLLM's own model-state code
where it is plain torch (its state table) and stand-ins for the runner and the model state elsewhere."""

from __future__ import annotations

from math import prod
from types import SimpleNamespace

import pytest
import torch
from vllm.model_executor.layers.mamba.mamba_utils import get_conv_copy_spec
from vllm.v1.kv_cache_interface import MambaSpec
from vllm.v1.worker.gpu.model_states.mamba_hybrid import MambaHybridModelState

from vllm_treewy.kernels.bookkeeping.boundary_states_torch import BoundaryLayer, record_accepted_and_boundaries_torch
from vllm_treewy.kernels.gdn_step_torch import committed_states
from vllm_treewy.kernels.bookkeeping import dispatch
from vllm_treewy.tree import DraftTree
from vllm_treewy.vllm_plugin.config import DraftShape, draft_shape_of
from vllm_treewy.vllm_plugin.gdn import prefix_caching
from vllm_treewy.vllm_plugin.v2 import accepted_counts as v2_accepted_counts
from vllm_treewy.vllm_plugin.gdn.layer import ReconstructGatedDeltaNetAttention
from vllm_treewy.vllm_plugin.patch_points import MAMBA_TEMPORAL_COPY_SPEC, V2_MAMBA_INITIALIZE_KV_CACHE
from vllm_treewy.vllm_plugin.gdn.pseudo_value_buffer import BufferLayout, GDNPage
from vllm_treewy.vllm_plugin.gdn.sampling_tables import SamplingTables
from vllm_treewy.vllm_plugin.gdn.step_metadata import GroupStepBuffers, commit_ancestor_table
from vllm_treewy.vllm_plugin.v2 import prefix_caching as v2_prefix_caching

NULL_BLOCK = 0  # vLLM's NULL_BLOCK_ID
HK, HV, K, V, K_SPEC = 1, 2, 16, 8, 3
CONV_DIM = 2 * HK * K + HV * V
WIDTH_1 = 3  # conv width 4
BLOCK_SIZE = 4
NUM_SLOTS, MAX_REQS, COLUMNS = 40, 6, 5
RECONSTRUCT = SimpleNamespace(mamba_state_commit="reconstruct")


def _page_states(num_slots: int, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    """A GDN layer's `kv_cache` as `ReconstructGatedDeltaNetAttention.bind_kv_cache` binds it: vLLM's conv state
    `[S, w - 1 + k, D]` (dim last) and SSM state `[S, HV, V, K]`, then the buffer's factors, conv inputs and count,
    all views into one raw page per slot (random bytes as values: small floats, counts set by the tests)."""
    layout = BufferLayout.of_model(1, HK, HV, K, V, K_SPEC)
    shapes = ((WIDTH_1 + K_SPEC, CONV_DIM), (HV, V, K), *layout.shapes())
    dtypes = (torch.bfloat16, torch.float32, *BufferLayout.dtypes(torch.bfloat16))
    sizes = [prod(shape) * torch.empty(0, dtype=dtype).element_size() for shape, dtype in zip(shapes, dtypes)]
    pages = torch.zeros(num_slots, sum(sizes) + 8, dtype=torch.int8)  # a padded page, as vLLM's may be
    views, offset = [], 0
    for shape, dtype, size in zip(shapes, dtypes, sizes):
        view = pages[:, offset: offset + size].view(dtype).view(-1, *shape)
        view.copy_(torch.randint(0, 5, view.shape, generator=gen) if dtype == torch.int32
                   else torch.randn(view.shape, generator=gen) * 0.3)
        views.append(view)
        offset += size
    return tuple(views)


class PageLayer:
    """A reconstruct GDN layer as the runner's hooks see it: its page states and the views it hands out (the
    layer's own count view)."""

    reconstructs_state = keeps_slot_counts = True
    verified_node_counts = ReconstructGatedDeltaNetAttention.verified_node_counts

    def __init__(self, kv_cache):
        self.kv_cache = kv_cache
        self.sampling_tables = SamplingTables()
        self.step_buffers = GroupStepBuffers(DraftShape(None))  # a chain config's; `_with_config` sets another

    def ssm_state(self):
        return GDNPage.of(self.kv_cache).ssm_state

    def conv_history(self):
        return GDNPage.of(self.kv_cache).conv_state.transpose(-1, -2)[:, :, :WIDTH_1]

    def pseudo_value_buffer(self):
        page = GDNPage.of(self.kv_cache)
        return SimpleNamespace(factors=page.factors, conv_inputs=page.conv_inputs)


def _v2_runner(layers_per_group: tuple[int, ...], gen: torch.Generator, seq_lens: list[int]):
    """A stand-in V2 runner in align mode: an attention group, then GDN groups of PageLayers (their own pages),
    block tables per request state (random distinct real blocks per group), the step's seq lens in V2's persistent
    input buffer (stale values after the batch's rows)."""
    spec = MambaSpec(block_size=BLOCK_SIZE, shapes=((1,),), dtypes=(torch.float32,), mamba_cache_mode="align")
    layers, groups, tables = {}, [SimpleNamespace(kv_cache_spec=object(), layer_names=["attn.0"])], []
    tables.append(torch.zeros(MAX_REQS, 8, dtype=torch.int32))
    for g, count in enumerate(layers_per_group):
        names = [f"gdn.{g}.{i}" for i in range(count)]
        for name in names:
            layers[name] = PageLayer(_page_states(NUM_SLOTS, gen))
        groups.append(SimpleNamespace(kv_cache_spec=spec, layer_names=names))
        blocks = torch.randperm(NUM_SLOTS - 1, generator=gen)[: MAX_REQS * COLUMNS] + 1
        tables.append(blocks.view(MAX_REQS, COLUMNS).to(torch.int32).contiguous())
    buffer = torch.randint(1, 4 * BLOCK_SIZE, (MAX_REQS + 2,), dtype=torch.int32, generator=gen)
    buffer[: len(seq_lens)] = torch.tensor(seq_lens, dtype=torch.int32)
    return SimpleNamespace(
        speculative_config=RECONSTRUCT, cache_config=SimpleNamespace(mamba_cache_mode="align"),
        compilation_config=SimpleNamespace(static_forward_context=layers),
        kv_cache_config=SimpleNamespace(kv_cache_groups=groups),
        block_tables=SimpleNamespace(block_tables=[SimpleNamespace(gpu=t) for t in tables]),
        input_buffers=SimpleNamespace(seq_lens=buffer),
    )


def _gdn_layers(runner):
    """(group id, layer) of every GDN layer, in group order."""
    context = runner.compilation_config.static_forward_context
    return [(g, context[name]) for g, group in enumerate(runner.kv_cache_config.kv_cache_groups)
            for name in group.layer_names if name.startswith("gdn")]


def _set_step_counts(runner, idx_mapping, seq_lens, drafts):
    """The step's count update as the forward left it, in every group's first layer: each speculative row's node
    count (1 + drafts) in its slot, 0 in every other row's."""
    for group_id, group in enumerate(runner.kv_cache_config.kv_cache_groups):
        if not group.layer_names[0].startswith("gdn"):
            continue
        counts = runner.compilation_config.static_forward_context[group.layer_names[0]].verified_node_counts()
        table = runner.block_tables.block_tables[group_id].gpu
        for request, seq_len, draft in zip(idx_mapping, seq_lens, drafts):
            if request >= 0:
                counts[table[request, (seq_len - 1) // BLOCK_SIZE]] = draft + 1


def _sample(runner, idx_mapping, num_sampled):
    postprocess = v2_accepted_counts._recording_sampled_counts(lambda *args, **kwargs: None)
    postprocess(runner, torch.tensor(idx_mapping), None, torch.tensor(num_sampled, dtype=torch.int32), None)


def _snapshot(runner):
    return [tuple(t.clone() for t in layer.kv_cache) for _, layer in _gdn_layers(runner)]


def _v1_expectation(runner, before, idx_mapping, seq_lens, drafts, num_sampled):
    """What V1's writer makes of the same step: its batch-row block tables (the requests' rows, a null row for a
    skipped one), its per-row drafts (-1: not speculative or skipped), accepted = max(num_sampled, 1)."""
    rows = torch.tensor([max(r, 0) for r in idx_mapping])
    skipped = torch.tensor([r < 0 for r in idx_mapping])
    views = []
    for (group_id, layer), states in zip(_gdn_layers(runner), before):
        page = GDNPage.of(tuple(t.clone() for t in states))
        table = runner.block_tables.block_tables[group_id].gpu[rows].masked_fill(skipped[:, None], NULL_BLOCK)
        views.append(BoundaryLayer(page.ssm_state, page.factors, page.conv_state.transpose(-1, -2)[:, :, :WIDTH_1],
                                   page.conv_inputs, page.counts.view(-1), table))
    drafts = torch.tensor([d if r >= 0 else -1 for r, d in zip(idx_mapping, drafts)], dtype=torch.int32)
    accepted = torch.tensor(num_sampled, dtype=torch.int32).clamp(min=1)
    record_accepted_and_boundaries_torch(views, torch.tensor(seq_lens, dtype=torch.int32), drafts, accepted,
                                         len(idx_mapping), block_size=BLOCK_SIZE, null_block=NULL_BLOCK)
    return views


@pytest.mark.parametrize("path", ["torch", "triton"])
@pytest.mark.parametrize("seed", range(3))
def test_v2_writes_what_v1_writes_for_the_same_step(path, seed, monkeypatch):
    """A batch in V2's order (request states out of order, one skipped row): speculative rows whose accepted tokens
    reach a boundary at the root, inside the drafts, in place (a whole block accepted), not at all; a zero-draft
    decode; a prompt chunk (no count in its slot); the Triton path (interpreter) and the torch twin both equal V1's
    writer on V1's batch rows, in every layer of both groups."""
    monkeypatch.setattr(dispatch, "launches_triton", lambda counts: path == "triton")
    gen = torch.Generator().manual_seed(seed)
    idx_mapping = [4, 1, 3, 0, -1, 5, 2]
    # block size 4; per row (tokens through the root, reached): (8, 8) the root ends a block (node 0, the previous
    # column); (7, 9) node 1; (9, 12) all 4 accepted, the running block's end (in place); (7, 7) zero drafts, no
    # boundary; skipped; a prompt chunk; (10, 11) no boundary
    seq_lens = [11, 10, 12, 7, 9, 8, 13]
    drafts = [3, 3, 3, 0, 3, -1, 3]
    num_sampled = [1, 3, 4, 1, 2, 1, 2]
    runner = _v2_runner((2, 1), gen, seq_lens)
    _set_step_counts(runner, idx_mapping, seq_lens, drafts)
    before = _snapshot(runner)
    expected = _v1_expectation(runner, before, idx_mapping, seq_lens, drafts, num_sampled)
    _sample(runner, idx_mapping, num_sampled)
    changed = False
    for (_, layer), view, old in zip(_gdn_layers(runner), expected, before):
        page = GDNPage.of(layer.kv_cache)
        assert torch.equal(page.counts.view(-1), view.counts)
        if path == "torch":
            assert torch.equal(page.ssm_state, view.state)
        else:  # the kernel sums the commit's terms in the state pass's order
            torch.testing.assert_close(page.ssm_state, view.state, rtol=1e-5, atol=1e-6)
        assert torch.equal(page.conv_state.transpose(-1, -2)[:, :, :WIDTH_1], view.conv_history)
        assert torch.equal(page.conv_state[:, WIDTH_1:], old[0][:, WIDTH_1:])  # the drafts' columns: vLLM's
        assert torch.equal(page.factors, old[2]) and torch.equal(page.conv_inputs, old[3])
        changed |= not torch.equal(page.ssm_state, old[1])
    assert changed  # the batch reaches boundaries


def test_v2_boundary_semantics_by_hand():
    """Block size 4, request state 2 in batch row 0 verifying its root (token 3) and 3 drafts (seq_len 6), 2
    accepted: the boundary after token 4 is node 1, column 0's block gets the state and conv window after node 1
    (count 0), the running slot (column 1) keeps the accepted count 2 and its own state. Request state 0 in row 1
    prefilled (no count in its slot): nothing written. Column 0 of a request whose running column is 1 is not its
    slot: the no-prefix-caching hook's column would have been the boundary block."""
    gen = torch.Generator().manual_seed(7)
    runner = _v2_runner((1,), gen, [6, 5])
    _set_step_counts(runner, [2, 0], [6, 5], [3, -1])
    (_, layer), = _gdn_layers(runner)
    table = runner.block_tables.block_tables[1].gpu
    slot, dest, prefill_slot = int(table[2, 1]), int(table[2, 0]), int(table[0, 1])
    before = GDNPage.of(tuple(t.clone() for t in layer.kv_cache))
    _sample(runner, [2, 0], [2, 1])
    page = GDNPage.of(layer.kv_cache)
    assert page.counts.view(-1)[[slot, dest, prefill_slot]].tolist() == [2, 0, 0]
    expected = committed_states(before.ssm_state, torch.tensor([slot]), before.factors, torch.tensor([1]))
    assert torch.equal(page.ssm_state[dest], expected[0].to(page.ssm_state.dtype))
    history = before.conv_state.transpose(-1, -2)[slot, :, :WIDTH_1]
    window = torch.cat([history, before.conv_inputs[slot, :2].T], dim=1)[:, -WIDTH_1:]
    assert torch.equal(page.conv_state.transpose(-1, -2)[dest, :, :WIDTH_1], window)
    assert torch.equal(page.ssm_state[slot], before.ssm_state[slot])
    unchanged = [s for s in range(NUM_SLOTS) if s != dest]
    assert torch.equal(page.ssm_state[unchanged], before.ssm_state[unchanged])
    assert torch.equal(page.conv_state[unchanged], before.conv_state[unchanged])


def test_without_prefix_caching_v2_chains_write_nothing_after_sampling(monkeypatch):
    """Without align mode a chain's count stays the step's node count (a verify is pending) and no state is
    written: the next step commits from V2's own accepted counts (`tests/plugin/v2/test_accepted_counts.py`)."""
    gen = torch.Generator().manual_seed(3)
    runner = _v2_runner((1,), gen, [4, 4])
    runner.cache_config = SimpleNamespace(mamba_cache_mode="none")
    (_, layer), = _gdn_layers(runner)
    table = runner.block_tables.block_tables[1].gpu
    counts = layer.verified_node_counts()
    counts.zero_()
    counts[table[[1, 0], 0]] = 4
    before = _snapshot(runner)
    # layers built for another commit source (recorded counts) are refused, not silently left uncommitted
    with pytest.raises(RuntimeError, match="commit from V2's accepted counts"):
        _sample(runner, [1, 0], [3, 2])
    layer.step_buffers.runner_accepted_counts = True  # as V2 without prefix caching builds them
    _sample(runner, [1, 0], [3, 2])
    assert counts[table[[1, 0], 0]].tolist() == [4, 4]
    assert all(torch.equal(state, kept) for state, kept in zip(layer.kv_cache, before[0]))  # the whole page


class _ModelState(SimpleNamespace):
    """V2's MambaHybridModelState as its hooks see it (the method they call, as vLLM defines it)."""

    _get_mamba_group_info = MambaHybridModelState._get_mamba_group_info


def _calls(record):
    def original(self, *args):
        record.append(args)
        return "original"

    return original


@pytest.mark.parametrize("align", [True, False])
@pytest.mark.parametrize("commit", ["reconstruct", "store_all"])
def test_v2_postprocess_state_keeps_accepted_counts_at_one_under_reconstruct(align, commit):
    calls = []
    postprocess_state = v2_prefix_caching._v2_keeping_offset_zero(_calls(calls))
    state = _ModelState(_align_mode=align, vllm_config=SimpleNamespace(
        speculative_config=SimpleNamespace(mamba_state_commit=commit)))
    idx_mapping, num_sampled, computed = torch.tensor([1, 0]), torch.tensor([3, 1]), torch.tensor([9, 5])
    result = postprocess_state(state, idx_mapping, num_sampled, computed)
    if align and commit == "reconstruct":
        assert result is None and calls == []
    else:
        assert result == "original" and calls == [(idx_mapping, num_sampled, computed)]


def _model_state(commit: str, layers: dict, recoverssm=None):
    class Model:
        @staticmethod
        def get_mamba_state_copy_funcs(mamba_types):
            # the GDN models' own: conv, then SSM as a whole block (`get_mamba_state_copy_func`)
            return {mamba_type: (get_conv_copy_spec, MAMBA_TEMPORAL_COPY_SPEC.resolve()) for mamba_type in mamba_types}

    return _ModelState(
        _align_mode=True, _mamba_state_copy_funcs=None, _mamba_ctx=None, _mamba_group_ids=[], _mamba_spec=None,
        recoverssm=recoverssm, model=Model(), max_num_reqs=MAX_REQS, device=torch.device("cpu"),
        vllm_config=SimpleNamespace(speculative_config=SimpleNamespace(mamba_state_commit=commit),
                                    compilation_config=SimpleNamespace(static_forward_context=layers)),
    )


def _align_kv_cache_config(names):
    from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum

    spec = MambaSpec(block_size=BLOCK_SIZE, shapes=((WIDTH_1 + K_SPEC, CONV_DIM), (HV, V, K),
                                                   *BufferLayout.of_model(1, HK, HV, K, V, K_SPEC).shapes()),
                     dtypes=(torch.bfloat16, torch.float32, *BufferLayout.dtypes(torch.bfloat16)),
                     mamba_type=MambaAttentionBackendEnum.GDN_ATTN, mamba_cache_mode="align")
    return SimpleNamespace(kv_cache_groups=[SimpleNamespace(kv_cache_spec=spec, layer_names=list(names))])


def test_v2_pre_copy_state_table_carries_the_buffer_at_offset_zero():
    """vLLM's own initialize_kv_cache (its state table is plain torch) under the hook: per layer its conv and SSM
    states, then the buffer's factors, conv inputs and count as whole-block (temporal) copies, each entry naming the
    view's base, block stride and block size, so that V2's fused pre-copy moves the whole pending commit with the
    slot. A second call (the real KV cache after profiling) keeps the functions; store_all keeps the model's."""
    gen = torch.Generator().manual_seed(1)
    layers = {f"gdn.{i}": PageLayer(_page_states(NUM_SLOTS, gen)) for i in range(2)}
    config = _align_kv_cache_config(layers)
    tables = [torch.zeros(MAX_REQS, COLUMNS, dtype=torch.int32)]
    block_tables = SimpleNamespace(block_tables=[SimpleNamespace(gpu=tables[0])], input_block_tables=tables)
    initialize = v2_prefix_caching._v2_copying_pseudo_value_buffer(V2_MAMBA_INITIALIZE_KV_CACHE.original())
    state = _model_state("reconstruct", layers)
    initialize(state, config, block_tables)
    funcs = state._mamba_state_copy_funcs
    ((_, per_type),) = funcs.items()
    temporal = MAMBA_TEMPORAL_COPY_SPEC.resolve()
    assert per_type == (get_conv_copy_spec, temporal, temporal, temporal, temporal)
    ctx = state._mamba_ctx
    assert ctx.num_states == 2 * 5
    for i, layer in enumerate(layers.values()):
        for j, view in enumerate(layer.kv_cache):
            entry = 5 * i + j
            assert int(ctx.state_base_addrs[entry]) == view.data_ptr()
            assert int(ctx.state_block_strides[entry]) == view.stride(0) * view.element_size()
            assert int(ctx.state_conv_widths[entry]) == (WIDTH_1 + K_SPEC if j == 0 else 0)
            if j > 0:  # a whole block: the view's own elements of one slot, contiguous in the page
                assert int(ctx.state_inner_sizes[entry]) == view[0].numel() and view[0].is_contiguous()
    initialize(state, config, block_tables)
    assert state._mamba_state_copy_funcs is funcs
    store_all = _model_state("store_all", layers)
    initialize(store_all, _align_kv_cache_config(layers), block_tables)
    ((_, per_type),) = store_all._mamba_state_copy_funcs.items()
    assert per_type == (get_conv_copy_spec, temporal)


def test_v2_reconstruct_refuses_kdas_recoverssm():
    layers = {"gdn.0": PageLayer(_page_states(NUM_SLOTS, torch.Generator().manual_seed(0)))}
    initialize = v2_prefix_caching._v2_copying_pseudo_value_buffer(lambda *args: None)
    with pytest.raises(ValueError, match="recoverssm"):
        initialize(_model_state("reconstruct", layers, recoverssm=object()), _align_kv_cache_config(layers), None)


# [1, 2]: root 0, node 1 (depth 1), nodes 2 and 3 its children (depth 2): N = 3 fits the pages' 1 + K_SPEC rows
TREE = DraftTree.from_widths([1, 2])


def _with_config(runner, speculative_config) -> None:
    """The runner's speculative config, and its draft shape in every GDN layer's step buffers (as each layer reads it
    at its construction)."""
    runner.speculative_config = speculative_config
    for layer in runner.compilation_config.static_forward_context.values():
        if isinstance(layer, PageLayer):
            layer.step_buffers = GroupStepBuffers(draft_shape_of(speculative_config))


def _tree_config(max_batch_size):
    return SimpleNamespace(mamba_state_commit="reconstruct", is_draft_tree=True, draft_tree=TREE,
                           draft_tree_max_batch_size=max_batch_size)


@pytest.mark.parametrize("path", ["torch", "triton"])
@pytest.mark.parametrize("chain_step", [False, True])
def test_v2_tree_steps_write_what_v1_writes_along_the_accepted_path(path, chain_step, monkeypatch):
    """Draft trees on V2 with prefix caching: after a tree step (its acceptance left by the tree sampler, batch rows)
    or a chain step of `draft_tree_max_batch_size`, V2's hook writes what V1's writer makes of the same rows with the
    commit table and the counts the slots record (tree rows: 1 + the accepted leaf; chain rows: offset by 1 + N);
    the tree sampler's acceptance graphs record no counts in align mode (column 0 is not the slot)."""
    monkeypatch.setattr(dispatch, "launches_triton", lambda counts: path == "triton")
    gen = torch.Generator().manual_seed(11)
    idx_mapping = [4, 1, 3, 0, -1, 5]
    n, depth = TREE.num_nodes, TREE.max_depth
    drafts = [depth] * 3 + [0, depth, -1] if chain_step else [n] * 3 + [0, n, -1]
    # tree rows accept node 3 (path 0 -> 1 -> 3: its boundary at depth 2 is node 3, not block index 2), node 2,
    # the root; a chain step accepts 2, 1, 0 drafts
    leaves = [3, 2, 0]
    num_sampled = [3, 2, 1, 1, 2, 0] if chain_step else [3, 3, 1, 1, 2, 0]
    # tokens through the root: boundaries (block size 4) after depth 2, after depth 1 / 2 with the other leaf, at the root
    running = [6, 7, 8, 7, 9, 8]
    seq_lens = [r + max(d, 0) for r, d in zip(running, drafts)]
    runner = _v2_runner((2, 1), gen, seq_lens)
    _with_config(runner, _tree_config(4 if chain_step else None))
    accepted = None
    if not chain_step:
        step = SimpleNamespace(request_indices=torch.tensor([0, 1, 2]))
        accepted = (step, SimpleNamespace(last_accepted_node=torch.tensor(leaves) - 1))
    runner.speculator = SimpleNamespace(tree_state=SimpleNamespace(accepted=accepted))
    # the counts are recorded after sampling, with the boundaries
    assert v2_accepted_counts.leaf_counts_of(runner).groups == []
    _set_step_counts(runner, idx_mapping, seq_lens, drafts)
    before = _snapshot(runner)

    offset = 1 + n if chain_step else 0
    table = commit_ancestor_table(TREE, "cpu") if chain_step else commit_ancestor_table(TREE, "cpu")[: 1 + n]
    counts = torch.tensor(num_sampled, dtype=torch.int32).clamp(min=1) + offset
    if not chain_step:
        counts[:3] = torch.tensor(leaves, dtype=torch.int32) + 1
    rows = torch.tensor([max(r, 0) for r in idx_mapping])
    skipped = torch.tensor([r < 0 for r in idx_mapping])
    expected = []
    for (group_id, layer), states in zip(_gdn_layers(runner), before):
        page = GDNPage.of(tuple(t.clone() for t in states))
        block_table = runner.block_tables.block_tables[group_id].gpu[rows].masked_fill(skipped[:, None], NULL_BLOCK)
        expected.append(BoundaryLayer(page.ssm_state, page.factors, page.conv_state.transpose(-1, -2)[:, :, :WIDTH_1],
                                      page.conv_inputs, page.counts.view(-1), block_table))
    v1_drafts = torch.tensor([d if r >= 0 else -1 for r, d in zip(idx_mapping, drafts)], dtype=torch.int32)
    record_accepted_and_boundaries_torch(expected, torch.tensor(seq_lens, dtype=torch.int32), v1_drafts, counts,
                                         len(idx_mapping), block_size=BLOCK_SIZE, null_block=NULL_BLOCK,
                                         commit_ancestors=table)
    _sample(runner, idx_mapping, num_sampled)
    changed = False
    for (_, layer), view, old in zip(_gdn_layers(runner), expected, before):
        page = GDNPage.of(layer.kv_cache)
        assert torch.equal(page.counts.view(-1), view.counts)
        torch.testing.assert_close(page.ssm_state, view.state, rtol=1e-5, atol=1e-6)
        assert torch.equal(page.conv_state.transpose(-1, -2)[:, :, :WIDTH_1], view.conv_history)
        changed |= not torch.equal(page.ssm_state, old[1])
    assert changed
    if not chain_step:  # the first tree row's boundary (after depth 2) holds the state after node 3, on its path
        (group_id, layer) = _gdn_layers(runner)[0]
        block_table = runner.block_tables.block_tables[group_id].gpu
        slot, dest = int(block_table[4, (seq_lens[0] - 1) // BLOCK_SIZE]), int(block_table[4, 1])
        state = committed_states(before[0][1], torch.tensor([slot]), GDNPage.of(before[0]).factors,
                                 torch.tensor([3]), table)
        torch.testing.assert_close(GDNPage.of(layer.kv_cache).ssm_state[dest], state[0], rtol=1e-5, atol=1e-6)


def test_the_boundary_views_are_built_once_per_kv_cache_and_block_tables(monkeypatch):
    """`runner_boundary_layers` walks the layers and their states only when the first GDN layer's bound KV cache or a
    GDN group's block table is another object (vLLM binds every layer in one pass, with the block tables); its views
    then follow the new ones."""
    gen = torch.Generator().manual_seed(4)
    runner = _v2_runner((2, 1), gen, [4, 4])
    built = []
    monkeypatch.setattr(prefix_caching, "boundary_layers",
                        lambda layers, tables: built.append(1) or BOUNDARY_LAYERS(layers, tables))

    def boundary_views():
        return prefix_caching.runner_boundary_layers(runner, lambda g: runner.block_tables.block_tables[g].gpu)[0]

    views = boundary_views()
    assert boundary_views() is views and len(built) == 1 and len(views) == 3
    layers = [layer for _, layer in _gdn_layers(runner)]
    for layer in layers:  # vLLM binds a new KV cache: every layer, in one pass
        layer.kv_cache = tuple(state.clone() for state in layer.kv_cache)
    views = boundary_views()
    assert len(built) == 2 and views[2].state.data_ptr() == GDNPage.of(layers[2].kv_cache).ssm_state.data_ptr()
    runner.block_tables.block_tables[2].gpu = runner.block_tables.block_tables[2].gpu.clone()
    views = boundary_views()
    assert len(built) == 3 and views[2].block_table is runner.block_tables.block_tables[2].gpu
    assert boundary_views() is views and len(built) == 3


BOUNDARY_LAYERS = prefix_caching.boundary_layers
