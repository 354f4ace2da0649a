"""The post-sampler graphs of V2 tree steps (`vllm_plugin/v2/accept_graphs.py`) on CPU.

CPU cannot capture, so the graph is a stand-in whose replay runs the captured body (`TreeAcceptGraphs.run_body`
over the persistent buffers): the copy-in, the padding and the read-back are the production code. Each world (eager, graphed) has its own TRITON_ATTN caches (two groups: two layers
sharing one block table, one layer of another block size) and GDN count states; a step of every request a tree row
runs `accept_and_commit_tree_rows` eagerly in one and through the graph in the other, and everything must come out
equal: the emitted rows, counts, acceptance, logits rows, every cache and count. Consecutive steps shrink the batch
under one padded size, so stale rows of the buffers hold an earlier step's real requests: padded rows must not act on
them. The capture wrapper's host side (sizes, warm-up, inert buffers, profiling) is held with vLLM's capture
context faked; what the captured body reads must outlive the graph (a graph keeps addresses, not tensors).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from types import SimpleNamespace

import pytest
import torch

from tests.plugin.v2.graph_reads import held_storages, reads_from_outside
from tests.plugin.v2.test_runner import v2_batch
from vllm_treewy.tree import DraftTree
from vllm_treewy.vllm_plugin.v2 import accepted_counts as v2_accepted_counts
from vllm_treewy.vllm_plugin.v2 import accept_graphs
from vllm_treewy.vllm_plugin.v2 import runner as v2_runner
from vllm_treewy.vllm_plugin.v2.accept_graphs import TreeAcceptGraphs
from vllm_treewy.vllm_plugin.v2.acceptance import accept_and_commit_tree_rows
from vllm_treewy.vllm_plugin.v2.accepted_counts import CountedGroups
from vllm_treewy.vllm_plugin.v2.run_state import TreeRunStateV2
from vllm_treewy.vllm_plugin.trees.step import AttentionLayerCaches, PagedLayerCaches, TreeConstants

MAX_MODEL_LEN = 64
BLOCK_SIZES = (16, 8)  # the two TRITON_ATTN cache groups'
MAX_REQS = 8
NUM_STATES = 12  # V2's request states
NUM_SLOTS = 32  # GDN state slots
VOCAB = 40


class World:
    """One copy of what a step writes: TRITON_ATTN caches per group (their blocks dealt to request states), GDN
    count states and V2's GDN block tables by request state."""

    def __init__(self, seed: int):
        gen = torch.Generator().manual_seed(seed)
        self.tables, self.caches = [], []
        # V2's table rows may be wider than the positions need (the first group's: wider than the graphs' buffers,
        # which hold one column past max_model_len) or just wide enough (the second's)
        for size, num_layers, extra in zip(BLOCK_SIZES, (2, 1), (2, 0)):
            width = -(-MAX_MODEL_LEN // size) + extra
            # block 0 is vLLM's null block, which no request holds (the graphs' padded rows move K/V inside it)
            blocks = 1 + torch.randperm(NUM_STATES * width, generator=gen).view(NUM_STATES, width).int()
            self.tables.append(blocks)
            self.caches.append([torch.randn(1 + NUM_STATES * width, 1, size, 4, generator=gen)
                                for _ in range(num_layers)])
        slots = torch.randperm(NUM_SLOTS, generator=gen)[: 2 * NUM_STATES].view(2, NUM_STATES)
        self.gdn_groups = [(torch.randint(1, 9, (NUM_SLOTS,), dtype=torch.int32, generator=gen),
                            torch.stack([slots[g], torch.zeros_like(slots[g])], dim=1).int()) for g in range(2)]

    def clone(self) -> World:
        other = object.__new__(World)
        other.tables = self.tables
        other.caches = [[c.clone() for c in caches] for caches in self.caches]
        other.gdn_groups = [(counts.clone(), table) for counts, table in self.gdn_groups]
        return other

    def recorded_layers(self, idx_mapping: torch.Tensor) -> list[PagedLayerCaches]:
        """The step's layers as `hand_tree_to_attention_layers` records them: a group's layers share its rows' table."""
        layers = []
        for table, caches in zip(self.tables, self.caches):
            rows = table[idx_mapping.long()]
            layers += [PagedLayerCaches(cache, rows) for cache in caches]
        return layers

    def state(self) -> list[torch.Tensor]:
        """Every cache's requests' blocks (not the null block) and every count state."""
        return [c[1:] for caches in self.caches for c in caches] + [counts for counts, _ in self.gdn_groups]


def uniform_step(tree: DraftTree, num_reqs: int, gen: torch.Generator):
    """A V2 step of `num_reqs` tree rows (the tree step as `find_tree_step_v2` finds it, its V2 batch fields) and V2's
    draws, planted so that each row walks a random depth along random branches."""
    block_len = 1 + tree.num_nodes
    roots = torch.randint(0, MAX_MODEL_LEN - block_len, (num_reqs,), generator=gen)
    batch = v2_batch([block_len] * num_reqs, [tree.num_nodes] * num_reqs, [False] * num_reqs, roots.tolist())
    step = v2_runner.find_tree_step_v2(tree, batch)
    assert step.covers_batch and step.num_requests == num_reqs
    batch.input_ids = torch.randint(0, VOCAB, (num_reqs * block_len,), generator=gen).int()
    batch.idx_mapping = torch.randperm(NUM_STATES, generator=gen)[:num_reqs].int()
    batch.cu_num_logits = torch.arange(num_reqs + 1, dtype=torch.int32) * block_len
    draws = torch.randint(VOCAB, 2 * VOCAB, (num_reqs * block_len,), generator=gen)  # nothing matches by default
    for r in range(num_reqs):
        drafts = batch.input_ids[r * block_len + 1 : (r + 1) * block_len]
        current = -1
        for _ in range(int(torch.randint(0, tree.max_depth + 1, (1,), generator=gen))):
            children = [n for n, p in enumerate(tree.parents) if p == current]
            child = children[int(torch.randint(0, len(children), (1,), generator=gen))]
            draws[r * block_len + 1 + current] = drafts[child]
            current = child
    return step, batch, draws


def graphs_of(world: World, tree: DraftTree, sizes) -> TreeAcceptGraphs:
    """The world's graphs with a stand-in per size whose replay runs the captured body."""
    graphs = TreeAcceptGraphs(tree, tree.num_nodes, world.caches, CountedGroups(world.gdn_groups), max(sizes),
                              MAX_MODEL_LEN, TreeConstants.of(tree, torch.device("cpu")))
    graphs.replays = []
    for size in sizes:
        graphs.graphs[size] = SimpleNamespace(
            replay=functools.partial(lambda n: (graphs.replays.append(n), graphs.run_body(n)), size))
    return graphs


@pytest.mark.parametrize("widths", [[2, 2, 1], [3, 2], [1, 1, 1]])
@pytest.mark.parametrize("batch_sizes,graph_size", [((4, 4, 2), 4), ((8, 3, 1), 8), ((5, 2), 8)])
def test_graphed_body_equals_the_eager_body_and_padded_rows_act_on_nothing(widths, batch_sizes, graph_size):
    """Consecutive uniform steps of `batch_sizes` requests, each through the smallest graph that holds it (sizes
    `graph_size` and 1), against the eager body on a copy of the world: every output and every cache and count
    equal, and nothing outside the real rows' blocks and slots written, though the padded rows' buffers held an
    earlier step's requests."""
    tree = DraftTree.from_widths(widths)
    gen = torch.Generator().manual_seed(sum(batch_sizes) + 10 * len(widths))
    eager = World(seed=len(widths))
    graphed = eager.clone()
    graphs = graphs_of(graphed, tree, [graph_size, 1])
    graphs.buffers.block_tables[0].fill_(3)  # stale rows before the first step too
    moved = False
    for num_reqs in batch_sizes:
        step, batch, draws = uniform_step(tree, num_reqs, gen)
        before = graphed.clone()
        step.attention_layers = eager.recorded_layers(batch.idx_mapping)
        want = accept_and_commit_tree_rows(step, draws, batch.cu_num_logits, batch.input_ids, tree.num_nodes,
                                           batch.idx_mapping, CountedGroups(eager.gdn_groups))
        step.attention_layers = graphed.recorded_layers(batch.idx_mapping)
        got = graphs.replay(step, draws, batch)
        expected_size = graph_size if num_reqs > 1 else 1
        assert got is not None and graphs.replays[-1] == expected_size
        assert got.sampled.shape == want.sampled.shape == (num_reqs, 1 + tree.num_nodes)
        for name in ("sampled", "num_sampled", "chain_rows"):
            assert torch.equal(getattr(got, name), getattr(want, name)), name
        for name, got_field, want_field in zip(want.acceptance._fields, got.acceptance, want.acceptance):
            assert torch.equal(got_field, want_field), name
        for got_state, want_state in zip(graphed.state(), eager.state()):
            assert torch.equal(got_state, want_state)
        # nothing outside the real rows' blocks and slots changed (the padded rows repeat row 0's count and move
        # K/V only inside the null block)
        states = batch.idx_mapping.long()
        for table, caches, old in zip(graphed.tables, graphed.caches, before.caches):
            others = torch.ones(caches[0].shape[0], dtype=torch.bool)
            others[table[states].long().flatten()] = False
            others[0] = False
            for cache, old_cache in zip(caches, old):
                assert torch.equal(cache[others], old_cache[others])
                moved |= not torch.equal(cache, old_cache)
        for (counts, table), (old_counts, _) in zip(graphed.gdn_groups, before.gdn_groups):
            others = torch.ones(NUM_SLOTS, dtype=torch.bool)
            others[table[states, 0].long()] = False
            assert torch.equal(counts[others], old_counts[others])
    assert moved or widths == [1, 1, 1]  # a tree's accepted paths moved K/V (a chain's are in place)


def test_the_captured_body_compacts_each_cache_group_in_one_call(monkeypatch):
    from vllm_treewy.vllm_plugin.trees import sampling as tree_sampling

    calls = []
    compact = tree_sampling.compact_paged_kv_torch
    monkeypatch.setattr(tree_sampling, "compact_paged_kv_torch",
                        lambda caches, *args: (calls.append(len(caches)), compact(caches, *args))[1])
    graphs = graphs_of(World(seed=5), DraftTree.from_widths([2, 1]), [4])
    graphs.run_body(4)
    assert calls == [2, 1]


def test_steps_the_graphs_do_not_hold_run_eagerly():
    """None (the caller runs the body eagerly), nothing copied or replayed: a batch with another request than tree
    rows, more requests than the largest graph, layers grouped otherwise than captured or on the CPU layout, logits
    rows other than the blocks."""
    tree = DraftTree.from_widths([2, 1])
    world = World(seed=1)
    graphs = graphs_of(world, tree, [2, 4])
    gen = torch.Generator().manual_seed(0)
    step, batch, draws = uniform_step(tree, 3, gen)
    step.attention_layers = world.recorded_layers(batch.idx_mapping)
    stale = graphs.buffers.draws.clone()

    def held(step, draws=draws, batch=batch):
        return graphs.replay(step, draws, batch) is not None

    assert not held(dataclasses.replace(step, covers_batch=False))
    mixed = SimpleNamespace(**{**vars(batch), "num_reqs": 4})
    assert not held(step, batch=mixed)
    assert not held(step, draws=draws[:-1])
    assert not held(dataclasses.replace(step, attention_layers=step.attention_layers[:2]))
    cpu_layer = AttentionLayerCaches(torch.zeros(1), torch.zeros(1), torch.zeros(1, 1), "vec")
    assert not held(dataclasses.replace(step, attention_layers=[*step.attention_layers, cpu_layer]))
    big_step, big_batch, big_draws = uniform_step(tree, 5, gen)
    big_step.attention_layers = world.recorded_layers(big_batch.idx_mapping)
    assert not held(big_step, big_draws, big_batch)
    assert graphs.replays == [] and torch.equal(graphs.buffers.draws, stale)
    assert held(step) and graphs.replays == [4]
    assert graphs.graph_size(1) == 2 and graphs.graph_size(3) == 4 and graphs.graph_size(5) is None


def test_paged_cache_groups_follow_the_kv_cache_groups():
    """TRITON_ATTN and FLASH_ATTN layers (one paged KV layout) per KV-cache group, each cache once (a shared cache in
    its first layer's group), other backends left out."""
    caches = [torch.zeros(2, 1, 4, 2) for _ in range(4)]
    layers = {f"l{i}": SimpleNamespace(kv_cache=c) for i, c in enumerate(caches)}
    layers["shared"] = SimpleNamespace(kv_cache=caches[0])
    layers["gdn"] = SimpleNamespace(kv_cache=torch.zeros(3))

    def group(name, names, group_id):
        return SimpleNamespace(backend=SimpleNamespace(get_name=lambda: name), layer_names=names,
                               kv_cache_group_id=group_id)

    runner = SimpleNamespace(compilation_config=SimpleNamespace(static_forward_context=layers), attn_groups=[
        [group("TRITON_ATTN", ["l0", "l1"], 0)], [group("GDN_ATTN", ["gdn"], 1)],
        [group("FLASH_ATTN", ["shared", "l2"], 2), group("TRITON_ATTN", ["l3"], 2)]])
    groups = accept_graphs.paged_cache_groups_of(runner)
    assert [[id(c) for c in g] for g in groups] == [[id(caches[0]), id(caches[1])], [id(caches[2]), id(caches[3])]]


def test_graphs_are_captured_after_v2s_capture_phase_at_its_full_graph_sizes(monkeypatch):
    """The capture's host side (CPU cannot capture): after V2's capture_model, one graph of the body per padded
    request count of V2's FULL first-pass graphs, recorded as V2 records its own (its pool, the
    capture stream), each after a warm-up that records no count; the buffers inert (nothing accepted, so every K/V
    copy puts a root onto itself): caches and counts unchanged. Nothing inside V2's graph-memory profiling, none
    without FULL decode graphs."""
    import vllm.compilation.cudagraph_pool as cudagraph_pool
    import vllm.distributed.parallel_state as parallel_state
    from vllm.config.compilation import CUDAGraphMode
    from vllm.v1.worker.gpu.cudagraph_utils import BatchExecutionDescriptor

    recording, pools = [], []

    @contextlib.contextmanager
    def fake_graph(graph, pool, stream=None):
        recording.append(graph)
        yield
        recording.pop()

    monkeypatch.setattr(torch.cuda, "CUDAGraph", lambda: SimpleNamespace(replay=lambda: None))
    monkeypatch.setattr(torch.cuda, "graph", fake_graph)
    monkeypatch.setattr(cudagraph_pool, "capture_pool",
                        lambda pool, config: (pools.append(pool), contextlib.nullcontext(pool))[1])
    monkeypatch.setattr(parallel_state, "graph_capture", lambda device: contextlib.nullcontext())
    monkeypatch.setattr("vllm.utils.torch_utils.current_stream", lambda: None)
    bodies = []
    run_body = TreeAcceptGraphs.run_body

    def recorded_body(self, size, record_counts=True):
        bodies.append((size, bool(recording), record_counts))
        if recording:  # a real capture records the body without running it; the fake runs it: not judged
            return run_body(self, size, record_counts)
        before = world.clone()
        result = run_body(self, size, record_counts)
        assert all(torch.equal(a, b) for a, b in zip(world.state(), before.state()))  # the warm-up is inert
        return result

    monkeypatch.setattr(TreeAcceptGraphs, "run_body", recorded_body)
    tree = DraftTree.from_widths([2, 2, 1])
    world = World(seed=2)
    before = world.clone()
    monkeypatch.setattr(accept_graphs, "paged_cache_groups_of", lambda runner: world.caches)
    monkeypatch.setattr("vllm_treewy.vllm_plugin.v2.accepted_counts.gdn_groups_of", lambda runner: world.gdn_groups)
    state = TreeRunStateV2(tree)
    full = [BatchExecutionDescriptor(cg_mode=CUDAGraphMode.FULL, num_tokens=(1 + tree.num_nodes) * n, num_reqs=n)
            for n in (1, 8)]
    manager = SimpleNamespace(pool="v2's pool", cudagraph_mode=CUDAGraphMode.FULL_AND_PIECEWISE,
                              _capture_descs={CUDAGraphMode.FULL: full})
    speculator = SimpleNamespace(tree_state=state, max_model_len=MAX_MODEL_LEN, device=torch.device("cpu"),
                                 vllm_config=None, prefill_cudagraph_manager=manager,
                                 tree_constants=lambda t: TreeConstants.of(t, torch.device("cpu")))

    def capture_model(self, *, profile_only=False):
        pass

    capture = v2_runner._binding_tree_state(v2_runner._capturing_tree_acceptance(capture_model))
    runner = SimpleNamespace(speculator=speculator, num_speculative_steps=tree.num_nodes,
                             cache_config=SimpleNamespace(mamba_cache_mode="none"))
    capture(runner, profile_only=True)
    assert state.accept_graphs is None and bodies == []
    capture(runner)
    graphs = state.accept_graphs
    assert sorted(graphs.graphs) == [1, 8] and pools == ["v2's pool"] * 2
    assert bodies == [(8, False, False), (8, True, True), (1, False, False), (1, True, True)]  # warm-up without
    # counts, then the capture
    assert (graphs.buffers.draws == -1).all()
    for got, want in zip(world.caches, before.caches):  # nothing accepted: every copy a root onto itself
        assert all(torch.equal(a, b) for a, b in zip(got, want))
    manager.cudagraph_mode = CUDAGraphMode.PIECEWISE  # no FULL decode graphs: no acceptance graphs
    capture(runner)
    assert state.accept_graphs is None


def test_sample_tree_step_reads_the_graphs_result(monkeypatch):
    """`sample_tree_step` (V2's plumbing around the sampler faked) takes the graph's result where `replay` gives one,
    else runs the body eagerly: the same output, counts and acceptance for the drafter, the same caches after."""
    from vllm.v1.worker.gpu.sample.states import NO_LOGPROBS

    from vllm_treewy.vllm_plugin.v2 import sampler as v2_sampler

    tree = DraftTree.from_widths([2, 1])
    step, batch, draws = uniform_step(tree, 2, torch.Generator().manual_seed(4))
    batch.logits_indices = torch.arange(draws.numel())
    batch.seq_lens_cpu_upper_bound = torch.zeros(2)
    batch.expanded_idx_mapping = batch.idx_mapping_np = batch.expanded_local_pos = batch.seq_lens = None
    sampler = SimpleNamespace(sample=lambda *args: (draws, None), sampling_states=SimpleNamespace(
        max_num_logprobs=lambda idx: NO_LOGPROBS), req_states=SimpleNamespace(prefill_len=SimpleNamespace(gpu=None)))
    runner = SimpleNamespace(sampler=sampler, model=SimpleNamespace(compute_logits=lambda h: h),
                             num_speculative_steps=tree.num_nodes,
                             cache_config=SimpleNamespace(mamba_cache_mode="none"))
    monkeypatch.setattr("vllm.v1.worker.gpu.input_batch.get_num_sampled_and_rejected",
                        lambda num_sampled, *args: (num_sampled, 1 + tree.num_nodes - num_sampled))
    calls = []
    monkeypatch.setattr(v2_sampler, "accept_and_commit_tree_rows",
                        lambda *args: (calls.append("eager"), accept_and_commit_tree_rows(*args))[1])
    eager = World(seed=3)
    graphed = eager.clone()
    graphs = graphs_of(graphed, tree, [4])
    outputs = []
    for world, accept_graphs in ((eager, None), (graphed, graphs)):
        monkeypatch.setattr(v2_accepted_counts, "gdn_groups_of", lambda runner, world=world: world.gdn_groups)
        step.attention_layers = world.recorded_layers(batch.idx_mapping)
        state = TreeRunStateV2(tree, accept_graphs=accept_graphs)
        output, num_sampled, _ = v2_sampler.sample_tree_step(runner, torch.zeros(draws.numel(), 1), batch,
                                                                  step, state)
        outputs.append((output.sampled_token_ids, num_sampled, state.accepted[1]))
    assert calls == ["eager"] and graphs.replays == [4]
    (eager_sampled, eager_num, eager_acceptance), (graph_sampled, graph_num, graph_acceptance) = outputs
    assert torch.equal(eager_sampled, graph_sampled) and torch.equal(eager_num, graph_num)
    assert all(torch.equal(a, b) for a, b in zip(eager_acceptance, graph_acceptance))
    assert all(torch.equal(a, b) for a, b in zip(eager.state(), graphed.state()))



@pytest.mark.parametrize("widths", [[2, 2, 1], [3, 2]])
def test_the_captured_body_reads_only_what_outlives_the_graph(widths):
    """Every tensor the body reads and did not make is held by the graphs' object (buffers, caches, counts,
    constants) or by a cache that never evicts (the walk tables): a graph keeps addresses, not tensors, so a read of
    a tensor that a bounded cache may free later (an LRU of aranges) makes a replay read freed memory."""
    from vllm_treewy.vllm_plugin.trees.sampling import walk_tables

    tree = DraftTree.from_widths(widths)
    graphs = graphs_of(World(seed=5), tree, [4])
    graphs.run_body(4, record_counts=False)  # the warm-up builds what the capture then reads
    outside = reads_from_outside(lambda: graphs.run_body(4))
    assert outside - held_storages(graphs, walk_tables(tree.parents, torch.device("cpu"))) == set()
