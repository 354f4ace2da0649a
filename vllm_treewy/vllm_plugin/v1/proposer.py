"""MTP draft trees in vLLM's V1 runner: the model's own MTP head proposes `draft_tree_widths` trees.

`TreeMtpProposer` is vLLM's `EagleProposer` (which runs MTP heads) with one more mode. For a chain it is vLLM's
proposer unchanged. With a draft tree (`spec_decode.tree_drafting` has the levels' topology), per step:

1. vLLM's first MTP pass (`EagleProposer.propose` with one draft token) over the step's verified tokens, after each
   tree row's accepted path was laid out as a chain (`accepted_path_sources`, from the acceptance that
   `v1.runner`'s sampling hands over): the head's K/V of the committed tokens land where vLLM's chain puts them,
   and the pass's output at each request's last accepted token gives level 1 (its top-w1 tokens).
2. For l = 1 .. depth - 1, one forward of the head over every request's level block (root + nodes of depth <= l,
   `uniform_tree_step`): the same tree attention as the target's verify (CPU: `tree_attention` over vLLM's causal pass;
   TRITON_ATTN: the tree bias in vLLM's launch; FLASH_ATTN: the two passes), depth RoPE positions, KV slots at P0 +
   block index (inside the lookahead vLLM's scheduler allocates for N drafts). Each node's hidden input is its parent's
   head output (the root's: the target's hidden state), its token id its own.
3. The drafts leave in node order, `[num_reqs, N]`, as a chain's would: the scheduler and the verify side are
   unchanged.

With `draft_tree_max_batch_size`, vLLM's dynamic speculative decoding asks for fewer drafts than N at larger
batches (`num_speculative_tokens` = the tree's depth D): then the proposer is vLLM's chain proposer for D drafts,
`[num_reqs, D]` (vLLM's V1 runner takes a drafter's column count as the step's), its first pass over the same
inputs as the tree's (after a tree step, the accepted paths laid out as chains).

The head's K/V at draft positions need no compaction: the next step's first pass rewrites positions L' .. for the
accepted path. Drafts are the head's deterministic top-w tokens at any temperature, which is what the exact sampled
acceptance (`spec_decode.tree_sampling`) needs. Every step of it is a fixed number of launches per level with shapes
that follow from the batch size and the tree: no host sync.

State across calls: the runner's `TreeRunState` (`tree_state`), which this proposer owns; it consumes the step's
`(step, acceptance)` that the step's sampling leaves there.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import torch
from vllm.forward_context import set_forward_context
from vllm.platforms import current_platform
from vllm.v1.spec_decode.eagle import EagleProposer

from vllm_treewy.spec_decode.tree_drafting import level_trees, nodes_below_depth
from vllm_treewy.vllm_plugin.config import draft_shape_of
from vllm_treewy.vllm_plugin.trees.drafting import PADDING_SLOT, accepted_paths_as_chains, kv_slots, top_children
from vllm_treewy.vllm_plugin.trees.attention import uniform_tree_marking
from vllm_treewy.vllm_plugin.trees.metadata import replace_metadata, with_tree
from vllm_treewy.vllm_plugin.trees.run_state import TreeRunState
from vllm_treewy.vllm_plugin.trees.step import TreeConstants, TreeStep, uniform_tree_step


class TreeMtpProposer(EagleProposer):
    """vLLM's MTP/EAGLE proposer; with a draft tree in the speculative config, proposes trees (module docstring)."""

    def __init__(self, vllm_config, device, runner=None):
        super().__init__(vllm_config, device, runner)
        shape = draft_shape_of(vllm_config.speculative_config)  # the drafter's one read of the tree shape
        tree = shape.tree
        self.tree = tree if self.method == "mtp" else None
        self.tree_state = TreeRunState(self.tree) if self.tree is not None else None
        self._level_output: torch.Tensor | None = None  # the first pass's head output at each request's root
        self._level_logits: torch.Tensor | None = None
        self._drafting_chain = False  # within a propose of a threshold config's chain
        if self.tree is None:
            return
        if shape.has_chain_steps:
            self.tree_state.chain_depth = vllm_config.speculative_config.draft_tree_depth
        if vllm_config.model_config.uses_mrope:
            raise NotImplementedError("draft_tree_widths with method 'mtp': models with M-RoPE positions are not "
                                      "supported yet (tree positions are depths on one axis)")
        if self.model_returns_tuple():
            raise NotImplementedError(f"draft_tree_widths with method 'mtp': {self.draft_model_config.architecture} "
                                      "returns separate hidden states for logits and drafting")
        self.widths = list(vllm_config.speculative_config.draft_tree_widths)
        if self.max_num_tokens < 1 + tree.num_nodes:
            raise ValueError(f"draft_tree_widths={self.widths}: max_num_batched_tokens={self.max_num_tokens} cannot "
                             f"hold one tree's verify (1 + {tree.num_nodes} tokens); raise it or narrow the tree")
        self.levels = level_trees(self.widths)
        self.nodes_below = nodes_below_depth(self.widths)
        self._level_constants: dict[int, TreeConstants] = {}  # per level tree (by node count), on the device
        self._host_query_starts: dict[tuple[int, int], torch.Tensor] = {}  # (requests, block length) -> host layout

    # -- vLLM's entry points ----------------------------------------------------------------------------------
    def propose(self, num_speculative_tokens, target_token_ids, target_positions, target_hidden_states,
                next_token_ids, token_indices_to_sample, common_attn_metadata, sampling_metadata, *args, **kwargs):
        if self.tree is None:
            return super().propose(num_speculative_tokens, target_token_ids, target_positions,
                                   target_hidden_states, next_token_ids, token_indices_to_sample,
                                   common_attn_metadata, sampling_metadata, *args, **kwargs)
        accepted, self.tree_state.accepted = self.tree_state.accepted, None
        if accepted is not None:
            target_token_ids, target_positions, target_hidden_states = accepted_paths_as_chains(
                *accepted, target_token_ids, target_positions, target_hidden_states)
        if num_speculative_tokens < self.tree.num_nodes:  # a larger batch's chain (draft_tree_max_batch_size)
            self._drafting_chain = True
            try:
                return super().propose(num_speculative_tokens, target_token_ids, target_positions,
                                       target_hidden_states, next_token_ids, token_indices_to_sample,
                                       common_attn_metadata, sampling_metadata, *args, **kwargs)
            finally:
                self._drafting_chain = False
                self.num_speculative_tokens = self.tree.num_nodes
        sample_rows = (token_indices_to_sample if token_indices_to_sample is not None
                       else common_attn_metadata.query_start_loc[1:] - 1)
        # vLLM's first pass; `_sample_draft_tokens` below keeps its output at the sample rows.
        super().propose(1, target_token_ids, target_positions, target_hidden_states, next_token_ids,
                        token_indices_to_sample, common_attn_metadata, sampling_metadata, *args, **kwargs)
        self.num_speculative_tokens = self.tree.num_nodes
        root_output, root_logits = self._level_output, self._level_logits
        self._level_output = self._level_logits = None
        root_positions = self.positions[sample_rows].long()
        root_inputs = (self.input_ids[sample_rows].clone(), self.hidden_states[sample_rows].clone())
        return self._draft_levels(root_positions, root_inputs, root_output, root_logits, common_attn_metadata)

    def _sample_draft_tokens(self, hidden_states, sampling_metadata):
        if self.tree is None or self._drafting_chain:
            return super()._sample_draft_tokens(hidden_states, sampling_metadata)
        logits = self.model.compute_logits(hidden_states)
        self._level_output, self._level_logits = hidden_states, logits
        return logits.argmax(dim=-1), None  # (draft tokens, draft probabilities): vLLM's first pass ignores both

    # -- the levels ---------------------------------------------------------------------------------------------
    def _draft_levels(self, root_positions, root_inputs, root_output, root_logits, cad) -> torch.Tensor:
        """Every request's tree, `[num_reqs, N]`. The deepest level forwards 1 + (nodes above the leaves) tokens per
        request, which can exceed the step's token budget that sizes the head's buffers (requests that fell back to
        one token this step still draft their next tree); such batches draft in request chunks that fit it."""
        num_reqs = root_positions.numel()
        per_chunk = self.max_num_tokens // (1 + self.nodes_below[-2])
        if num_reqs <= per_chunk:
            return self._draft_levels_of(root_positions, root_inputs, root_output, root_logits, cad)
        chunks = [slice(first, min(first + per_chunk, num_reqs)) for first in range(0, num_reqs, per_chunk)]
        return torch.cat([self._draft_levels_of(root_positions[rows], tuple(x[rows] for x in root_inputs),
                                                root_output[rows], root_logits[rows], _requests_of(cad, rows))
                          for rows in chunks])

    def _draft_levels_of(self, root_positions, root_inputs, root_output, root_logits, cad) -> torch.Tensor:
        num_reqs = root_positions.numel()
        tokens = torch.empty(num_reqs, self.tree.num_nodes, dtype=torch.long, device=self.device)
        tokens[:, : self.widths[0]] = top_children(root_logits, self.widths[0]).view(num_reqs, -1)
        if not self.levels:  # a depth-1 tree: the first pass's top-w1 is the whole tree
            return tokens
        # Head outputs per verified-block index: the root's, then each forwarded node's.
        outputs = root_output.new_empty(num_reqs, 1 + self.nodes_below[-2], root_output.shape[-1])
        outputs[:, 0] = root_output
        blocks = self._level_blocks(root_positions, cad)
        for level, tree in enumerate(self.levels, start=1):
            first, last = self.nodes_below[level - 1], self.nodes_below[level]  # this level's nodes [first, last)
            output = self._forward_level(tree, tokens[:, :last], outputs, root_positions, root_inputs, cad, blocks)
            outputs[:, 1 + first : 1 + last] = output[:, 1 + first :]
            logits = self.model.compute_logits(output[:, 1 + first :].reshape(-1, output.shape[-1]))
            children = top_children(logits, self.widths[level])
            tokens[:, last : self.nodes_below[level + 1]] = children.view(num_reqs, -1)
        return tokens

    def _level_blocks(self, root_positions, cad) -> _LevelBlocks:
        """The deepest level's block (root + the nodes above the leaves) per request: every level's block is a prefix
        of it (breadth-first node order), so its positions, KV slots and lengths are computed once per step."""
        block_len = 1 + self.nodes_below[-2]
        depths = self._constants(self.levels[-1]).depths
        positions = (root_positions[:, None] + depths).clamp_(max=self.max_model_len - 1)
        offsets = torch.arange(block_len, device=self.device)
        slots = kv_slots(cad.block_table_tensor, root_positions[:, None] + offsets,
                         self.block_size, self.max_model_len)
        return _LevelBlocks(positions, slots, root_positions.to(cad.seq_lens.dtype))

    def _query_start_loc_cpu(self, num_reqs: int, block_len: int) -> torch.Tensor:
        """The level's query layout on the host, built once per shape (read only)."""
        key = (num_reqs, block_len)
        if key not in self._host_query_starts:
            self._host_query_starts[key] = torch.arange(num_reqs + 1, dtype=torch.int32) * block_len
        return self._host_query_starts[key]

    def _forward_level(self, tree, node_tokens, outputs, root_positions, root_inputs, cad, blocks) -> torch.Tensor:
        """The head over every request's block of `tree` (root + its nodes); returns `[num_reqs, 1 + n, hidden]`.
        `blocks`: `_level_blocks` of the step. Inputs are written into the proposer's buffers in place, a block
        column range at a time (no concatenated copies)."""
        num_reqs, block_len = root_positions.numel(), 1 + tree.num_nodes
        num_tokens = num_reqs * block_len
        constants = self._constants(tree)

        root_token, root_hidden = root_inputs
        input_ids = self.input_ids[:num_tokens].view(num_reqs, block_len)
        input_ids[:, 0] = root_token
        input_ids[:, 1:] = node_tokens
        hidden_states = self.hidden_states[:num_tokens].view(num_reqs, block_len, -1)
        hidden_states[:, 0] = root_hidden
        hidden_states[:, 1:] = outputs[:, constants.parent_blocks]
        # The proposer's positions (no M-RoPE: refused at start-up) and slot mapping buffers.
        self.positions[:num_tokens].view(num_reqs, block_len).copy_(blocks.positions[:, :block_len])
        slot_mapping = self._slot_mapping_buffer[:num_tokens]
        slot_mapping.view(num_reqs, block_len).copy_(blocks.slots[:, :block_len])

        step = uniform_tree_step(tree, root_positions, constants)
        max_position = cad.max_seq_len + self.tree.num_nodes
        level_cad = dataclasses.replace(
            cad,
            query_start_loc=step.query_start_loc,
            query_start_loc_cpu=self._query_start_loc_cpu(num_reqs, block_len),
            seq_lens=blocks.seq_lens + block_len,
            num_reqs=num_reqs,
            num_actual_tokens=num_tokens,
            max_query_len=block_len,
            max_seq_len=min(max_position, self.max_model_len),
            slot_mapping=slot_mapping,
            seq_lens_cpu_upper_bound=(None if cad.seq_lens_cpu_upper_bound is None
                                      else cad.seq_lens_cpu_upper_bound + self.tree.num_nodes),
            causal=True,
        )
        _, per_layer = self.build_per_group_and_layer_attn_metadata(level_cad, draft_index=tree.max_depth)
        self._attach_tree(per_layer, step)
        mode, num_input_tokens, across_dp = self._determine_batch_execution_and_padding(num_tokens)
        kwargs = {"input_ids": self.input_ids[:num_input_tokens], "positions": self._get_positions(num_input_tokens),
                  "inputs_embeds": None}
        if self.supports_mm_inputs:
            self.inputs_embeds[:num_tokens] = self.model.embed_input_ids(self.input_ids[:num_tokens])
            kwargs["input_ids"], kwargs["inputs_embeds"] = None, self.inputs_embeds[:num_input_tokens]
        if self.pass_hidden_states_to_model:
            kwargs["hidden_states"] = self.hidden_states[:num_input_tokens]
        if num_input_tokens > num_tokens:  # vLLM's padding of the graph's batch: no cache write
            self._slot_mapping_buffer[num_tokens:num_input_tokens].fill_(PADDING_SLOT)
        with set_forward_context(per_layer, self.vllm_config, num_tokens=num_input_tokens,
                                 num_tokens_across_dp=across_dp, cudagraph_runtime_mode=mode,
                                 slot_mapping=self._get_slot_mapping(num_input_tokens)):
            hidden = self._run_head(kwargs)
        return hidden[:num_tokens].view(num_reqs, block_len, -1)

    def _run_head(self, kwargs: dict) -> torch.Tensor:
        """The head's forward for one level, inside the level's forward context (vLLM's cudagraph dispatch)."""
        return self.model(**kwargs)

    def _constants(self, tree) -> TreeConstants:
        if tree.num_nodes not in self._level_constants:
            self._level_constants[tree.num_nodes] = TreeConstants.of(tree, self.device)
        return self._level_constants[tree.num_nodes]

    def _attach_tree(self, per_layer: dict, step: TreeStep) -> None:
        """The level's tree (every request a tree row) onto the head's attention metadata, in place, as `v1.runner`
        hands the target's: the step for the CPU post-pass; on CUDA the tree bias for vLLM's TRITON_ATTN launch or
        the ancestor table for FLASH_ATTN's two passes (`trees.attention.uniform_tree_marking`)."""
        if current_platform.is_cpu():
            replace_metadata(per_layer, lambda name, metadata: with_tree(metadata, tree_step=step))
        else:
            replace_metadata(per_layer, uniform_tree_marking(self.tree_state, step.tree, self.device))


class _LevelBlocks(NamedTuple):
    """A step's deepest drafting-level block per request (`TreeMtpProposer._level_blocks`); a level reads the first
    1 + n columns."""

    positions: torch.Tensor  # [R, L] depth positions, clamped below max_model_len
    slots: torch.Tensor  # [R, L] KV slots of block positions root + 0 .. L - 1 (padding past max_model_len)
    seq_lens: torch.Tensor  # [R] each root's position in vLLM's sequence-length dtype: a level adds its block length


def _requests_of(cad, rows: slice):
    """vLLM's common attention metadata with the per-request fields the drafting levels keep (block table, host bound
    of the sequence lengths) cut to the requests `rows`; a level replaces the rest (query layout, lengths, slots)."""
    upper = cad.seq_lens_cpu_upper_bound
    return dataclasses.replace(cad, block_table_tensor=cad.block_table_tensor[rows],
                               seq_lens_cpu_upper_bound=None if upper is None else upper[rows])


