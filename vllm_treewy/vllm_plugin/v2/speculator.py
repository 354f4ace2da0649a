"""The MTP drafter of draft trees on Model Runner V2 (installed by `v2.runner.install`; the runner's hooks
are in `v2.runner`, the acceptance in `v2.sampler`).

V2 builds it in `init_speculator` from `spec_decode.mtp.speculator.MTPSpeculator`
(V2_MTP_SPECULATOR, rebound to `TreeMtpSpeculatorV2`, vLLM's class unchanged for chains). Per step: V2's own first
pass (`propose` with one draft, FULL graphs included) over the verified tokens with each tree row's accepted path
laid out as a chain (`kernels.accepted_chains_*`, into persistent buffers: `ChainInputBuffers`), on attention
metadata without the tree, whose logits give the root's children (`sample_draft`: one output-layer read per level,
as a chain reads one per draft); then the drafting levels: one head forward per level over every request's level
block, with the level tree on the attention metadata (TRITON_ATTN's bias or FLASH_ATTN's ancestor table,
`trees.attention.uniform_tree_marking`), depth positions and KV slots P0 + block index. The levels are one function,
`_draft_levels`, over persistent buffers (`TreeLevelBuffers`): static shapes, no host sync, so the same body runs
eagerly or as a CUDA graph captured per padded request count of V2's FULL first-pass graphs, in V2's capture phase
(`_capture_levels`; the body itself fills the root buffers from what the first pass left in persistent buffers, so
`propose` only replays). Batches above the captured sizes (or without FULL graphs) run the body eagerly. Every
request drafts at once (no request chunks on V2): a max_num_seqs x (1 + nodes above the leaves) over
max_num_batched_tokens is refused at start-up (`check_level_budget`).

With `draft_tree_max_batch_size`, V2's dynamic speculative decoding asks for the tree's depth D drafts at larger
batches (`num_speculative_tokens`): then the speculator is V2's own chain speculator for D steps (after a tree step
over the accepted paths laid out as chains; V2 captures its decode graphs per draft count under dynamic speculative
decoding), and the runner pads the drafts past D with -1. The level graphs serve the tree steps.

Its `TreeRunStateV2` (`tree_state`) is the state the runner's hooks carry across calls (`v2.runner`).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import numpy as np
import torch

from vllm_treewy.kernels.accepted_chains_torch import accepted_chains_torch
from vllm_treewy.kernels.accepted_chains_triton import accepted_chains_triton
from vllm_treewy.kernels.bookkeeping import dispatch
from vllm_treewy.kernels.level_inputs_torch import level_inputs_torch
from vllm_treewy.kernels.level_inputs_triton import level_inputs_triton
from vllm_treewy.spec_decode.tree_drafting import level_trees, nodes_below_depth
from vllm_treewy.vllm_plugin.config import draft_shape_of
from vllm_treewy.vllm_plugin.trees.attention import uniform_tree_marking
from vllm_treewy.vllm_plugin.trees.drafting import PADDING_SLOT, kv_slots, top_children
from vllm_treewy.vllm_plugin.trees.metadata import (
    replace_metadata,
    tree_block_ancestors_of,
    tree_prefix_lens_of,
    tree_qq_bias_of,
    tree_step_of,
    with_tree,
)
from vllm_treewy.vllm_plugin.trees.step import TreeConstants, TreeStep
from vllm_treewy.vllm_plugin.trees.synthetic import SyntheticTreeRates
from vllm_treewy.vllm_plugin.v2.accept_graphs import capture_graph, full_graph_sizes, smallest_graph_size
from vllm_treewy.vllm_plugin.v2.run_state import TreeRunStateV2


# -- the MTP drafter -------------------------------------------------------------------------------------------

def _strip_tree(attn_metadata):
    """A copy of V2's per-layer metadata dict without the tree (the drafter's first pass attends causally)."""
    if not isinstance(attn_metadata, dict):
        return attn_metadata
    stripped = dict(attn_metadata)
    replace_metadata(stripped, lambda name, m: with_tree(m, tree_step=None, tree_qq_bias=None,
                                                        tree_block_ancestors=None, tree_prefix_lens=None)
                     if any(of(m) is not None for of in (tree_step_of, tree_qq_bias_of, tree_block_ancestors_of,
                                                         tree_prefix_lens_of))
                     else None)
    return stripped  # layers that share one metadata object share its copy


def check_level_budget(widths, max_num_seqs: int, max_num_batched_tokens: int) -> None:
    """Start-up refusal: on V2 the drafting levels run every request of a batch at once (no request chunks, so that
    their graphs have static shapes), and the deepest level forwards 1 + (nodes above the leaves) tokens per request
    for every request, including requests that verified one token this step. So max_num_seqs such blocks must fit
    the token budget that sizes the head's buffers."""
    widest = 1 + nodes_below_depth(list(widths))[-2]
    if max_num_seqs * widest > max_num_batched_tokens:
        raise ValueError(
            f"draft_tree_widths={list(widths)} on Model Runner V2: max_num_seqs={max_num_seqs} requests x {widest} "
            f"tokens of the deepest drafting level exceed max_num_batched_tokens={max_num_batched_tokens}; raise "
            f"max_num_batched_tokens to >= {max_num_seqs * widest} or lower max_num_seqs to <= "
            f"{max_num_batched_tokens // widest} (the V1 runner drafts such batches in request chunks)")


