"""Draft trees on Model Runner V2 (`vllm_plugin/v2/runner.py`): the pieces that run on CPU.

V2 does not run on vLLM's CPU backend, so these tests hold the V2-specific index arithmetic on tensors shaped as V2
lays them out (its `InputBatch`: rows packed by `query_start_loc`, logits rows by `cu_num_logits`, device positions
num_computed + i before the override), the feature-check switch, and the tree speculator's drafting levels on a
stand-in of V2's speculator (its buffers, first pass and head forward) whose head is a known function, against a
node-by-node reference. What needs a GPU (V2's runner end to end, FULL graphs, TRITON_ATTN) is
`bench/run_gpu_v2_trees.sh`."""

from __future__ import annotations

import dataclasses
import functools
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from tests.plugin.v2.graph_reads import held_storages, reads_from_outside
from vllm_treewy.spec_decode.acceptance import greedy_tree_acceptance_reference
from vllm_treewy.tree import DraftTree
from vllm_treewy.vllm_plugin.v2 import runner as v2_runner
from vllm_treewy.vllm_plugin.v2 import sampler as v2_sampler
from vllm_treewy.vllm_plugin.v2 import speculator as v2_speculator
from vllm_treewy.vllm_plugin.trees.drafting import PADDING_SLOT, kv_slots
from vllm_treewy.vllm_plugin.trees.metadata import tree_qq_bias_of, tree_step_of, with_tree
from vllm_treewy.vllm_plugin.trees.step import block_depths, override_positions
from vllm_treewy.vllm_plugin.v2 import acceptance as v2_acceptance
from vllm_treewy.vllm_plugin.v2 import run_state as v2_run_state

WIDTHS = [2, 2, 1]
TREE = DraftTree.from_widths(WIDTHS)
N = TREE.num_nodes  # 10
L = 1 + N


def tree_config(widths=WIDTHS):
    tree = DraftTree.from_widths(widths)
    return SimpleNamespace(is_draft_tree=any(w > 1 for w in widths), draft_tree=tree, draft_tree_widths=widths)


def v2_config(spec, batch_sharded_sampling=False):
    """The parts of a VllmConfig the tree speculator reads."""
    return SimpleNamespace(speculative_config=spec,
                           parallel_config=SimpleNamespace(enable_batch_sharded_sampling=batch_sharded_sampling))


def v2_batch(query_lens, drafts, prefilling, num_computed, runs_as_decode=None):
    """A V2 InputBatch stand-in: host arrays as V2's prepare_inputs makes them, device positions num_computed + i."""
    query_lens = np.asarray(query_lens)
    qsl = np.concatenate([[0], np.cumsum(query_lens)]).astype(np.int32)
    positions = torch.cat([torch.arange(n) + c for n, c in zip(query_lens, num_computed)]).long()
    return SimpleNamespace(num_reqs=len(query_lens), num_draft_tokens_per_req=np.asarray(drafts, dtype=np.int32),
                           is_prefilling_np=np.asarray(prefilling), query_start_loc_np=qsl, positions=positions,
                           prefill_runs_as_decode_np=None if runs_as_decode is None else np.asarray(runs_as_decode))


def test_decode_draft_counts_mark_prefills():
    decode, drafts = v2_runner.decode_draft_counts(np.array([0, N, 0, N]), np.array([True, False, False, False]),
                                                        4)
    assert decode.tolist() == [-1, N, 0, N] and drafts.tolist() == [0, N, 0, N]
    decode, drafts = v2_runner.decode_draft_counts(None, np.array([False, True]), 2)
    assert decode.tolist() == [0, -1] and drafts.tolist() == [0, 0]


def test_tree_rows_roots_and_depth_positions_in_v2_layout():
    # a prompt chunk of 1 + N tokens (not a tree row), a tree row, a one-token decode, a tree row
    batch = v2_batch([L, L, 1, L], [0, N, 0, N], [True, False, False, False], [0, 40, 7, 100])
    step = v2_runner.find_tree_step_v2(TREE, batch)
    assert step.request_indices.tolist() == [1, 3]
    assert step.token_indices.tolist() == list(range(L, 2 * L)) + list(range(2 * L + 1, 3 * L + 1))
    assert step.root_positions.tolist() == [40, 100]  # read on the device, not from V2's host upper bound
    assert not step.covers_batch  # the prompt chunk: the tree rows get their own launch
    positions = batch.positions.clone()
    override_positions(positions, step)
    depths = torch.as_tensor(block_depths(TREE))
    assert positions[L : 2 * L].tolist() == (40 + depths).tolist()
    assert positions[2 * L + 1 :].tolist() == (100 + depths).tolist()
    assert positions[: L].tolist() == list(range(L)) and positions[2 * L].item() == 7  # others untouched

    decodes = v2_batch([L, 1, L], [N, 0, N], [False, False, False], [5, 6, 9])
    assert v2_runner.find_tree_step_v2(TREE, decodes).covers_batch  # the bias in vLLM's own launch
    assert v2_runner.find_tree_step_v2(TREE, v2_batch([1, 3], [0, 0], [False, True], [4, 0])) is None


