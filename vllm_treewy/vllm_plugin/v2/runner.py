"""Draft trees in vLLM's Model Runner V2 (`vllm/v1/worker/gpu/`, CUDA with FLASH_ATTN or TRITON_ATTN), the runner
vLLM picks on CUDA; VLLM_USE_V2_MODEL_RUNNER=0 puts them on the V1 runner's hooks (`v1.runner`), as vLLM's CPU
backend does.

What V2 shares with the V1 tree path (`v1.runner`), through `trees` and `gdn`:

- the tree step (`trees.step.find_tree_step`: the tree rows, their block tokens, parents, position shifts) and the
  depth RoPE positions (`trees.step.override_positions`);
- tree attention on TRITON_ATTN and FLASH_ATTN (`trees.attention.hand_tree_to_attention_layers` puts the tree bias
  or ancestor table, or for a batch with prefills the tree step, onto the step's attention metadata and records the
  layers' caches; the attention forward hooks, `trees.attention`, serve either runner);
- the GDN side: V2 calls the same GDN metadata builder, so `gdn.step_metadata` gives the tree's commit nodes and
  counts, and the reconstruct layer verifies along the tree (nothing V2-specific);
- the accepted path's K/V compaction (`trees.sampling.commit_accepted_path`); V2's acceptance itself (the one-call
  walk and V2's output rows, `kernels.tree_acceptance_*`, and the accepted leaves' counts) is `v2.acceptance`;
- the MTP drafting levels' topology (`spec_decode.tree_drafting`) and the first pass's accepted-path-as-chain inputs
  (`trees.drafting.accepted_paths_as_chains`, `kv_slots`).

What V2 does its own way, and the hook for each (all in `patch_points.py`):

1. `GPUModelRunner.prepare_attn` (V2_RUNNER_PREPARE_ATTN, real steps only): V2 computed positions on the device
   and the slot mappings from them; the tree rows are found from V2's host arrays (`num_draft_tokens_per_req`,
   `is_prefilling_np`, `query_start_loc_np`), each root's position is read on the device (V2's host count of
   computed tokens is an upper bound under async scheduling), and the tree tokens get depth positions in V2's
   persistent positions buffer (a FULL graph reads it in place).
2. `MambaHybridModelState.prepare_attn` (V2_MAMBA_PREPARE_ATTN; real steps, dummy runs and graph captures): the tree
   bias, ancestor table or step onto the TRITON_ATTN / FLASH_ATTN metadata, as V1's `_build_attention_metadata` hook
   does. A capture or dummy run of a uniform 1 + N decode batch gets the bias or table (V2 replays FULL decode graphs
   for decode-only batches, every row a tree row or a one-token decode); the drafter's own first-pass graphs are
   captured without it, and so are the target's 1 + D decode graphs of `draft_tree_max_batch_size` (chain steps: vLLM's
   causal attention).
3. `GPUModelRunner.sample` (V2_RUNNER_SAMPLE): tree acceptance instead of V2's rejection sampler. V2's sampler draws
   every verified token's row in ONE call (`Sampler.sample`), its Gumbel noise keyed by (request seed, position):
   with depth positions, a node at depth d draws with the noise plain decoding uses at that position, so walking the
   tree over these draws (the one-call walk of `spec_decode.tree_sampling`, one Triton launch on V2's logits layout,
   `kernels.tree_acceptance_triton`: move to the child carrying the draw) emits exactly
   what the request's sampling would (the proof in `spec_decode.tree_sampling` needs one fresh draw per walked level;
   nodes off the walk use noise of positions the walk either emits at or never reaches this step, and a step's
   stopping depth depends only on the noise up to it). Greedy rows take the argmax there. One sampler call, no host
   sync. What reads a row's tokens as a chain is not exact on a tree: V2's repetition / frequency / presence
   penalties and its bad-words matching (a node's prefix match would read its siblings' drafts, for bad words of
   3 or more tokens) take the row's drafts in node order, and its thinking-token budget counts a node's context as
   the root plus its place in node order; a grammar's state (structured outputs) follows one path. Requests that
   use any of them are REFUSED at admission on V2 trees (`trees.admission.REFUSED_ON_V2_TREES`: a VLLMValidationError
   naming the parameter; bad words are refused whatever their length, which is known only after tokenization); the V1
   runner treats penalties and bad words exactly (its level path) and refuses the thinking budget and structured outputs
   (`v1.runner`). Temperature, top-k, top-p, min-p and logit bias act per row and are exact. The acceptance on V2's
   logits layout (`sample_tree_step`): `v2.sampler`, its static-shape body `v2.acceptance`. A step whose requests are
   all tree rows replays its post-sampler work (walk, compaction, GDN counts) as one CUDA graph per padded request
   count, captured right after V2's capture phase (V2_RUNNER_CAPTURE_MODEL, again): `v2.accept_graphs`.
4. The MTP drafter (V2_MTP_SPECULATOR, `TreeMtpSpeculatorV2`): `v2.speculator`.
5. `GPUModelRunner.add_requests` (V2_RUNNER_ADD_REQUESTS), only with synthetic tree acceptance (benchmarks:
   `rejection_sample_method: "synthetic"` with a tree, `trees.synthetic`): each new request's rates into its request
   slot's row, read by hook 3's acceptance by request state. vLLM's own synthetic path is its rejection sampler, which
   hook 3 replaces on tree steps: there the synthetic draw replaces only the walk's accept decision (the bonus is V2's
   draw, compaction and GDN commit are the real ones); chain steps (`draft_tree_max_batch_size`) keep vLLM's synthetic
   chain with the chain's rates (`config`).

State across calls: the speculator's `TreeRunStateV2` (`tree_state`), which the runner owns through its speculator.
The model state's `prepare_attn` does not reach the runner, so the runner's entry points (execute_model,
capture_model, profile_cudagraph_memory) bind the state to a ContextVar for the call only (`_CALL_TREE_STATE`, reset
after it): no module state outlives a call, and no attribute is added to vLLM's objects.
"""

