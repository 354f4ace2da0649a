"""Draft trees in vLLM's Model Runner V2 (`vllm/v1/worker/gpu/`, CUDA with TRITON_ATTN). Opt-in until the GPU checks
of `bench/run_gpu_v2_trees.sh` cover the graphed levels and several tree shapes (`bench/results/gpu_v2_trees/`):
vLLM's V2 feature check keeps trees on the V1 runner unless `VLLM_TREEWY_TRY_V2_TREES=1` is set in the environment
of every vLLM process.

What V2 shares with the V1 tree path (`tree_runner`) unchanged:

- the tree step (`tree_step.find_tree_step`: the tree rows, their block tokens, parents, position shifts) and the
  depth RoPE positions (`tree_step.override_positions`);
- tree attention on TRITON_ATTN (`tree_runner._hand_to_triton_layers` puts the tree bias, or for a batch with
  prefills the tree step, onto the step's attention metadata and records the layers' caches; the attention forward
  and `unified_attention` wrappers are runner-independent);
- the GDN side: V2 calls the same GDN metadata builder, so `step_metadata` gives the tree's commit nodes and counts,
  and the reconstruct layer verifies along the tree (nothing V2-specific);
- acceptance (the one-call walk, `tree_sampling.sampled_tree_acceptance_of_draws`), the output rows
  (`tree_sampler.tree_output_rows`), the accepted path's K/V compaction (`tree_sampler.commit_accepted_path`), the
  accepted leaf into each GDN slot's count (`tree_sampler.record_accepted_leaves`);
- the MTP drafting levels' topology (`spec_decode.tree_drafting`) and the first pass's accepted-path-as-chain inputs
  (`mtp_tree_proposer._accepted_paths_as_chains`, `_slots`).

What V2 does its own way, and the hook for each (all in `patch_points.py`):

1. `GPUModelRunner.prepare_attn` (V2_RUNNER_PREPARE_ATTN, real steps only): V2 computed positions on the device
   and the slot mappings from them; the tree rows are found from V2's host arrays (`num_draft_tokens_per_req`,
   `is_prefilling_np`, `query_start_loc_np`), each root's position is read on the device (V2's host count of
   computed tokens is an upper bound under async scheduling), and the tree tokens get depth positions in V2's
   persistent positions buffer (a FULL graph reads it in place).
2. `MambaHybridModelState.prepare_attn` (V2_MAMBA_PREPARE_ATTN; real steps, dummy runs and graph captures): the
   tree bias or step onto the TRITON_ATTN metadata, as V1's `_build_attention_metadata` hook does. A capture or dummy
   run of a uniform 1 + N decode batch gets the bias (V2 replays FULL decode graphs for decode-only batches, every
   row a tree row or a one-token decode); the drafter's own first-pass graphs are captured without it.
3. `GPUModelRunner.sample` (V2_RUNNER_SAMPLE): tree acceptance instead of V2's rejection sampler. V2's sampler draws
   every verified token's row in ONE call (`Sampler.sample`), its Gumbel noise keyed by (request seed, position):
   with depth positions, a node at depth d draws with the noise plain decoding uses at that position, so walking the
   tree over these draws (the one-call walk, `tree_sampling.sampled_tree_acceptance_of_draws` over
   `acceptance.uniform_tree_acceptance`: move to the child carrying the draw, a fixed number of ops) emits exactly
   what the request's sampling would (the proof in `spec_decode.tree_sampling` needs one fresh draw per walked level;
   nodes off the walk use noise of positions the walk either emits at or never reaches this step, and a step's
   stopping depth depends only on the noise up to it). Greedy rows take the argmax there. One sampler call, no host
   sync. What reads a row's tokens as a chain is not exact on a tree: V2's repetition / frequency / presence
   penalties and its bad-words matching (a node's prefix match would read its siblings' drafts, for bad words of
   3 or more tokens) take the row's drafts in node order, and its thinking-token budget counts a node's context as
   the root plus its place in node order. Requests that use any of them are REFUSED at admission on V2 trees
   (INPUT_PROCESSOR_VALIDATE_PARAMS, `v2_tree_refusal`: a VLLMValidationError naming the parameter; bad words are
   refused whatever their length, which is known only after tokenization); the V1 runner treats penalties and bad
   words exactly (its level path). Temperature, top-k, top-p, min-p and logit bias act per row and are exact.
4. The MTP drafter: V2 builds it in `init_speculator` from `spec_decode.mtp.speculator.MTPSpeculator`
   (V2_MTP_SPECULATOR, rebound to `TreeMtpSpeculatorV2`, vLLM's class unchanged for chains). Per step: V2's own
   first pass (`propose` with one draft, FULL graphs included) over the verified tokens with each tree row's
   accepted path laid out as a chain, on attention metadata without the tree; then the drafting levels: one head
   forward per level over every request's level block, with the tree bias, depth positions and KV slots
   P0 + block index. The levels are one function, `_draft_levels`, over persistent buffers (`TreeLevelBuffers`):
   static shapes, no host sync, so the same body runs eagerly or as a CUDA graph captured per padded request count of
   V2's FULL first-pass graphs, in V2's capture phase (`_capture_levels`; `propose` fills the root buffers and
   replays). Batches above the captured sizes (or without FULL graphs) run the body eagerly. Every request drafts at
   once (no request chunks on V2): a max_num_seqs x (1 + nodes above the leaves) over max_num_batched_tokens is
   refused at start-up (`check_level_budget`).

State across calls: the speculator's `TreeRunStateV2` (`tree_state`), which the runner owns through its speculator.
The model state's `prepare_attn` does not reach the runner, so the runner's entry points (execute_model,
capture_model, profile_cudagraph_memory) bind the state to a ContextVar for the call only (`_CALL_TREE_STATE`, reset
after it): no module state outlives a call, and no attribute is added to vLLM's objects.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import contextvars
from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np
import torch

from vllm_treewy.spec_decode.acceptance import TreeAcceptance
from vllm_treewy.spec_decode.tree_sampling import sampled_tree_acceptance_of_draws
from vllm_treewy.spec_decode.tree_drafting import (
    accepted_path_sources,
    level_trees,
    nodes_below_depth,
    top_children,
)
from vllm_treewy.tree import DraftTree
from vllm_treewy.vllm_plugin.config import draft_tree_of
from vllm_treewy.vllm_plugin.patch_points import (
    INPUT_PROCESSOR_VALIDATE_PARAMS,
    V2_MAMBA_PREPARE_ATTN,
    V2_MTP_SPECULATOR,
    V2_RUNNER_CAPTURE_MODEL,
    V2_RUNNER_EXECUTE_MODEL,
    V2_RUNNER_PREPARE_ATTN,
    V2_RUNNER_PROFILE_CUDAGRAPH_MEMORY,
    V2_RUNNER_SAMPLE,
)
from vllm_treewy.vllm_plugin.tree_metadata import replace_metadata, with_tree
from vllm_treewy.vllm_plugin.tree_run_state import TreeRunState
from vllm_treewy.vllm_plugin.tree_step import TreeConstants, TreeStep, find_tree_step, override_positions

TRY_V2_TREES_ENV = "VLLM_TREEWY_TRY_V2_TREES"
PLACEHOLDER_TOKEN = -1  # V2's padding of sampled_token_ids
PAD_SLOT = -1  # vLLM's PAD_SLOT_ID


def trees_tried_on_v2() -> bool:
    """Whether draft trees may run on Model Runner V2 (the GPU check's switch; off by default until verified)."""
    return os.environ.get(TRY_V2_TREES_ENV, "0") not in ("", "0")


@dataclass
class TreeRunStateV2(TreeRunState):
    """V1's tree state plus what V2's calls hand on: the step found in `prepare_attn`, kept for `sample`
    (`sampling_step`), and whether the drafter is capturing its first-pass graphs (no tree bias then)."""

    sampling_step: TreeStep | None = None
    capturing_drafter: bool = False
    profiling_capture: bool = False  # inside V2's graph-memory profiling: its captures are thrown away


# -- the step's tree rows from V2's input batch -----------------------------------------------------------------

def decode_draft_counts(num_draft_tokens_per_req: np.ndarray | None, is_prefilling: np.ndarray,
                        num_reqs: int) -> tuple[np.ndarray, np.ndarray]:
    """`(num_decode_draft_tokens, num_draft_tokens)` `[num_reqs]` as `find_tree_step` takes them (V1's meaning:
    a decode's scheduled drafts, -1 for a prefill chunk), from V2's per-request draft counts (None: no drafts
    scheduled) and `is_prefilling_np`."""
    drafts = (np.zeros(num_reqs, dtype=np.int64) if num_draft_tokens_per_req is None
              else np.asarray(num_draft_tokens_per_req[:num_reqs], dtype=np.int64))
    return np.where(np.asarray(is_prefilling[:num_reqs], dtype=bool), -1, drafts), drafts


def find_tree_step_v2(tree: DraftTree, input_batch) -> TreeStep | None:
    """The step's tree rows in V2's `InputBatch`, with each root's position read from V2's device positions (before
    they are overridden). Host arrays only decide which rows: no host sync."""
    num_reqs = input_batch.num_reqs
    is_prefilling = np.asarray(input_batch.is_prefilling_np[:num_reqs], dtype=bool)
    if input_batch.prefill_runs_as_decode_np is not None:
        # A prompt tail padded with placeholder drafts runs as a speculative row (V2's model state, GDN included).
        is_prefilling = is_prefilling & ~np.asarray(input_batch.prefill_runs_as_decode_np[:num_reqs], dtype=bool)
    decode_drafts, drafts = decode_draft_counts(input_batch.num_draft_tokens_per_req, is_prefilling, num_reqs)
    positions = input_batch.positions
    step = find_tree_step(tree, decode_drafts, drafts, np.asarray(input_batch.query_start_loc_np[: num_reqs + 1]),
                          np.zeros(num_reqs, dtype=np.int64), positions.device)
    if step is None:
        return None
    roots = step.token_indices.view(step.num_requests, step.block_len)[:, 0]
    step.root_positions = positions[roots].long()
    query_lens = np.diff(np.asarray(input_batch.query_start_loc_np[: num_reqs + 1]))
    step.covers_batch = int((query_lens > 1).sum()) == step.num_requests
    return step


# -- acceptance on V2's logits layout --------------------------------------------------------------------------

@dataclass
class TreeSampling:
    sampled: torch.Tensor  # [num_reqs, 1 + num_speculative_steps] V2's layout: emitted tokens, -1 after
    num_sampled: torch.Tensor  # [num_reqs] int32 emitted tokens per row (before V2's chunked-prefill correction)
    acceptance: TreeAcceptance  # the tree rows'
    chain_rows: torch.Tensor  # [num_logits] int64 logits rows with each tree row's block laid out as its path


def accept_tree_rows(step: TreeStep, row_draws: torch.Tensor, cu_num_logits: torch.Tensor, input_ids: torch.Tensor,
                     num_speculative_steps: int) -> TreeSampling:
    """The walk over one draw per logits row (`row_draws [num_logits]`, V2's packed rows: request r owns rows
    `cu_num_logits[r] .. cu_num_logits[r + 1]`, a tree row its verified block in block order). `input_ids`: the
    step's token ids (a tree row's drafts at its block tokens 1 .. N). Device ops of shapes the host knows."""
    num_requests, block_len = step.num_requests, step.block_len
    device = row_draws.device
    cu = cu_num_logits.long()
    num_reqs, num_logits = cu.numel() - 1, row_draws.numel()
    from vllm_treewy.vllm_plugin.tree_sampler import _arange, _walk_tables, tree_output_rows

    block_rows = cu[step.request_indices][:, None] + _arange(block_len, device)  # [R, 1 + N]
    drafts = input_ids[step.token_indices.view(num_requests, block_len)[:, 1:]].long()  # [R, N]
    # the walk over every node's draw at once (uniform_tree_acceptance: a fixed number of ops, whatever the depth)
    acceptance = sampled_tree_acceptance_of_draws(_walk_tables(step.tree.parents, device), drafts,
                                                  row_draws[block_rows].long())
    drafts = drafts.reshape(-1)  # [R * N]

    sampled = torch.full((num_reqs, 1 + num_speculative_steps), PLACEHOLDER_TOKEN, dtype=torch.long, device=device)
    sampled[:, 0] = row_draws[cu[1:] - 1].long()  # every other row's one draw (its last logits row)
    sampled[step.request_indices, : step.depth + 1] = tree_output_rows(step, drafts, acceptance)
    num_sampled = torch.ones(num_reqs, dtype=torch.int32, device=device)
    num_sampled[step.request_indices] = (acceptance.num_accepted + 1).to(torch.int32)
    chain_rows = _arange(num_logits, device).clone()
    chain_rows[block_rows.reshape(-1)] = block_rows.gather(
        1, accepted_path_sources(acceptance.accepted_nodes, block_len)).reshape(-1)
    return TreeSampling(sampled, num_sampled, acceptance, chain_rows)


def sample_tree_step(runner, hidden_states: torch.Tensor, input_batch, step: TreeStep, state: TreeRunStateV2):
    """V2's `sample` for a step with tree rows: `(SamplerOutput, num_sampled, num_rejected)` as V2's rejection
    sampler gives them; then the compaction, the GDN slots' accepted leaves, and the acceptance for the drafter."""
    from vllm.v1.worker.gpu.input_batch import get_num_sampled_and_rejected
    from vllm.v1.worker.gpu.sample.output import SamplerOutput
    from vllm.v1.worker.gpu.sample.states import NO_LOGPROBS

    from vllm_treewy.vllm_plugin.accepted_counts import counted_gdn_groups
    from vllm_treewy.vllm_plugin.tree_sampler import commit_accepted_path, record_accepted_leaves

    sampler = runner.sampler
    logits = runner.model.compute_logits(hidden_states[input_batch.logits_indices])
    rows = input_batch.logits_indices
    upper_bound = input_batch.seq_lens_cpu_upper_bound.numpy()
    draws, processed = sampler.sample(
        logits, input_batch.expanded_idx_mapping, input_batch.idx_mapping, input_batch.idx_mapping_np,
        input_batch.positions[rows], input_batch.input_ids[rows], input_batch.expanded_local_pos, upper_bound)
    result = accept_tree_rows(step, draws, input_batch.cu_num_logits, input_batch.input_ids,
                              runner.num_speculative_steps)
    num_sampled, num_rejected = get_num_sampled_and_rejected(
        result.num_sampled, input_batch.seq_lens, input_batch.cu_num_logits, input_batch.idx_mapping,
        sampler.req_states.prefill_len.gpu)
    logprobs = None
    max_num_logprobs = sampler.sampling_states.max_num_logprobs(input_batch.idx_mapping_np)
    if max_num_logprobs != NO_LOGPROBS:
        from vllm.config.model import PROCESSED_LOGPROBS_MODES

        source = processed if sampler.logprobs_mode in PROCESSED_LOGPROBS_MODES else logits
        logprobs = runner.rejection_sampler._get_logprobs_tensors(
            result.sampled, num_sampled, source[result.chain_rows], input_batch.cu_num_logits,
            input_batch.cu_num_logits_np, max_num_logprobs)
    commit_accepted_path(step, result.acceptance)
    tree_rows = input_batch.idx_mapping[step.request_indices]
    for group_id, counts in counted_gdn_groups(runner):
        slots = runner.block_tables.block_tables[group_id].gpu[tree_rows, 0]
        record_accepted_leaves(counts, slots, result.acceptance)
    state.accepted = (step, result.acceptance)
    output = SamplerOutput(sampled_token_ids=result.sampled, logprobs_tensors=logprobs, num_nans=None,
                           num_sampled=num_sampled, num_rejected=num_rejected)
    return output, num_sampled, num_rejected


# -- the runner's hooks ------------------------------------------------------------------------------------------

# The tree state of the runner call in progress (execute_model, capture_model, profile_cudagraph_memory), for the
# model state's prepare_attn, which does not reach the runner. Bound for the call only and reset after it: the state
# itself lives on the runner's speculator (`TreeMtpSpeculatorV2.tree_state`), nothing here outlives a call.
_CALL_TREE_STATE: contextvars.ContextVar = contextvars.ContextVar("treewy_v2_call_tree_state", default=None)


def tree_state_of_runner(runner) -> TreeRunStateV2 | None:
    state = getattr(getattr(runner, "speculator", None), "tree_state", None)
    if state is None and draft_tree_of(runner.speculative_config) is not None:
        raise ValueError(f"draft_tree_widths on Model Runner V2: the speculator {type(runner.speculator).__name__} "
                         "does not draft trees (method 'mtp' builds TreeMtpSpeculatorV2)")
    return state


def _binding_tree_state(original):
    profiling_call = original.__name__ == "profile_cudagraph_memory"

    @functools.wraps(original)
    def bound(self, *args, **kwargs):
        state = getattr(getattr(self, "speculator", None), "tree_state", None)
        profiling = state.profiling_capture if state is not None else False
        if state is not None:
            state.profiling_capture = profiling or profiling_call or bool(kwargs.get("profile_only", False))
        token = _CALL_TREE_STATE.set(state)
        try:
            return original(self, *args, **kwargs)
        finally:
            _CALL_TREE_STATE.reset(token)
            if state is not None:
                state.profiling_capture = profiling

    return bound


def _finding_tree_rows(original):
    @functools.wraps(original)
    def prepare_attn(self, input_batch, *args, **kwargs):
        result = original(self, input_batch, *args, **kwargs)  # the slot mappings from vLLM's positions
        state = tree_state_of_runner(self)
        if state is None:
            return result
        step = find_tree_step_v2(state.tree, input_batch)
        if step is not None:
            override_positions(input_batch.positions, step)
        state.pending_step, state.prepared, state.sampling_step = step, True, step
        return result

    return prepare_attn


def _handing_tree_to_attention(original):
    @functools.wraps(original)
    def prepare_attn(self, input_batch, cudagraph_mode, block_tables, slot_mappings, attn_groups, kv_cache_config,
                     *args, **kwargs):
        attn_metadata = original(self, input_batch, cudagraph_mode, block_tables, slot_mappings, attn_groups,
                                 kv_cache_config, *args, **kwargs)
        state = _CALL_TREE_STATE.get()
        if state is None or state.capturing_drafter:
            return attn_metadata
        step, prepared = state.pending_step, state.prepared
        state.pending_step, state.prepared = None, False
        from vllm_treewy.vllm_plugin import tree_runner

        if not state.backends_checked:
            per_layer = attn_metadata if isinstance(attn_metadata, dict) else {}
            tree_runner._check_tree_backends(SimpleNamespace(compilation_config=self.vllm_config.compilation_config),
                                             per_layer)
            state.backends_checked = bool(per_layer)
        tree_runner._hand_to_triton_layers(state, self.vllm_config.compilation_config.static_forward_context,
                                           attn_metadata, step, prepared, input_batch.positions.device)
        return attn_metadata

    return prepare_attn


def _sampling_trees(original):
    @functools.wraps(original)
    def sample(self, hidden_states, input_batch, grammar_output, *args, **kwargs):
        state = tree_state_of_runner(self)
        step = None
        if state is not None:
            step, state.sampling_step, state.accepted = state.sampling_step, None, None
        if step is None:
            return original(self, hidden_states, input_batch, grammar_output, *args, **kwargs)
        if grammar_output is not None or self.batch_sharder is not None:
            raise NotImplementedError("draft trees on Model Runner V2: structured outputs and sharded sampling are "
                                      "not supported yet")
        return sample_tree_step(self, hidden_states, input_batch, step, state)

    return sample


PATH_DEPENDENT_FIELDS = (("repetition_penalty", 1.0), ("frequency_penalty", 0.0), ("presence_penalty", 0.0),
                         ("bad_words", None), ("thinking_token_budget", None))


def v2_tree_refusal(params, speculative_config) -> str | None:
    """Why a request is refused on V2 trees (None: admitted): the sampling parameters whose V2 processors read a
    tree row's verified tokens as a chain (module docstring, 3.), so a node would see other nodes' drafts."""
    if draft_tree_of(speculative_config) is None:
        return None
    used = [f"{name}={getattr(params, name)}" for name, neutral in PATH_DEPENDENT_FIELDS
            if getattr(params, name, neutral) not in (neutral, [])]
    if not used:
        return None
    return (f"draft_tree_widths on Model Runner V2 does not support these sampling parameters yet ({', '.join(used)}):"
            " a tree node would see other nodes' drafts. Send the request without them, or run the tree on the V1 "
            "runner (unset VLLM_TREEWY_TRY_V2_TREES) or without draft_tree_widths")


def _refusing_path_dependent_params(original):
    @functools.wraps(original)
    def validate(self, params, *args, **kwargs):
        if getattr(self.vllm_config, "use_v2_model_runner", False) and hasattr(params, "repetition_penalty"):
            reason = v2_tree_refusal(params, self.speculative_config)
            if reason is not None:
                from vllm.exceptions import VLLMValidationError

                raise VLLMValidationError(reason)
        return original(self, params, *args, **kwargs)

    return validate


# -- the MTP drafter -------------------------------------------------------------------------------------------

def _strip_tree(attn_metadata):
    """A copy of V2's per-layer metadata dict without the tree (the drafter's first pass attends causally)."""
    from vllm_treewy.vllm_plugin.tree_metadata import tree_qq_bias_of, tree_step_of

    if not isinstance(attn_metadata, dict):
        return attn_metadata
    return {name: (with_tree(m, tree_step=None, tree_qq_bias=None)
                   if tree_step_of(m) is not None or tree_qq_bias_of(m) is not None else m)
            for name, m in attn_metadata.items()}


def level_slot_mappings(block_tables, block_sizes, block_positions: torch.Tensor, max_model_len: int) -> torch.Tensor:
    """`[num_groups, R * L]` KV slots of `block_positions [R, L]` in every KV-cache group (`block_tables`: each
    group's `[>= R, max_blocks]` rows of the batch); PAD past max_model_len."""
    from vllm_treewy.vllm_plugin.mtp_tree_proposer import _slots

    num_requests = block_positions.shape[0]
    return torch.stack([_slots(table[:num_requests], block_positions, size, max_model_len).reshape(-1)
                        for table, size in zip(block_tables, block_sizes)])


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
class TreeLevelBuffers:
    """The drafting levels' persistent inputs and outputs on the device (one set per tree speculator): what a level
    graph reads and writes, so that eager runs and replays see the same addresses."""

    root_positions: torch.Tensor  # [max_reqs] int64 each root's position (its last accepted token's)
    root_tokens: torch.Tensor  # [max_reqs] the root's input token (the bonus), in the input ids' dtype
    root_hidden: torch.Tensor  # [max_reqs, H] the target's hidden state at the root
    root_output: torch.Tensor  # [max_reqs, H] the first pass's head output at the root
    valid: torch.Tensor  # [max_reqs] bool: a real request (padding rows write no K/V)
    tokens: torch.Tensor  # [max_reqs, N] int64 the drafted tree, node order
    outputs: torch.Tensor  # [max_reqs, 1 + nodes above the leaves, H] head outputs per verified-block index
    slots: torch.Tensor  # [groups, max_tokens] int64 the level's KV slots (the head's slot mappings are views)

    @classmethod
    def allocate(cls, max_reqs, num_nodes, widest, hidden_size, dtype, id_dtype, num_groups, max_tokens, device):
        def zeros(*shape, dtype=dtype):
            return torch.zeros(*shape, dtype=dtype, device=device)

        return cls(zeros(max_reqs, dtype=torch.long), zeros(max_reqs, dtype=id_dtype), zeros(max_reqs, hidden_size),
                   zeros(max_reqs, hidden_size), zeros(max_reqs, dtype=torch.bool),
                   zeros(max_reqs, num_nodes, dtype=torch.long), zeros(max_reqs, widest, hidden_size),
                   torch.full((num_groups, max_tokens), PAD_SLOT, dtype=torch.long, device=device))


def make_tree_speculator_class(base):
    """V2's MTP speculator with MTP draft trees (module docstring, 4.); chains run `base` unchanged."""

    class TreeMtpSpeculatorV2(base):
        def __init__(self, vllm_config, device):
            super().__init__(vllm_config, device)
            tree = draft_tree_of(vllm_config.speculative_config)
            self.tree = tree
            self.tree_state = TreeRunStateV2(tree) if tree is not None else None
            if tree is None:
                return
            spec = vllm_config.speculative_config
            if spec.enable_adaptive_verification or spec.uses_dynamic_speculative_decoding():
                raise NotImplementedError("draft_tree_widths on Model Runner V2: adaptive verification and dynamic "
                                          "speculative decoding change the drafts per request (a tree is static)")
            self.widths = list(spec.draft_tree_widths)
            self.levels = level_trees(self.widths)
            self.nodes_below = nodes_below_depth(self.widths)
            check_level_budget(self.widths, self.max_num_reqs, self.max_num_tokens)
            self._bufs: TreeLevelBuffers | None = None  # allocated at first use (the block tables come with set_attn)
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
            from vllm_treewy.vllm_plugin.mtp_tree_proposer import _accepted_paths_as_chains

            accepted, self.tree_state.accepted = self.tree_state.accepted, None
            hidden = last_hidden_states
            if accepted is not None:
                ids, positions, hidden = _accepted_paths_as_chains(*accepted, input_batch.input_ids,
                                                                   input_batch.positions, last_hidden_states)
                input_batch = dataclasses.replace(input_batch, input_ids=ids, positions=positions)
            call(input_batch, _strip_tree(attn_metadata), slot_mappings, hidden, aux_hidden_states, num_sampled,
                 num_rejected, last_sampled, next_prefill_tokens, temperature, seeds, num_speculative_tokens=1)
            num_reqs = input_batch.num_reqs
            graph_size = self._level_graph_size(num_reqs)
            padded = num_reqs if graph_size is None else graph_size
            bufs = self._tree_buffers()
            last_rows = self.last_token_indices[:num_reqs]
            # The root's inputs as the first pass had them (its K/V is rewritten with the same values): the bonus
            # token and the target's hidden state at the last accepted token; its output: the first pass's head
            # output there (V2's _prefill leaves it at hidden_states[:num_reqs], its position at positions[:num_reqs]).
            bufs.root_positions[:num_reqs] = self.input_buffers.positions[:num_reqs]
            bufs.root_tokens[:num_reqs] = self.input_buffers.input_ids[last_rows]
            bufs.root_hidden[:num_reqs] = hidden[last_rows]
            bufs.root_output[:num_reqs] = self.hidden_states[:num_reqs]
            bufs.valid[:num_reqs] = True
            if padded > num_reqs:  # graph padding: rows that write no K/V (PAD slots) and read position 0
                bufs.root_positions[num_reqs:padded] = 0
                bufs.valid[num_reqs:padded] = False
            if graph_size is None:
                upper = input_batch.seq_lens_cpu_upper_bound[:num_reqs]
                self.draft_max_seq_len = min(int(upper.max()) + self.tree.num_nodes, self.max_model_len)
                self._draft_levels(num_reqs, self._level_inputs(num_reqs, upper))
            else:
                self._level_graphs[graph_size][0].replay()
            self.draft_tokens[:num_reqs] = bufs.tokens[:num_reqs]
            return self.draft_tokens[:num_reqs]

        # -- the drafting levels: one body, run eagerly or captured per padded request count ----------------------
        def _tree_buffers(self) -> TreeLevelBuffers:
            if self._bufs is None:
                self._bufs = TreeLevelBuffers.allocate(
                    self.max_num_reqs, self.tree.num_nodes, 1 + self.nodes_below[-2], self.hidden_states.shape[-1],
                    self.hidden_states.dtype, self.input_buffers.input_ids.dtype,
                    len(self.block_tables.input_block_tables), self.max_num_tokens, self.hidden_states.device)
            return self._bufs

        def _level_inputs(self, num_reqs: int, upper_bound) -> list:
            """Host side of every level for `num_reqs` (padded) requests: V2's attention metadata over the input
            buffers (query layout and lengths the body writes), with the level tree's bias, and the level's KV slot
            mappings per layer (views of the persistent slot buffer). Built per step eagerly, once per graph."""
            from vllm.config.compilation import CUDAGraphMode
            from vllm.v1.attention.backends.triton_attn import TritonAttentionMetadata
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
                bias = self.tree_state.qq_bias(tree, self.device)
                replace_metadata(attn_metadata, lambda name, m: with_tree(m, tree_qq_bias=bias)
                                 if isinstance(m, TritonAttentionMetadata) else None)
                inputs.append((attn_metadata, build_slot_mappings_by_layer(slots, self.kv_cache_config)))
            return inputs

        def _draft_levels(self, num_reqs: int, level_inputs: list) -> None:
            """Every request's tree into `tree buffers.tokens[:num_reqs]`, from the root buffers: device ops of
            static shapes only (no host sync, no allocation that depends on data), so that the same function runs
            eagerly and inside a CUDA graph. `level_inputs`: `_level_inputs(num_reqs, ...)`."""
            from vllm_treewy.vllm_plugin.mtp_tree_proposer import _slots
            from vllm_treewy.vllm_plugin.tree_sampler import _arange  # cached: built before any capture (warm-up)

            bufs = self._tree_buffers()
            buffers = self.input_buffers
            widest = 1 + self.nodes_below[-2]
            root_positions = bufs.root_positions[:num_reqs]
            tokens, outputs = bufs.tokens[:num_reqs], bufs.outputs[:num_reqs]
            outputs[:, 0] = bufs.root_output[:num_reqs]
            root_logits = self.model.compute_logits(bufs.root_output[:num_reqs])
            tokens[:, : self.widths[0]] = top_children(root_logits, self.widths[0]).view(num_reqs, -1)
            # The deepest level's block: every level's block is a prefix of it (positions, KV slots once per step).
            offsets = _arange(widest, self.device)
            positions = (root_positions[:, None] + self._constants(self.levels[-1]).depths).clamp_(
                max=self.max_model_len - 1)
            block_positions = root_positions[:, None] + offsets
            valid = bufs.valid[:num_reqs, None]
            slots = [torch.where(valid, _slots(table[:num_reqs], block_positions, size, self.max_model_len), PAD_SLOT)
                     for table, size in zip(self.block_tables.input_block_tables, self.block_tables.block_sizes)]
            query_offsets = _arange(self.max_num_reqs + 1, self.device)
            for level, (tree, (attn_metadata, slot_mappings)) in enumerate(zip(self.levels, level_inputs), start=1):
                first, last = self.nodes_below[level - 1], self.nodes_below[level]  # this level's nodes [first, last)
                block_len = 1 + tree.num_nodes
                num_tokens = num_reqs * block_len
                constants = self._constants(tree)
                input_ids = buffers.input_ids[:num_tokens].view(num_reqs, block_len)
                input_ids[:, 0] = bufs.root_tokens[:num_reqs]
                input_ids[:, 1:] = tokens[:, :last]
                hidden_states = self.hidden_states[:num_tokens].view(num_reqs, block_len, -1)
                hidden_states[:, 0] = bufs.root_hidden[:num_reqs]
                hidden_states[:, 1:] = outputs[:, constants.parent_blocks]
                buffers.positions[:num_tokens].view(num_reqs, block_len).copy_(positions[:, :block_len])
                buffers.query_start_loc[: num_reqs + 1].copy_(query_offsets[: num_reqs + 1] * block_len)
                buffers.seq_lens[:num_reqs].copy_(root_positions + block_len)
                for group, group_slots in enumerate(slots):
                    bufs.slots[group, :num_tokens].view(num_reqs, block_len).copy_(group_slots[:, :block_len])
                hidden, _ = self._run_model(num_tokens, attn_metadata, slot_mappings, None)
                output = hidden[:num_tokens].view(num_reqs, block_len, -1)
                outputs[:, 1 + first : 1 + last] = output[:, 1 + first :]
                logits = self.model.compute_logits(output[:, 1 + first :].reshape(-1, output.shape[-1]))
                tokens[:, last : self.nodes_below[level + 1]] = top_children(logits, self.widths[level]).view(
                    num_reqs, -1)

        def _level_graph_size(self, num_reqs: int) -> int | None:
            """The smallest captured padded request count that holds `num_reqs` (None: run the levels eagerly)."""
            fits = [size for size in self._level_graphs if size >= num_reqs]
            return min(fits) if fits else None

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
            written) and the lengths' host bound at max_model_len, which every replay stays within."""
            from vllm.compilation.cudagraph_pool import capture_pool
            from vllm.config.compilation import CUDAGraphMode
            from vllm.distributed.parallel_state import graph_capture
            from vllm.utils.torch_utils import current_stream

            self._level_graphs.clear()  # a capture replaces every earlier one
            manager = getattr(self, "prefill_cudagraph_manager", None)
            if manager is None or manager.cudagraph_mode.decode_mode() != CUDAGraphMode.FULL:
                return
            if self.tree_state.profiling_capture:
                # V2's graph-memory profiling throws its captures (and their pool) away before the real capture; the
                # level graphs (the head over <= max_num_seqs x 1 + nodes above the leaves tokens) stay out of it.
                return
            sizes = sorted({desc.num_reqs for desc in manager._capture_descs.get(CUDAGraphMode.FULL, ())
                            if desc.num_reqs})
            bufs = self._tree_buffers()
            saved, self.draft_max_seq_len = self.draft_max_seq_len, self.max_model_len
            try:
                with graph_capture(device=self.device):
                    for size in sorted(sizes, reverse=True):
                        bufs.root_positions[:size] = 0
                        bufs.valid[:size] = False
                        upper = torch.full((size,), self.max_model_len, dtype=torch.int32)
                        inputs = self._level_inputs(size, upper)
                        self._draft_levels(size, inputs)  # warm-up
                        graph = torch.cuda.CUDAGraph()
                        # as V2's CudaGraphManager.capture records its graphs: its pool, the capture stream
                        with (capture_pool(manager.pool, self.vllm_config) as pool,
                              torch.cuda.graph(graph, pool, stream=current_stream())):
                            self._draft_levels(size, inputs)
                        self._level_graphs[size] = (graph, inputs)
            finally:
                self.draft_max_seq_len = saved

        def _constants(self, tree) -> TreeConstants:
            if tree.num_nodes not in self._level_constants:
                self._level_constants[tree.num_nodes] = TreeConstants.of(tree, self.device)
            return self._level_constants[tree.num_nodes]

    TreeMtpSpeculatorV2.__qualname__ = TreeMtpSpeculatorV2.__name__
    return TreeMtpSpeculatorV2


def install() -> None:
    """CUDA only (V2 runs there), and only when the GPU check tries trees on V2."""
    if not trees_tried_on_v2():
        return
    if not getattr(V2_MTP_SPECULATOR.resolve(), "_treewy_tree_speculator", False):
        tree_class = make_tree_speculator_class(V2_MTP_SPECULATOR.resolve())
        tree_class._treewy_tree_speculator = True
        V2_MTP_SPECULATOR.replace(tree_class)
    for point in (V2_RUNNER_EXECUTE_MODEL, V2_RUNNER_CAPTURE_MODEL, V2_RUNNER_PROFILE_CUDAGRAPH_MEMORY):
        point.wrap(_binding_tree_state)
    INPUT_PROCESSOR_VALIDATE_PARAMS.wrap(_refusing_path_dependent_params)
    V2_RUNNER_PREPARE_ATTN.wrap(_finding_tree_rows)
    V2_MAMBA_PREPARE_ATTN.wrap(_handing_tree_to_attention)
    V2_RUNNER_SAMPLE.wrap(_sampling_trees)