def test_a_batch_of_tree_rows_only_takes_the_cached_uniform_step():
    """Every request a tree row: the cached uniform step equals the general one field by field (the same rows,
    tokens, roots, shifts), and a batch with any other row takes the general path."""
    from vllm_treewy.vllm_plugin.trees.step import TreeConstants

    constants = TreeConstants.of(TREE, torch.device("cpu"))
    batch = v2_batch([L, L, L], [N, N, N], [False, False, False], [5, 60, 9])
    general, uniform = v2_runner.find_tree_step_v2(TREE, batch), v2_runner.find_tree_step_v2(
        TREE, batch, constants)
    assert 3 in constants.uniform_steps  # the template, built at this batch size's first step
    for field in ("request_indices", "token_indices", "query_start_loc", "root_positions", "parents", "cu_nodes",
                  "position_shifts"):
        assert torch.equal(getattr(uniform, field).long(), getattr(general, field).long()), field
    assert uniform.covers_batch and general.covers_batch
    batch.positions.fill_(-1)  # V2 rewrites its persistent positions next step
    assert uniform.root_positions.tolist() == [5, 60, 9]  # the step's own copy of the roots
    mixed = v2_batch([L, 1, L], [N, 0, N], [False, False, False], [5, 6, 9])
    assert v2_runner.find_tree_step_v2(TREE, mixed, constants).request_indices.tolist() == [0, 2]
    assert 2 not in constants.uniform_steps  # the general path


def test_a_prompt_tail_run_as_decode_is_a_tree_row_and_partial_trees_are_refused():
    batch = v2_batch([L], [N], [True], [12], runs_as_decode=[True])
    assert v2_runner.find_tree_step_v2(TREE, batch).request_indices.tolist() == [0]
    with pytest.raises(RuntimeError, match="drafts of a 10-node draft tree"):
        v2_runner.find_tree_step_v2(TREE, v2_batch([4], [3], [False], [12]))


@pytest.mark.parametrize("seed", range(6))
def test_accept_tree_rows_walks_the_draws_as_the_reference(seed):
    """V2's logits rows: a one-token decode, a tree row, a prefill's last row, a tree row. Draws planted so that the
    walk goes a random depth along random branches; the result matches the node-by-node reference walk."""
    gen = torch.Generator().manual_seed(seed)
    query_lens = [1, L, 5, L]
    batch = v2_batch(query_lens, [0, N, 0, N], [False, False, True, False], [3, 50, 0, 80])
    step = v2_runner.find_tree_step_v2(TREE, batch)
    input_ids = torch.randint(0, 1000, (sum(query_lens),), generator=gen)
    logits_per_req = [1, L, 1, L]
    cu = torch.tensor(np.concatenate([[0], np.cumsum(logits_per_req)]), dtype=torch.int32)
    draws = torch.randint(1000, 2000, (int(cu[-1]),), generator=gen)  # nothing matches by default
    for r, req in enumerate(step.request_indices.tolist()):
        drafts = input_ids[batch.query_start_loc_np[req] + 1 : batch.query_start_loc_np[req] + L]
        current, target_depth = -1, int(torch.randint(0, TREE.max_depth + 1, (1,), generator=gen))
        for _ in range(target_depth):  # plant the draw at the current node to be one random child's token
            children = [n for n, p in enumerate(TREE.parents) if p == current]
            child = children[int(torch.randint(0, len(children), (1,), generator=gen))]
            draws[int(cu[req]) + 1 + current] = drafts[child]
            current = child
    result = v2_acceptance.accept_tree_rows(step, draws, cu, input_ids, num_speculative_steps=N)
    assert result.sampled.shape == (4, 1 + N)
    assert result.sampled[0, 0] == draws[0] and result.sampled[2, 0] == draws[int(cu[3]) - 1]
    assert (result.sampled[[0, 2], 1:] == -1).all() and result.num_sampled[[0, 2]].tolist() == [1, 1]
    for r, req in enumerate(step.request_indices.tolist()):
        start = int(batch.query_start_loc_np[req])
        drafts = input_ids[start + 1 : start + L].tolist()
        block = draws[int(cu[req]) : int(cu[req]) + L].tolist()
        path, bonus = greedy_tree_acceptance_reference(TREE.parents, drafts, block, TREE.max_depth)
        emitted = [drafts[n] for n in path] + [bonus]
        assert result.sampled[req, : len(emitted)].tolist() == emitted
        assert (result.sampled[req, len(emitted) :] == -1).all()
        assert result.num_sampled[req] == len(emitted)
        # logits rows as the accepted path's chain: root, then each accepted node's row
        rows = result.chain_rows[int(cu[req]) : int(cu[req]) + len(emitted)].tolist()
        assert rows == [int(cu[req])] + [int(cu[req]) + 1 + n for n in path]
    untouched = torch.ones(int(cu[-1]), dtype=torch.bool)
    for req in step.request_indices.tolist():
        untouched[int(cu[req]) : int(cu[req]) + L] = False
    assert torch.equal(result.chain_rows[untouched], torch.arange(int(cu[-1]))[untouched])