@dataclass
class ChainInputBuffers:
    """The first pass's inputs with each tree row's accepted path laid out as a chain (`kernels.accepted_chains_*`
    writes them; the first pass reads views): persistent, so that the level graphs read the roots' hidden states
    from them by address. Sized like V2's own buffers (max_num_batched_tokens rows) and allocated with them, before
    V2 measures the memory the KV cache may take."""

    input_ids: torch.Tensor  # [max_tokens] in V2's input ids' dtype
    positions: torch.Tensor  # [max_tokens] in V2's positions' dtype
    hidden_states: torch.Tensor  # [max_tokens, H] the target's hidden states as the first pass reads them

    @classmethod
    def like(cls, input_buffers, hidden_states: torch.Tensor) -> ChainInputBuffers:
        return cls(torch.zeros_like(input_buffers.input_ids), torch.zeros_like(input_buffers.positions),
                   torch.zeros_like(hidden_states))


@dataclass
class TreeLevelBuffers:
    """The drafting levels' persistent inputs and outputs on the device (one set per tree speculator): what a level
    graph reads and writes, so that eager runs and replays see the same addresses. The root rows are written by the
    levels' body itself (`_draft_levels`), from buffers that persist too."""

    root_positions: torch.Tensor  # [max_reqs] int64 each root's position (its last accepted token's)
    root_tokens: torch.Tensor  # [max_reqs] the root's input token (the bonus), in the input ids' dtype
    root_hidden: torch.Tensor  # [max_reqs, H] the target's hidden state at the root
    valid: torch.Tensor  # [max_reqs] bool: a real request (padding rows write no K/V)
    outputs: torch.Tensor  # [max_reqs, 1 + nodes above the leaves, H] head outputs per verified-block index
    slots: torch.Tensor  # [groups, max_tokens] int64 the level's KV slots (the head's slot mappings are views)

    @classmethod
    def allocate(cls, max_reqs, widest, hidden_size, dtype, id_dtype, num_groups, max_tokens, device):
        def zeros(*shape, dtype=dtype):
            return torch.zeros(*shape, dtype=dtype, device=device)

        return cls(zeros(max_reqs, dtype=torch.long), zeros(max_reqs, dtype=id_dtype), zeros(max_reqs, hidden_size),
                   zeros(max_reqs, dtype=torch.bool), zeros(max_reqs, widest, hidden_size),
                   torch.full((num_groups, max_tokens), PADDING_SLOT, dtype=torch.long, device=device))