from __future__ import annotations

import contextvars
import functools

import numpy as np

from vllm_treewy.tree import DraftTree
from vllm_treewy.vllm_plugin.config import draft_tree_of
from vllm_treewy.vllm_plugin.patch_points import (
    V2_MAMBA_PREPARE_ATTN,
    V2_RUNNER_ADD_REQUESTS,
    V2_MTP_SPECULATOR,
    V2_RUNNER_CAPTURE_MODEL,
    V2_RUNNER_EXECUTE_MODEL,
    V2_RUNNER_PREPARE_ATTN,
    V2_RUNNER_PROFILE_CUDAGRAPH_MEMORY,
    V2_RUNNER_SAMPLE,
)
from vllm_treewy.vllm_plugin.trees.attention import check_tree_backends, hand_tree_to_attention_layers
from vllm_treewy.vllm_plugin.trees.step import (
    TreeConstants,
    TreeStep,
    find_tree_step,
    override_positions,
    uniform_tree_step,
)
from vllm_treewy.vllm_plugin.v2.accept_graphs import capture_accept_graphs
from vllm_treewy.vllm_plugin.v2.run_state import TreeRunStateV2
from vllm_treewy.vllm_plugin.v2.sampler import sample_tree_step
from vllm_treewy.vllm_plugin.v2.speculator import make_tree_speculator_class

# -- the step's tree rows from V2's input batch -----------------------------------------------------------------

def decode_draft_counts(num_draft_tokens_per_req: np.ndarray | None, is_prefilling: np.ndarray,
                        num_reqs: int) -> tuple[np.ndarray, np.ndarray]:
    """`(num_decode_draft_tokens, num_draft_tokens)` `[num_reqs]` as `find_tree_step` takes them (V1's meaning:
    a decode's scheduled drafts, -1 for a prefill chunk), from V2's per-request draft counts (None: no drafts
    scheduled) and `is_prefilling_np`."""
    drafts = (np.zeros(num_reqs, dtype=np.int64) if num_draft_tokens_per_req is None
              else np.asarray(num_draft_tokens_per_req[:num_reqs], dtype=np.int64))
    return np.where(np.asarray(is_prefilling[:num_reqs], dtype=bool), -1, drafts), drafts


def find_tree_step_v2(tree: DraftTree, input_batch, constants: TreeConstants | None = None,
                      chain_depth: int = 0) -> TreeStep | None:
    """The step's tree rows in V2's `InputBatch`, with each root's position read from V2's device positions (before
    they are overridden). Host arrays only decide which rows: no host sync. When every request is a tree row (the
    decode steps V2 replays FULL graphs for) and the tree's `constants` on the device are given, the step is the
    batch size's cached `uniform_tree_step`: no host-to-device copy, a handful of launches. `chain_depth`: as
    `find_tree_step` (a step of chains under `draft_tree_max_batch_size` has no tree rows: None)."""
    num_reqs = input_batch.num_reqs
    is_prefilling = np.asarray(input_batch.is_prefilling_np[:num_reqs], dtype=bool)
    if input_batch.prefill_runs_as_decode_np is not None:
        # A prompt tail padded with placeholder drafts runs as a speculative row (V2's model state, GDN included).
        is_prefilling = is_prefilling & ~np.asarray(input_batch.prefill_runs_as_decode_np[:num_reqs], dtype=bool)
    decode_drafts, drafts = decode_draft_counts(input_batch.num_draft_tokens_per_req, is_prefilling, num_reqs)
    positions = input_batch.positions
    if constants is not None and num_reqs > 0 and bool((decode_drafts == tree.num_nodes).all()):
        # Every row a tree row: V2 lays the blocks out back to back from token 0; a copy of the roots' positions
        # (the buffer is V2's persistent one, rewritten next step).
        block_len = 1 + tree.num_nodes
        roots = positions[: num_reqs * block_len].view(num_reqs, block_len)[:, 0].long().clone()
        return uniform_tree_step(tree, roots, constants)
    step = find_tree_step(tree, decode_drafts, drafts, np.asarray(input_batch.query_start_loc_np[: num_reqs + 1]),
                          np.zeros(num_reqs, dtype=np.int64), positions.device, chain_depth=chain_depth)
    if step is None:
        return None
    roots = step.token_indices.view(step.num_requests, step.block_len)[:, 0]
    step.root_positions = positions[roots].long()
    query_lens = np.diff(np.asarray(input_batch.query_start_loc_np[: num_reqs + 1]))
    step.covers_batch = int((query_lens > 1).sum()) == step.num_requests
    return step