def test_level_slots_in_every_group():
    """The drafting levels' KV slots in each KV-cache group (`kv_slots` per group, as `_draft_levels` takes them)."""
    tables = [torch.tensor([[3, 9, 4], [7, 2, 8]], dtype=torch.int32), torch.tensor([[1], [5]], dtype=torch.int32)]
    positions = torch.tensor([[14, 15, 16], [30, 31, 32]])
    slots = [kv_slots(table, positions, size, max_model_len=32).reshape(-1) for table, size in zip(tables, [16, 64])]
    assert slots[0].tolist() == [3 * 16 + 14, 3 * 16 + 15, 9 * 16 + 0, 2 * 16 + 14, 2 * 16 + 15, -1]
    assert slots[1].tolist() == [64 + 14, 64 + 15, 64 + 16, 5 * 64 + 30, 5 * 64 + 31, -1]


@dataclasses.dataclass
class FakeMetadata:
    max_query_len: int


def test_the_drafters_first_pass_sees_no_tree():
    bias = torch.zeros(2, 2)
    plain = FakeMetadata(3)
    treed = with_tree(FakeMetadata(L), tree_qq_bias=bias)
    stripped = v2_speculator._strip_tree({"a": plain, "b": treed})
    assert stripped["a"] is plain
    assert tree_qq_bias_of(stripped["b"]) is None and tree_step_of(stripped["b"]) is None
    assert stripped["b"].max_query_len == L and tree_qq_bias_of(treed) is bias  # the target's keeps its tree


# -- the tree speculator's levels on a stand-in of V2's MTP speculator -------------------------------------------

HIDDEN, VOCAB = 8, 50


class FakeHead:
    """out = tanh(W [onehot-ish embedding(token) + hidden]); logits = out @ U."""

    def __init__(self):
        gen = torch.Generator().manual_seed(0)
        self.embed = torch.randn(VOCAB, HIDDEN, generator=gen)
        self.mix = torch.randn(HIDDEN, HIDDEN, generator=gen)
        self.unembed = torch.randn(HIDDEN, VOCAB, generator=gen)

    def forward(self, tokens, hidden):
        return torch.tanh((self.embed[tokens] + hidden) @ self.mix)

    def compute_logits(self, hidden):
        return hidden @ self.unembed


class FakeV2Speculator:
    """What the tree speculator reads of V2's TargetDependentARSpeculator: its buffers, its first pass (one draft:
    the head over each request's last query row, whose output it leaves at hidden_states[:num_reqs]) and its forward
    over the input buffers (`_run_model`), whose attention the levels' tree bias would restrict; the head here is
    per token, so a level's output at a node depends only on its own inputs, as tree attention guarantees."""

    def __init__(self, vllm_config, device):
        self.head = FakeHead()
        self.model = SimpleNamespace(compute_logits=self.head.compute_logits)
        self.device, self.max_num_tokens, self.max_model_len, self.max_num_reqs = device, 256, 1024, 32
        self.hidden_states = torch.zeros(256, HIDDEN)
        self.input_buffers = SimpleNamespace(input_ids=torch.zeros(256, dtype=torch.int32),
                                             positions=torch.zeros(256, dtype=torch.int64),
                                             query_start_loc=torch.zeros(33, dtype=torch.int32),
                                             seq_lens=torch.zeros(32, dtype=torch.int32))
        self.last_token_indices = torch.zeros(32, dtype=torch.int64)
        self.draft_tokens = torch.zeros(32, vllm_config.speculative_config.num_speculative_tokens, dtype=torch.int64)
        self.block_tables = SimpleNamespace(input_block_tables=[torch.arange(32 * 8, dtype=torch.int32).view(32, 8)],
                                            block_sizes=[16])
        self.kv_cache_config = None
        self.first_pass_calls = []
        self.level_metadata = []
        self.level_slots, self.level_positions = [], []

    def propose(self, input_batch, attn_metadata, slot_mappings, last_hidden_states, aux_hidden_states, num_sampled,
                num_rejected, last_sampled, next_prefill_tokens, temperature, seeds, dummy_run=False,
                num_speculative_tokens=None, **kwargs):
        self.first_pass_calls.append((num_speculative_tokens, attn_metadata))
        num_reqs = input_batch.num_reqs
        qsl = torch.as_tensor(input_batch.query_start_loc_np)
        last = qsl[1 : num_reqs + 1].long() - 1 - num_rejected.long()
        self.last_token_indices[:num_reqs] = last
        self.input_buffers.input_ids[last] = last_sampled[:num_reqs].int()
        self.input_buffers.positions[:num_reqs] = input_batch.positions[last]
        # V2's first-pass inputs: the target's lengths (> 0), padded with 0 (and the last-token indices with 0)
        # past the batch's requests for its graphs
        self.input_buffers.seq_lens[:num_reqs] = (input_batch.positions[last] + 1).int()
        self.input_buffers.seq_lens[num_reqs:] = 0
        self.last_token_indices[num_reqs:] = 0
        self.first_pass_roots = (last.tolist(), input_batch.positions[last].tolist())
        self._prefill(num_reqs, last_sampled[:num_reqs].long(), last_hidden_states[last])
        return self.draft_tokens[:num_reqs]

    def _prefill(self, num_reqs, tokens, hidden):
        """V2's `_prefill`: the head at each request's last token, its draft from `sample_draft` (the logits)."""
        self.hidden_states[:num_reqs] = self.head.forward(tokens, hidden)
        self.draft_tokens[:num_reqs, 0] = self.sample_draft(self.hidden_states[:num_reqs], None, None, None, None,
                                                            None, None)

    def compute_draft_logits(self, hidden_states, spec_step_idx):
        return self.model.compute_logits(hidden_states)

    def sample_draft(self, hidden_states, sample_src_positions, idx_mapping, temperature, seeds, draft_step,
                     draft_logits, spec_step_idx=0):
        return self.compute_draft_logits(hidden_states, spec_step_idx).argmax(-1)

    def _build_attn_metadata(self, num_reqs, batch_desc, query_start_loc_np, seq_lens_cpu_upper_bound, step,
                             slot_mappings=None):
        metadata = {"mtp.attn": FakeMetadata(int(np.diff(query_start_loc_np).max()))}
        self.level_metadata.append((metadata, slot_mappings))
        return metadata

    def _run_model(self, num_tokens, attn_metadata, slot_mappings, num_tokens_across_dp):
        self.level_slots.append(slot_mappings.clone())  # what the level's forward writes its K/V to
        self.level_positions.append(self.input_buffers.positions[:num_tokens].clone())
        out = self.head.forward(self.input_buffers.input_ids[:num_tokens].long(), self.hidden_states[:num_tokens])
        return out, out


