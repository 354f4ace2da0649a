"""Draft trees in vLLM's V1 model runner (CPU backend, or CUDA with FLASH_ATTN or TRITON_ATTN): one target pass
verifies every request's whole tree.

Per step, when the speculative config has a tree (`draft_tree_widths` with a width > 1) and the step's drafts are
trees (with `draft_tree_max_batch_size`, a step of a larger batch verifies MTP chains of the tree's depth: vLLM's own
chain path, causal attention and rejection sampler, with the GDN commit of what each slot verified last,
`gdn.step_metadata`):

1. `_prepare_inputs`: vLLM computes positions and slot mapping as for a chain of N drafts; the tree rows
   (`trees.step.find_tree_step`) get depth-based RoPE positions. The `TreeStep` rides on the step's
   `SpecDecodeMetadata` (a copy with the tree's fields, `trees.metadata`), and in the runner's tree state
   (`trees.run_state`, owned by its drafter) only until `_build_attention_metadata`, which hands it to the step's
   attention metadata. It also says whether the tree rows cover the batch (every other request a one-token query).
2. CUDA: a batch that looks like a uniform decode (every request 1 + N tokens) but is not all tree rows (a prefill
   chunk of 1 + N tokens) is not given to a FULL CUDA graph (`v1.full_graph_batches`, for chains too).
3. `_build_attention_metadata`: CPU: the tree step rides on the CPU attention metadata. TRITON_ATTN / FLASH_ATTN: a
   covering step (and every uniform decode batch of a CUDA-graph capture, where `_prepare_inputs` did not run) gets the
   tree bias / ancestor table on its metadata; a mixed step gets the tree step; the layers' caches are recorded for the
   compaction. The first build checks the layers' backends and settings (`trees.attention`, which Model Runner V2's
   hooks share).
4. Attention `forward` (`trees.attention`'s hooks, the same on either runner): CPU: vLLM's kernel attends the whole
   batch causally, then `tree_attention` overwrites the tree rows' output; the layer's caches are recorded.
   TRITON_ATTN (`trees.attention_triton`): with the bias, vLLM's own launch is tree attention (the bias reaches
   `unified_attention` through vLLM's forward context for the launch's duration; FULL CUDA graphs capture it); a
   mixed batch (PIECEWISE: attention runs eagerly) runs vLLM's causal launch, then the tree rows alone with the bias
   overwrite their output. FLASH_ATTN (`trees.attention_flash`): the prefix and ancestor passes merged by
   log-sum-exp, for the whole covering batch instead of vLLM's launch, or for the tree rows after it.
5. GDN layers: the step metadata carries the tree (`gdn.step_metadata`), reconstruct verifies it and commits the
   previous step's accepted leaf (`gdn.reconstruct.step_torch` on CPU, `step_triton` on CUDA).
6. `_sample`: tree acceptance with vLLM's sampler (`v1.sampler`), the accepted path's K/V compacted, the accepted
   leaf written into each GDN slot's count state for the next step's commit; the acceptance left in the tree state
   for the MTP proposer (`v1.proposer`), which drafts the next tree in the same step.

Refused at admission (`trees.admission.REFUSED_ON_V1_TREES`): a thinking-token budget and structured outputs, the two
sampling parameters whose vLLM state reads a tree row's drafts as a chain (that list's comment says why). A grammar
bitmask that still reaches the runner (`sample_tokens`, before vLLM's `apply_grammar_bitmask` masks a row's logits by
its position in node order) raises instead of being applied.

CUDA graphs: FULL for uniform decode batches of tree rows (vLLM's FULL_AND_PIECEWISE or FULL_DECODE_ONLY), attention
outside the graphs otherwise. `cudagraph_mode` FULL (mixed batches in full graphs too) is refused: a mixed batch's
tree rows need the eager post-pass.
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from vllm.platforms import current_platform
from vllm.v1.outputs import SamplerOutput

from vllm_treewy.vllm_plugin.gdn.prefix_caching import caches_gdn_prefixes
from vllm_treewy.vllm_plugin.patch_points import (
    RUNNER_BUILD_ATTENTION_METADATA,
    RUNNER_EAGLE_PROPOSER,
    RUNNER_PREPARE_INPUTS,
    RUNNER_SAMPLE,
    RUNNER_SAMPLE_TOKENS,
)
from vllm_treewy.vllm_plugin.trees.attention import check_tree_backends, hand_tree_to_attention_layers
from vllm_treewy.vllm_plugin.trees.metadata import replace_metadata, tree_step_of, with_tree
from vllm_treewy.vllm_plugin.trees.run_state import tree_state_of
from vllm_treewy.vllm_plugin.trees.sampling import record_accepted_leaves
from vllm_treewy.vllm_plugin.trees.step import TreeStep, find_tree_step, override_positions
from vllm_treewy.vllm_plugin.v1.accepted_counts import gdn_slot_counts
from vllm_treewy.vllm_plugin.v1.proposer import TreeMtpProposer
from vllm_treewy.vllm_plugin.v1.sampler import sample_with_trees


def covers_batch(step: TreeStep | None, query_start_loc: np.ndarray, num_reqs: int) -> bool:
    """Whether every request of the batch is a tree row or has a one-token query (`query_start_loc [num_reqs + 1]`
    numpy): then the tree bias is right for all of them (`trees.attention_triton`)."""
    if step is None:
        return False
    query_lens = np.diff(query_start_loc[: num_reqs + 1])
    return int((query_lens > 1).sum()) == step.num_requests


def _preparing_tree_rows(original):
    @functools.wraps(original)
    def prepare_inputs(self, scheduler_output, num_scheduled_tokens):
        result = original(self, scheduler_output, num_scheduled_tokens)
        state = tree_state_of(self)
        if state is None:
            return result
        state.pending_step, state.prepared = None, True
        spec_decode_metadata = result[1]
        if spec_decode_metadata is None:
            return result
        num_reqs = self.input_batch.num_reqs
        step = find_tree_step(
            state.tree, self.num_decode_draft_tokens.np[:num_reqs], np.asarray(spec_decode_metadata.num_draft_tokens),
            self.query_start_loc.np[: num_reqs + 1], self.input_batch.num_computed_tokens_cpu[:num_reqs],
            self.positions.device, chain_depth=state.chain_depth)
        if step is None:
            return result
        step.covers_batch = covers_batch(step, self.query_start_loc.np, num_reqs)
        override_positions(self.positions, step)
        state.pending_step = step
        return (result[0], with_tree(spec_decode_metadata, tree_step=step), *result[2:])

    return prepare_inputs


def _handing_tree_step_to_attention(original):
    @functools.wraps(original)
    def build_attention_metadata(self, *args, **kwargs):
        attn_metadata, spec_common = original(self, *args, **kwargs)
        state = tree_state_of(self)
        if state is None:
            return attn_metadata, spec_common
        step, prepared = state.pending_step, state.prepared
        state.pending_step, state.prepared = None, False  # one step's: never seen by a later (e.g. dummy) build
        if not state.backends_checked:
            per_layer = {}
            for metadata in attn_metadata if isinstance(attn_metadata, list) else [attn_metadata]:
                per_layer.update(metadata if isinstance(metadata, dict) else {})
            check_tree_backends(self.compilation_config, per_layer)
            state.backends_checked = bool(per_layer)
        if current_platform.is_cpu():
            if step is not None:
                from vllm.v1.attention.backends.cpu_attn import CPUAttentionMetadata  # the CPU backend's module

                replace_metadata(attn_metadata, lambda name, metadata: with_tree(metadata, tree_step=step)
                                 if isinstance(metadata, CPUAttentionMetadata) else None)
        else:
            hand_tree_to_attention_layers(state, self.compilation_config.static_forward_context, attn_metadata,
                                          step, prepared, self.device)
        return attn_metadata, spec_common

    return build_attention_metadata


def _sampling_trees(original):
    @functools.wraps(original)
    def sample(self, logits, spec_decode_metadata):
        state = tree_state_of(self)
        step: TreeStep | None = tree_step_of(spec_decode_metadata)
        if state is not None:
            state.accepted = None
        if step is None:
            return original(self, logits, spec_decode_metadata)
        if getattr(self.speculative_config, "synthetic_tree_acceptance_rates", None) is not None:
            raise NotImplementedError("synthetic_tree_acceptance_rates: synthetic tree acceptance runs on Model Runner "
                                      "V2 only (the V1 runner's tree sampler has no synthetic path); unset "
                                      "VLLM_USE_V2_MODEL_RUNNER=0")
        sampled, acceptance, logprobs = sample_with_trees(logits, spec_decode_metadata, step, self.sampler,
                                                          self.input_batch.sampling_metadata)
        if not caches_gdn_prefixes(self.cache_config):  # align mode: `v1.accepted_counts` records them with the
            for counts, slots in gdn_slot_counts(self, step.request_indices):  # boundary states, in the running slot
                record_accepted_leaves(counts, slots, acceptance)
        state.accepted = (step, acceptance)  # for the MTP proposer's propose of this step
        return SamplerOutput(sampled_token_ids=sampled, logprobs_tensors=logprobs)

    return sample


def _refusing_grammar_on_trees(original):
    @functools.wraps(original)
    def sample_tokens(self, grammar_output, *args, **kwargs):
        if grammar_output is not None and tree_state_of(self) is not None:
            raise NotImplementedError(
                "draft_tree_widths on the V1 model runner: structured outputs are refused at admission (the grammar "
                "bitmask is laid out for a chain of drafts, not a tree), yet a grammar bitmask reached the tree runner")
        return original(self, grammar_output, *args, **kwargs)

    return sample_tokens


def install() -> None:
    """The V1 runner's hooks (the attention backends' are `trees.attention.install`)."""
    RUNNER_EAGLE_PROPOSER.replace(TreeMtpProposer)  # MTP trees; chains and other methods run vLLM's class as is
    RUNNER_PREPARE_INPUTS.wrap(_preparing_tree_rows)
    RUNNER_BUILD_ATTENTION_METADATA.wrap(_handing_tree_step_to_attention)
    RUNNER_SAMPLE.wrap(_sampling_trees)
    RUNNER_SAMPLE_TOKENS.wrap(_refusing_grammar_on_trees)