def make_tree_speculator_class(base):
    """V2's MTP speculator with MTP draft trees (module docstring); chains run `base` unchanged."""

    class TreeMtpSpeculatorV2(base):
        def __init__(self, vllm_config, device):
            super().__init__(vllm_config, device)
            shape = draft_shape_of(vllm_config.speculative_config)  # the speculator's one read of the tree shape
            tree = shape.tree
            self.tree = tree
            self.tree_state = TreeRunStateV2(tree) if tree is not None else None
            self._first_pass = False  # inside `_prefill`: a tree engine's `sample_draft` gives the root's children
            if tree is None:
                return
            spec = vllm_config.speculative_config
            self.tree_state.synthetic = SyntheticTreeRates.of(spec, self.max_num_reqs, device)
            # dynamic speculative decoding: only the schedule draft_tree_max_batch_size sets (tree or chain per step)
            if spec.enable_adaptive_verification or (spec.uses_dynamic_speculative_decoding()
                                                     and not shape.has_chain_steps):
                raise NotImplementedError("draft_tree_widths on Model Runner V2: adaptive verification and dynamic "
                                          "speculative decoding change the drafts per request (a tree is static)")
            if shape.has_chain_steps:
                self.tree_state.chain_depth = spec.draft_tree_depth
            if vllm_config.parallel_config.enable_batch_sharded_sampling:
                raise NotImplementedError("draft_tree_widths on Model Runner V2: batch-sharded sampling is not "
                                          "supported (the tree's acceptance reads every node's draw of the batch)")
            self.widths = list(spec.draft_tree_widths)
            self.levels = level_trees(self.widths)
            self.nodes_below = nodes_below_depth(self.widths)
            check_level_budget(self.widths, self.max_num_reqs, self.max_num_tokens)
            self._bufs: TreeLevelBuffers | None = None  # allocated at first use (the block tables come with set_attn)
            self._chains = ChainInputBuffers.like(self.input_buffers, self.hidden_states)
            # [max_reqs, N] int64 the drafted trees in node order: the first pass writes the root's children (V2 runs
            # it before the block tables exist, at profiling), the levels the rest; graphs keep its address
            self.tree_tokens = torch.zeros(self.max_num_reqs, tree.num_nodes, dtype=torch.long, device=device)
            self._level_graphs: dict[int, tuple] = {}  # padded request count -> (CUDA graph, its level inputs)
            self._level_constants: dict[int, TreeConstants] = {}

        def propose(self, input_batch, attn_metadata, slot_mappings, last_hidden_states, aux_hidden_states,
                    num_sampled, num_rejected, last_sampled, next_prefill_tokens, temperature, seeds, *args,
                    dummy_run=False, num_speculative_tokens=None, **kwargs):
            call = functools.partial(super().propose, *args, dummy_run=dummy_run, **kwargs)
            if self.tree is None or dummy_run or num_speculative_tokens == 0:
                return call(input_batch, attn_metadata, slot_mappings, last_hidden_states, aux_hidden_states,
                            num_sampled, num_rejected, last_sampled, next_prefill_tokens, temperature, seeds,
                            num_speculative_tokens=num_speculative_tokens)
            accepted, self.tree_state.accepted = self.tree_state.accepted, None
            hidden = last_hidden_states
            if accepted is not None:
                input_batch, hidden = self._accepted_chains(input_batch, last_hidden_states, *accepted)
            if num_speculative_tokens is not None and num_speculative_tokens < self.tree.num_nodes:
                # a larger batch's chain (draft_tree_max_batch_size): V2's own speculator for that many steps
                return call(input_batch, _strip_tree(attn_metadata), slot_mappings, hidden, aux_hidden_states,
                            num_sampled, num_rejected, last_sampled, next_prefill_tokens, temperature, seeds,
                            num_speculative_tokens=num_speculative_tokens)
            call(input_batch, _strip_tree(attn_metadata), slot_mappings, hidden, aux_hidden_states, num_sampled,
                 num_rejected, last_sampled, next_prefill_tokens, temperature, seeds, num_speculative_tokens=1)
            num_reqs = input_batch.num_reqs
            if accepted is None and self.levels:
                # No tree acceptance this step (the first step after a prefill, say): the first pass read V2's hidden
                # states, whose address need not outlive the step, so the levels (which read the roots' hidden states
                # from the chain buffer, `_draft_levels`) get the roots' rows copied there; the rest of the batch's
                # rows are never read, and copying every row would move num_tokens x H instead of num_reqs x H.
                last_rows = self.last_token_indices[:num_reqs]
                self._chains.hidden_states.index_copy_(0, last_rows, hidden.index_select(0, last_rows))
            graph_size = self._level_graph_size(num_reqs)
            if graph_size is None:
                upper = input_batch.seq_lens_cpu_upper_bound[:num_reqs]
                self.draft_max_seq_len = min(int(upper.max()) + self.tree.num_nodes, self.max_model_len)
                self._draft_levels(num_reqs, self._level_inputs(num_reqs, upper))
            else:
                self._level_graphs[graph_size][0].replay()
            self.draft_tokens[:num_reqs] = self.tree_tokens[:num_reqs]
            return self.draft_tokens[:num_reqs]

        def _accepted_chains(self, input_batch, last_hidden_states, step: TreeStep, acceptance):
            """The batch with each tree row's accepted path laid out as a chain (one launch on CUDA) in the chain
            buffers, and its hidden states there: what the first pass reads."""
            num_tokens = input_batch.input_ids.shape[0]
            chains = self._chains
            ids, positions = chains.input_ids[:num_tokens], chains.positions[:num_tokens]
            hidden = chains.hidden_states[:num_tokens]
            write = accepted_chains_triton if dispatch.launches_triton(hidden) else accepted_chains_torch
            write(step.token_indices.view(step.num_requests, step.block_len), acceptance.accepted_nodes,
                  step.root_positions, input_batch.input_ids, input_batch.positions, last_hidden_states, ids,
                  positions, hidden)
            return dataclasses.replace(input_batch, input_ids=ids, positions=positions), hidden

        # -- the first pass: the root's children from its logits ---------------------------------------------------
        def _prefill(self, num_reqs, *args, **kwargs):
            """V2's first pass (head forward over the verified tokens, logits and draft at each request's last
            token; eager or inside V2's FULL prefill graphs, which record this method), with `sample_draft` giving
            the root's children: the pass's one output-layer read serves the tree's first level."""
            self._first_pass = True
            try:
                return super()._prefill(num_reqs, *args, **kwargs)
            finally:
                self._first_pass = False

        def sample_draft(self, hidden_states, sample_src_positions, idx_mapping, temperature, seeds, draft_step,
                         draft_logits, spec_step_idx=0):
            """In a tree's first pass: the top-w1 tokens of the head's logits at each request's last token into
            the tree buffers (the root's children, `_draft_levels`' first level, most likely first), and the most
            likely as V2's first draft (greedy drafts: `config` refuses probabilistic draft sampling and the local
            argmax reduction, which never form the logits, for trees). Elsewhere (chain steps' later drafts,
            chain engines) V2's own. Static shapes: V2's prefill graphs capture it."""
            if self.tree is None or not self._first_pass:
                return super().sample_draft(hidden_states, sample_src_positions, idx_mapping, temperature, seeds,
                                            draft_step, draft_logits, spec_step_idx)
            num_reqs = hidden_states.shape[0]
            logits = self.compute_draft_logits(hidden_states, spec_step_idx)
            children = top_children(logits, self.widths[0]).view(num_reqs, -1)
            self.tree_tokens[:num_reqs, : self.widths[0]] = children
            return children[:, 0]

        # -- the drafting levels: one body, run eagerly or captured per padded request count ----------------------
        def _tree_buffers(self) -> TreeLevelBuffers:
            if self._bufs is None:
                self._bufs = TreeLevelBuffers.allocate(
                    self.max_num_reqs, 1 + self.nodes_below[-2], self.hidden_states.shape[-1],
                    self.hidden_states.dtype, self.input_buffers.input_ids.dtype,
                    len(self.block_tables.input_block_tables), self.max_num_tokens, self.hidden_states.device)
            return self._bufs

        def _level_inputs(self, num_reqs: int, upper_bound) -> list:
            """Host side of every level for `num_reqs` (padded) requests: V2's attention metadata over the input
            buffers (query layout and lengths the body writes), with the level tree's bias, and the level's KV slot
            mappings per layer (views of the persistent slot buffer). Built per step eagerly, once per graph."""
            # V2's modules looked up at call time, where V2 runs (CUDA; tests stand them in)
            from vllm.config.compilation import CUDAGraphMode
            from vllm.v1.worker.gpu.attn_utils import build_slot_mappings_by_layer
            from vllm.v1.worker.gpu.cudagraph_utils import BatchExecutionDescriptor

            bufs = self._tree_buffers()
            inputs = []
            for tree in self.levels:
                block_len = 1 + tree.num_nodes
                num_tokens = num_reqs * block_len
                query_start_loc_np = np.arange(num_reqs + 1, dtype=np.int32) * block_len
                slots = bufs.slots[:, :num_tokens]
                desc = BatchExecutionDescriptor(cg_mode=CUDAGraphMode.NONE, num_tokens=num_tokens, num_reqs=num_reqs)
                attn_metadata = self._build_attn_metadata(num_reqs, desc, query_start_loc_np, upper_bound,
                                                          self.tree.num_nodes, slot_mappings=slots)
                # every request a row of the level's tree: the TRITON_ATTN bias or the FLASH_ATTN ancestor table
                replace_metadata(attn_metadata, uniform_tree_marking(self.tree_state, tree, self.device))
                inputs.append((attn_metadata, build_slot_mappings_by_layer(slots, self.kv_cache_config)))
            return inputs

        def _draft_levels(self, num_reqs: int, level_inputs: list) -> None:
            """Every request's tree into `tree_tokens[:num_reqs]`, from what the first pass left: device ops of
            static shapes only (no host sync, no allocation that depends on data), so that the same function runs
            eagerly and inside a CUDA graph. `level_inputs`: `_level_inputs(num_reqs, ...)`. `num_reqs` may exceed
            the batch's requests (a graph's padded count): the rows past them are padding."""
            # tokens[:, :w1], the root's children, are the first pass's (`sample_draft`)
            if not self.levels:  # a depth-1 tree: the first pass's top-w1 is the whole tree
                return
            bufs = self._tree_buffers()
            buffers = self.input_buffers
            widest = 1 + self.nodes_below[-2]
            root_positions = bufs.root_positions[:num_reqs]
            tokens, outputs = self.tree_tokens[:num_reqs], bufs.outputs[:num_reqs]
            # The roots' inputs as the first pass had them (their K/V is rewritten with the same values), read from
            # buffers whose addresses persist: the bonus token and the target's hidden state at each request's last
            # accepted token (V2's last_token_indices; the hidden state from the chain buffer, `propose`); the root's
            # output, the first pass's head output there, and its position (V2's _prefill leaves them at
            # hidden_states[:num_reqs] and positions[:num_reqs]). V2's first-pass inputs pad seq_lens with 0 past the
            # batch's requests (for its graphs): those rows are padding, which write no K/V (PAD slots) and read
            # position 0. Read before the first level rewrites seq_lens and the input buffers.
            last_rows = self.last_token_indices[:num_reqs]
            valid = torch.gt(buffers.seq_lens[:num_reqs], 0, out=bufs.valid[:num_reqs])
            torch.mul(buffers.positions[:num_reqs], valid, out=root_positions)
            torch.index_select(buffers.input_ids, 0, last_rows, out=bufs.root_tokens[:num_reqs])
            torch.index_select(self._chains.hidden_states, 0, last_rows, out=bufs.root_hidden[:num_reqs])
            outputs[:, 0] = self.hidden_states[:num_reqs]
            # The deepest level's block: every level's block is a prefix of it (KV slots once per step).
            offsets = torch.arange(widest, device=self.device)
            block_positions = root_positions[:, None] + offsets
            slots = [torch.where(valid[:, None], kv_slots(table[:num_reqs], block_positions, size, self.max_model_len),
                                 PADDING_SLOT)
                     for table, size in zip(self.block_tables.input_block_tables, self.block_tables.block_sizes)]
            write_inputs = level_inputs_triton if dispatch.launches_triton(root_positions) else level_inputs_torch
            for level, (tree, (attn_metadata, slot_mappings)) in enumerate(zip(self.levels, level_inputs), start=1):
                first, last = self.nodes_below[level - 1], self.nodes_below[level]  # this level's nodes [first, last)
                block_len = 1 + tree.num_nodes
                num_tokens = num_reqs * block_len
                constants = self.tree_constants(tree)
                # the level block's ids, hidden inputs, depth positions, query starts and lengths (one launch on CUDA)
                write_inputs(bufs.root_tokens[:num_reqs], bufs.root_hidden[:num_reqs], tokens[:, :last], outputs,
                             constants.parent_blocks, constants.depths, root_positions, self.max_model_len - 1,
                             buffers.input_ids[:num_tokens], self.hidden_states[:num_tokens],
                             buffers.positions[:num_tokens], buffers.query_start_loc[: num_reqs + 1],
                             buffers.seq_lens[:num_reqs])
                for group, group_slots in enumerate(slots):
                    bufs.slots[group, :num_tokens].view(num_reqs, block_len).copy_(group_slots[:, :block_len])
                hidden, _ = self._run_model(num_tokens, attn_metadata, slot_mappings, None)
                output = hidden[:num_tokens].view(num_reqs, block_len, -1)
                outputs[:, 1 + first : 1 + last] = output[:, 1 + first :]
                logits = self.model.compute_logits(output[:, 1 + first :].reshape(-1, output.shape[-1]))
                tokens[:, last : self.nodes_below[level + 1]] = top_children(logits, self.widths[level]).view(
                    num_reqs, -1)

        def _level_graph_size(self, num_reqs: int) -> int | None:
            """The captured padded request count that serves `num_reqs` (None: run the levels eagerly)."""
            return smallest_graph_size(self._level_graphs, num_reqs)

        def capture(self):
            if self.tree_state is None:
                return super().capture()
            self.tree_state.capturing_drafter = True
            try:
                super().capture()
            finally:
                self.tree_state.capturing_drafter = False
            self._capture_levels()

        @torch.inference_mode()
        def _capture_levels(self) -> None:
            """One CUDA graph of `_draft_levels` per padded request count of V2's FULL first-pass graphs (the same
            batch sizes; captured in V2's capture phase, into V2's graph pool). Captured with PAD slots (no K/V
            written) and the lengths' host bound at max_model_len, which every replay stays within. The body reads only
            what outlives its graph (a graph keeps addresses, not tensors): the buffers (the speculator's, V2's input
            buffers, hidden states and last-token indices), the speculator's constants and block tables, and the
            level inputs kept with the graph; its aranges are made inside it."""
            # vLLM's graph-capture context looked up at capture time, where V2 runs (CUDA; tests stand it in)
            from vllm.distributed.parallel_state import graph_capture

            self._level_graphs.clear()  # a capture replaces every earlier one
            manager = getattr(self, "prefill_cudagraph_manager", None)
            sizes = full_graph_sizes(manager)
            if not sizes or self.tree_state.profiling_capture:
                # V2's graph-memory profiling throws its captures (and their pool) away before the real capture; the
                # level graphs (the head over <= max_num_seqs x 1 + nodes above the leaves tokens) stay out of it.
                return
            buffers = self.input_buffers
            saved, self.draft_max_seq_len = self.draft_max_seq_len, self.max_model_len
            try:
                with graph_capture(device=self.device):
                    for size in sorted(sizes, reverse=True):
                        upper = torch.full((size,), self.max_model_len, dtype=torch.int32)
                        inputs = self._level_inputs(size, upper)
                        buffers.seq_lens[:size] = 0  # every row padding (`_draft_levels`): no K/V written
                        self._draft_levels(size, inputs)  # warm-up (its levels rewrite seq_lens)
                        buffers.seq_lens[:size] = 0
                        graph = capture_graph(functools.partial(self._draft_levels, size, inputs), manager.pool,
                                              self.vllm_config)
                        self._level_graphs[size] = (graph, inputs)
            finally:
                self.draft_max_seq_len = saved

        def tree_constants(self, tree) -> TreeConstants:
            """`tree`'s constants on the device (the verified tree's, or a drafting level's), built once."""
            if tree.num_nodes not in self._level_constants:
                self._level_constants[tree.num_nodes] = TreeConstants.of(tree, self.device)
            return self._level_constants[tree.num_nodes]

    TreeMtpSpeculatorV2.__qualname__ = TreeMtpSpeculatorV2.__name__
    return TreeMtpSpeculatorV2