def reference_tree(head, root_token, root_hidden, widths):
    """Node by node: level 1 = top-w1 of the head at the root; each node's children = top-w of the head at the
    node (its token, its parent's head output)."""
    tree = DraftTree.from_widths(widths)
    root_out = head.forward(torch.tensor([root_token]), root_hidden[None])[0]
    outputs, tokens = {-1: root_out}, [None] * tree.num_nodes
    for node, parent in enumerate(tree.parents):
        level = tree.depth[node] - 1
        siblings = [n for n, p in enumerate(tree.parents) if p == parent]
        top = head.compute_logits(outputs[parent][None])[0].topk(widths[level]).indices
        tokens[node] = int(top[siblings.index(node)])
        outputs[node] = head.forward(torch.tensor([tokens[node]]), outputs[parent][None])[0]
    return tokens


def test_the_first_pass_gives_the_roots_children_before_the_block_tables_exist():
    """V2 runs the first pass in dummy runs before `set_attn` gives the speculator its block tables (memory
    profiling): `sample_draft` writes the root's children (top-w1 of the head's logits, most likely first) and
    returns the most likely as V2's first draft, reading nothing the block tables bring."""
    widths = [3, 2]
    tree = DraftTree.from_widths(widths)
    spec = SimpleNamespace(is_draft_tree=True, draft_tree=tree, draft_tree_widths=widths,
                           num_speculative_tokens=tree.num_nodes, enable_adaptive_verification=False,
                           uses_dynamic_speculative_decoding=lambda: False)
    speculator = v2_speculator.make_tree_speculator_class(FakeV2Speculator)(v2_config(spec), torch.device("cpu"))
    del speculator.block_tables
    tokens, hidden = torch.tensor([3, 17]), torch.randn(2, HIDDEN, generator=torch.Generator().manual_seed(1))
    speculator._prefill(2, tokens, hidden)
    logits = speculator.head.compute_logits(speculator.head.forward(tokens, hidden))
    top = logits.topk(widths[0]).indices
    assert speculator.tree_tokens[:2, : widths[0]].tolist() == top.tolist()
    assert speculator.draft_tokens[:2, 0].tolist() == top[:, 0].tolist()