# -- the runner's hooks ------------------------------------------------------------------------------------------

# The tree state of the runner call in progress (execute_model, capture_model, profile_cudagraph_memory), for the
# model state's prepare_attn, which does not reach the runner. Bound for the call only and reset after it: the state
# itself lives on the runner's speculator (`TreeMtpSpeculatorV2.tree_state`), nothing here outlives a call.
_CALL_TREE_STATE: contextvars.ContextVar = contextvars.ContextVar("treewy_v2_call_tree_state", default=None)


def tree_state_of_runner(runner) -> TreeRunStateV2 | None:
    state = getattr(getattr(runner, "speculator", None), "tree_state", None)
    # The config read on purpose: the check that the speculator holds the tree state the config asks for.
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


def _capturing_tree_acceptance(original):
    """V2's capture phase, then the post-sampler graphs (`v2.accept_graphs.capture_accept_graphs`)."""

    @functools.wraps(original)
    def capture_model(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        state = getattr(getattr(self, "speculator", None), "tree_state", None)
        if state is not None:
            capture_accept_graphs(self, state)
        return result

    return capture_model


def _finding_tree_rows(original):
    @functools.wraps(original)
    def prepare_attn(self, input_batch, *args, **kwargs):
        result = original(self, input_batch, *args, **kwargs)  # the slot mappings from vLLM's positions
        state = tree_state_of_runner(self)
        if state is None:
            return result
        step = find_tree_step_v2(state.tree, input_batch, self.speculator.tree_constants(state.tree),
                                 chain_depth=state.chain_depth)
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
        if not state.backends_checked:
            per_layer = attn_metadata if isinstance(attn_metadata, dict) else {}
            check_tree_backends(self.vllm_config.compilation_config, per_layer)
            state.backends_checked = bool(per_layer)
        hand_tree_to_attention_layers(state, self.vllm_config.compilation_config.static_forward_context,
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


def _adding_synthetic_rates(original):
    """V2's add_requests, then each new request's synthetic tree acceptance rates (its extra_args', else the engine's)
    into its request slot's row (`trees.synthetic`), read once per request."""

    @functools.wraps(original)
    def add_requests(self, scheduler_output, *args, **kwargs):
        result = original(self, scheduler_output, *args, **kwargs)
        state = getattr(getattr(self, "speculator", None), "tree_state", None)
        if state is not None and state.synthetic is not None:
            for new_req in scheduler_output.scheduled_new_reqs:
                if new_req.sampling_params is not None:
                    state.synthetic.add_request(self.req_states.req_id_to_index[new_req.req_id],
                                                new_req.sampling_params.extra_args)
        return result

    return add_requests


def install() -> None:
    """CUDA only (V2 runs there)."""
    if not getattr(V2_MTP_SPECULATOR.resolve(), "_treewy_tree_speculator", False):
        tree_class = make_tree_speculator_class(V2_MTP_SPECULATOR.resolve())
        tree_class._treewy_tree_speculator = True
        V2_MTP_SPECULATOR.replace(tree_class)
    V2_RUNNER_CAPTURE_MODEL.wrap(_capturing_tree_acceptance)  # inside the state binding (its profiling flag)
    for point in (V2_RUNNER_EXECUTE_MODEL, V2_RUNNER_CAPTURE_MODEL, V2_RUNNER_PROFILE_CUDAGRAPH_MEMORY):
        point.wrap(_binding_tree_state)
    V2_RUNNER_PREPARE_ATTN.wrap(_finding_tree_rows)
    V2_MAMBA_PREPARE_ATTN.wrap(_handing_tree_to_attention)
    V2_RUNNER_SAMPLE.wrap(_sampling_trees)
    V2_RUNNER_ADD_REQUESTS.wrap(_adding_synthetic_rates)