def _drafting_speculator(monkeypatch, widths, graph_size):
    """A tree speculator on the stand-in; with `graph_size`, a stand-in of the levels' graph captured for that many
    padded requests (its replay runs the captured body), whose buffers hold stale rows that replays must reset."""
    import vllm.v1.attention.backends.triton_attn as triton_attn

    monkeypatch.setattr(triton_attn, "TritonAttentionMetadata", FakeMetadata)
    monkeypatch.setattr("vllm.v1.worker.gpu.attn_utils.build_slot_mappings_by_layer", lambda slots, config: slots)
    tree = DraftTree.from_widths(widths)
    spec = SimpleNamespace(is_draft_tree=True, draft_tree=tree, draft_tree_widths=widths,
                           num_speculative_tokens=tree.num_nodes, enable_adaptive_verification=False,
                           uses_dynamic_speculative_decoding=lambda: False)
    speculator = v2_speculator.make_tree_speculator_class(FakeV2Speculator)(v2_config(spec), torch.device("cpu"))
    speculator._chains.hidden_states.normal_(generator=torch.Generator().manual_seed(7))  # stale rows
    if graph_size is not None:
        inputs = speculator._level_inputs(graph_size, torch.full((graph_size,), 1024, dtype=torch.int32))
        speculator._tree_buffers().root_positions[:graph_size] = 500
        speculator._tree_buffers().valid[:graph_size] = True
        replay = functools.partial(speculator._draft_levels, graph_size, inputs)
        speculator._level_graphs[graph_size] = (SimpleNamespace(replay=replay), inputs)
    return speculator


@pytest.mark.parametrize("graph_size", [None, 5])
@pytest.mark.parametrize("widths", [[2, 2, 1], [2, 1, 1], [3, 2], [4]])
def test_tree_speculator_drafts_the_reference_tree(monkeypatch, widths, graph_size):
    """graph_size 5: the levels as a captured graph of 5 padded requests replays them (the same body, `_draft_levels`,
    over the persistent buffers; padding rows write no K/V); None: eagerly for the 3 requests."""
    speculator = _drafting_speculator(monkeypatch, widths, graph_size)
    tree = speculator.tree
    # a tree row (1 + N tokens, 2 accepted: nodes 0 then its first child; a depth-1 tree: node 0), a one-token
    # decode, a tree row (none)
    block = 1 + tree.num_nodes
    batch = v2_batch([block, 1, block], [tree.num_nodes, 0, tree.num_nodes], [False] * 3, [20, 9, 60])
    step = v2_runner.find_tree_step_v2(tree, batch)
    override_positions(batch.positions, step)
    path = [0, tree.parents.index(0)] if tree.max_depth > 1 else [0]
    accepted_nodes = torch.full((2, tree.max_depth), -1)
    accepted_nodes[0, : len(path)] = torch.tensor(path)
    acceptance = SimpleNamespace(accepted_nodes=accepted_nodes)
    speculator.tree_state.accepted = (step, acceptance)
    num_tokens = batch.positions.numel()
    batch.input_ids = torch.arange(num_tokens, dtype=torch.int32) % VOCAB
    batch.seq_lens_cpu_upper_bound = torch.tensor([20 + block, 10, 60 + block], dtype=torch.int32)
    hidden = torch.randn(num_tokens, HIDDEN, generator=torch.Generator().manual_seed(1))
    batch = dataclasses.make_dataclass("FakeInputBatch", list(vars(batch)))(**vars(batch))  # V2's is a dataclass
    num_rejected = torch.tensor([tree.num_nodes - len(path), 0, tree.num_nodes])
    last_sampled = torch.tensor([11, 12, 13])
    treed = {"attn": with_tree(FakeMetadata(block), tree_qq_bias=torch.zeros(1))}
    drafts = speculator.propose(batch, treed, None, hidden, None, None, num_rejected, last_sampled, None, None, None,
                                num_speculative_tokens=tree.num_nodes)
    (num_spec, first_metadata), = speculator.first_pass_calls
    assert num_spec == 1 and tree_qq_bias_of(first_metadata["attn"]) is None  # V2's own first pass, causal
    # the first pass saw tree row 0's accepted path as a chain: its last row is block index len(path) <- path[-1]
    last_rows, root_positions = speculator.first_pass_roots
    assert last_rows == [len(path), block, block + 1 + 0]
    chain_hidden = {0: hidden[1 + path[-1]], 1: hidden[block], 2: hidden[block + 1]}  # 1 + node index
    chain_positions = {0: 20 + len(path), 1: 9, 2: 60}
    assert root_positions == [chain_positions[r] for r in range(3)]
    for r in range(3):
        assert drafts[r].tolist() == reference_tree(speculator.head, int(last_sampled[r]), chain_hidden[r], widths)
    if len(widths) > 1:  # a depth-1 tree has no levels: the first pass's top-w1 is the tree
        assert_roots(speculator, last_sampled, torch.stack([chain_hidden[r] for r in range(3)]),
                     [chain_positions[r] for r in range(3)], graph_size)
    # one eager forward per level below the leaves, each with the level tree's bias and KV slots P0 + block index
    assert len(speculator.level_metadata) == len(widths) - 1
    for (metadata, _), slots, level in zip(speculator.level_metadata, speculator.level_slots,
                                           v2_speculator.level_trees(widths)):
        assert tree_qq_bias_of(metadata["mtp.attn"]).shape[1] == 1 + level.num_nodes
        level_block = 1 + level.num_nodes
        expected = torch.cat([torch.arange(p, p + level_block) for p in (chain_positions[0], 9, 60)])
        table = speculator.block_tables.input_block_tables[0]
        rows = torch.arange(3).repeat_interleave(level_block)
        assert slots[0, : 3 * level_block].tolist() == (table[rows, expected // 16].long() * 16
                                                         + expected % 16).tolist()
        assert slots.shape[1] == (graph_size or 3) * level_block
        assert (slots[0, 3 * level_block :] == PADDING_SLOT).all()  # graph padding writes no K/V


@pytest.mark.parametrize("graph_size", [None, 5])
def test_a_step_without_tree_acceptance_drafts_from_v2s_hidden_states(monkeypatch, graph_size):
    """The first step after prefills (no tree acceptance): the first pass reads V2's own inputs and hidden states,
    and the levels the roots' hidden states, which `propose` copies into the chain buffer (whose other rows are
    stale) for the levels' body to read."""
    widths = [2, 2, 1]
    speculator = _drafting_speculator(monkeypatch, widths, graph_size)
    query_lens = [4, 1, 3]
    batch = v2_batch(query_lens, [0, 0, 0], [False] * 3, [20, 9, 60])
    num_tokens = batch.positions.numel()
    batch.input_ids = torch.arange(num_tokens, dtype=torch.int32) % VOCAB
    batch.seq_lens_cpu_upper_bound = torch.tensor([24, 10, 63], dtype=torch.int32)
    batch = dataclasses.make_dataclass("FakeInputBatch", list(vars(batch)))(**vars(batch))
    hidden = torch.randn(num_tokens, HIDDEN, generator=torch.Generator().manual_seed(1))
    last_sampled = torch.tensor([11, 12, 13])
    drafts = speculator.propose(batch, {}, None, hidden, None, None, torch.zeros(3, dtype=torch.long), last_sampled,
                                None, None, None, num_speculative_tokens=TREE.num_nodes)
    last_rows = (np.cumsum(query_lens) - 1).tolist()
    assert speculator.first_pass_roots == (last_rows, [23, 9, 62])
    for r, row in enumerate(last_rows):
        assert drafts[r].tolist() == reference_tree(speculator.head, int(last_sampled[r]), hidden[row], widths)
    # the roots' inputs the levels rewrite the roots' K/V with (the stand-in's head has no attention to show them)
    assert_roots(speculator, last_sampled, hidden[last_rows], [23, 9, 62], graph_size)


def assert_roots(speculator, tokens, hidden, positions, graph_size):
    bufs = speculator._tree_buffers()
    num_reqs = len(positions)
    assert bufs.root_tokens[:num_reqs].tolist() == tokens.tolist()
    assert torch.equal(bufs.root_hidden[:num_reqs], hidden)
    assert bufs.root_positions[:num_reqs].tolist() == positions and bufs.valid[:num_reqs].all()
    if graph_size is not None:  # padding rows
        assert (bufs.root_positions[num_reqs:graph_size] == 0).all() and not bufs.valid[num_reqs:graph_size].any()


def test_tree_speculator_runs_chains_as_vllm():
    spec = SimpleNamespace(is_draft_tree=False, num_speculative_tokens=3)
    speculator = v2_speculator.make_tree_speculator_class(FakeV2Speculator)(
        v2_config(spec), torch.device("cpu"))
    assert speculator.tree_state is None
    batch = v2_batch([4], [3], [False], [10])
    speculator.propose(batch, {}, None, torch.zeros(4, HIDDEN), None, None, torch.tensor([1]), torch.tensor([5]),
                       None, None, None, num_speculative_tokens=3)
    assert speculator.first_pass_calls[0][0] == 3


def test_tree_state_is_bound_for_the_runner_call_only():
    """The model state's hook finds the tree state through the runner call in progress; nothing is kept after it."""
    seen = []

    class Runner:
        speculator = SimpleNamespace(tree_state=v2_run_state.TreeRunStateV2(DraftTree.from_widths([2, 1])))

        def execute_model(self, *args):
            seen.append(v2_runner._CALL_TREE_STATE.get())
            raise RuntimeError("a failing step still unbinds")

    wrapped = v2_runner._binding_tree_state(Runner.execute_model)
    with pytest.raises(RuntimeError):
        wrapped(Runner())
    assert seen == [Runner.speculator.tree_state] and v2_runner._CALL_TREE_STATE.get() is None
    assert not any(isinstance(v, dict) and v for module in (v2_runner, v2_sampler, v2_speculator)
                   for k, v in vars(module).items() if k.isupper())


def test_level_budget_that_could_overflow_is_refused_at_startup():
    v2_speculator.check_level_budget([2, 2, 1], 64, 64 * 7)  # deepest level: root + 6 nodes above the leaves
    with pytest.raises(ValueError, match=r"max_num_batched_tokens to >= 455 or lower max_num_seqs to <= 64"):
        v2_speculator.check_level_budget([2, 2, 1], 65, 64 * 7)


def _tree_speculator(widths, batch_sharded_sampling=False):
    tree = DraftTree.from_widths(widths)
    spec = SimpleNamespace(is_draft_tree=True, draft_tree=tree, draft_tree_widths=widths,
                           num_speculative_tokens=tree.num_nodes, enable_adaptive_verification=False,
                           uses_dynamic_speculative_decoding=lambda: False)
    return v2_speculator.make_tree_speculator_class(FakeV2Speculator)(
        v2_config(spec, batch_sharded_sampling), torch.device("cpu"))


def test_batch_sharded_sampling_is_refused_at_start_up():
    with pytest.raises(NotImplementedError, match="batch-sharded sampling"):
        _tree_speculator([2, 1], batch_sharded_sampling=True)


def test_level_graphs_are_captured_per_padded_size_of_v2s_first_pass_graphs(monkeypatch):
    """The capture wrapper's host side (CPU cannot capture): one graph of the levels' body per padded request count
    of V2's FULL first-pass graphs, recorded as V2 records its own (its pool, the capture stream), after a warm-up;
    padding rows write no K/V; the host bound restored; nothing captured inside V2's graph-memory profiling."""
    import contextlib

    import vllm.compilation.cudagraph_pool as cudagraph_pool
    import vllm.distributed.parallel_state as parallel_state
    from vllm.config.compilation import CUDAGraphMode
    from vllm.v1.worker.gpu.cudagraph_utils import BatchExecutionDescriptor

    import vllm.v1.attention.backends.triton_attn as triton_attn

    monkeypatch.setattr(triton_attn, "TritonAttentionMetadata", FakeMetadata)
    monkeypatch.setattr("vllm.v1.worker.gpu.attn_utils.build_slot_mappings_by_layer", lambda slots, config: slots)
    recording = []

    @contextlib.contextmanager
    def fake_graph(graph, pool, stream=None):
        recording.append(graph)
        yield
        recording.pop()

    bodies = []
    monkeypatch.setattr(torch.cuda, "CUDAGraph", lambda: SimpleNamespace(replay=lambda: None))
    monkeypatch.setattr(torch.cuda, "graph", fake_graph)
    monkeypatch.setattr(cudagraph_pool, "capture_pool", lambda pool, config: contextlib.nullcontext(pool))
    monkeypatch.setattr(parallel_state, "graph_capture", lambda device: contextlib.nullcontext())
    monkeypatch.setattr("vllm.utils.torch_utils.current_stream", lambda: None)
    speculator = _tree_speculator([2, 2, 1])
    speculator.vllm_config = None
    original = speculator._draft_levels
    monkeypatch.setattr(speculator, "_draft_levels",
                        lambda n, inputs: (bodies.append((n, bool(recording))), original(n, inputs))[1])
    full = [BatchExecutionDescriptor(cg_mode=CUDAGraphMode.FULL, num_tokens=11 * n, num_reqs=n) for n in (1, 8)]
    speculator.prefill_cudagraph_manager = SimpleNamespace(
        cudagraph_mode=CUDAGraphMode.FULL_AND_PIECEWISE, pool="v2's pool", _capture_descs={CUDAGraphMode.FULL: full})
    speculator.draft_max_seq_len = 77
    speculator.tree_state.profiling_capture = True
    speculator._capture_levels()
    assert speculator._level_graphs == {} and bodies == []
    speculator.tree_state.profiling_capture = False
    speculator._capture_levels()
    assert sorted(speculator._level_graphs) == [1, 8]
    assert bodies == [(8, False), (8, True), (1, False), (1, True)]  # warm-up, then the captured body
    assert speculator.draft_max_seq_len == 77
    # captured with PAD slots
    assert (speculator._tree_buffers().slots[0, : 8 * 7] == PADDING_SLOT).all()
    assert speculator._level_graph_size(1) == 1 and speculator._level_graph_size(3) == 8
    assert speculator._level_graph_size(9) is None  # eager above the captured sizes


@pytest.mark.parametrize("widths", [[2, 2, 1], [3, 2]])
def test_the_level_graphs_body_reads_only_what_outlives_the_graph(monkeypatch, widths):
    """Every tensor the levels' body reads and did not make is held by the speculator (its buffers, block tables,
    input buffers, constants, the tree state's biases) or by the level inputs the graph is stored with: a graph keeps
    addresses, not tensors, so a read of a tensor that a bounded cache may free later (an LRU of aranges: the soak's
    fault, bench/results/soak) makes a replay read freed memory."""
    import vllm.v1.attention.backends.triton_attn as triton_attn

    monkeypatch.setattr(triton_attn, "TritonAttentionMetadata", FakeMetadata)
    monkeypatch.setattr("vllm.v1.worker.gpu.attn_utils.build_slot_mappings_by_layer", lambda slots, config: slots)
    speculator = _tree_speculator(widths)
    size = 4
    inputs = speculator._level_inputs(size, torch.full((size,), 1024, dtype=torch.int32))
    speculator._draft_levels(size, inputs)  # the warm-up builds what the capture then reads
    outside = reads_from_outside(lambda: speculator._draft_levels(size, inputs))
    assert outside - held_storages(speculator, inputs) == set()


def test_profiling_flag_follows_vllms_profiling_calls():
    state = v2_run_state.TreeRunStateV2(DraftTree.from_widths([2, 1]))
    seen = []

    class Runner:
        speculator = SimpleNamespace(tree_state=state)

        def capture_model(self, *, profile_only=False):
            seen.append(("capture", state.profiling_capture))

        def profile_cudagraph_memory(self):
            seen.append(("profile", state.profiling_capture))
            capture(self, profile_only=True)
            seen.append(("after inner", state.profiling_capture))

    capture = v2_runner._binding_tree_state(Runner.capture_model)
    profile = v2_runner._binding_tree_state(Runner.profile_cudagraph_memory)
    profile(Runner())
    capture(Runner())
    assert seen == [("profile", True), ("capture", True), ("after inner", True), ("capture", False)]
    assert state.profiling_capture is False


# -- draft_tree_max_batch_size: V2's own chain of the tree's depth at larger batches ------------------------------

def _threshold_speculator(widths=WIDTHS, threshold=2):
    tree = DraftTree.from_widths(widths)
    spec = SimpleNamespace(is_draft_tree=True, draft_tree=tree, draft_tree_widths=widths,
                           num_speculative_tokens=tree.num_nodes, enable_adaptive_verification=False,
                           uses_dynamic_speculative_decoding=lambda: True, draft_tree_max_batch_size=threshold,
                           draft_tree_depth=len(widths))
    return v2_speculator.make_tree_speculator_class(FakeV2Speculator)(v2_config(spec), torch.device("cpu"))


def test_dynamic_speculative_decoding_is_refused_unless_the_threshold_sets_it():
    with pytest.raises(NotImplementedError, match="dynamic speculative decoding"):
        _threshold_speculator(threshold=None)
    assert _threshold_speculator().tree_state.chain_depth == len(WIDTHS)


def test_a_step_of_chains_has_no_tree_rows_on_v2():
    depth = len(WIDTHS)
    assert v2_runner.find_tree_step_v2(TREE, v2_batch([4, 2], [3, 1], [False, False], [12, 30]),
                                            chain_depth=depth) is None
    with pytest.raises(RuntimeError, match=r"chains of \[3\] drafts beside 10-node draft trees"):
        v2_runner.find_tree_step_v2(TREE, v2_batch([L, 4], [N, 3], [False, False], [12, 30]), chain_depth=depth)


def test_tree_speculator_drafts_v2s_chain_when_asked_for_the_depth(monkeypatch):
    """After a tree step, a larger batch's step asks for D = 3 drafts: V2's own speculator drafts the chain (its first
    pass over tree row 0's accepted path laid out as a chain, causal), no drafting level runs, and what V2's
    speculator returns goes back to the runner (which pads the drafts past D with -1)."""
    speculator = _threshold_speculator()
    block = L
    batch = v2_batch([block, 1], [N, 0], [False, False], [20, 9])
    step = v2_runner.find_tree_step_v2(TREE, batch)
    override_positions(batch.positions, step)
    first_child = TREE.parents.index(0)
    accepted_nodes = torch.full((1, TREE.max_depth), -1)
    accepted_nodes[0, :2] = torch.tensor([0, first_child])
    speculator.tree_state.accepted = (step, SimpleNamespace(accepted_nodes=accepted_nodes))
    num_tokens = batch.positions.numel()
    batch.input_ids = torch.arange(num_tokens, dtype=torch.int32) % VOCAB
    batch.seq_lens_cpu_upper_bound = torch.tensor([20 + block, 10], dtype=torch.int32)
    batch = dataclasses.make_dataclass("FakeInputBatch", list(vars(batch)))(**vars(batch))
    hidden = torch.randn(num_tokens, HIDDEN, generator=torch.Generator().manual_seed(1))
    treed = {"attn": with_tree(FakeMetadata(block), tree_qq_bias=torch.zeros(1))}
    speculator.draft_tokens[:2] = torch.arange(2 * N).view(2, N)  # what V2's speculator drafted
    drafts = speculator.propose(batch, treed, None, hidden, None, None, torch.tensor([N - 2, 0]),
                                torch.tensor([11, 12]), None, None, None, num_speculative_tokens=len(WIDTHS))
    (num_spec, first_metadata), = speculator.first_pass_calls
    assert num_spec == len(WIDTHS) and tree_qq_bias_of(first_metadata["attn"]) is None
    assert speculator.first_pass_roots == ([2, block], [22, 9])  # the accepted path's last token at depth 2
    assert speculator.level_metadata == [] and speculator.tree_state.accepted is None
    assert drafts.data_ptr() == speculator.draft_tokens.data_ptr() and drafts.shape == (2, N)
