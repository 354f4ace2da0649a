"""Draft trees in vLLM's V1 model runner (CPU): one target pass verifies every request's whole tree.

Per step, when the speculative config has a tree (`draft_tree_widths` with a width > 1):

1. `_prepare_inputs`: vLLM computes positions and slot mapping as for a chain of N drafts; the tree rows
   (`tree_step.find_tree_step`) get depth-based RoPE positions. The `TreeStep` rides on the step's
   `SpecDecodeMetadata`, and on the runner only until `_build_attention_metadata`, which hands it to the step's
   CPU attention metadata and drops it.
2. CPU attention `forward`: vLLM's kernel attends the whole batch causally, then `tree_attention` overwrites the
   tree rows' output with tree-masked attention; the layer's caches are recorded for the compaction.
3. GDN layers: the step metadata carries the tree (`step_metadata`), reconstruct verifies it and commits the
   previous step's accepted leaf.
4. `_sample`: greedy tree acceptance (`tree_sampler`), the accepted path's K/V compacted, the accepted leaf written
   into each GDN slot's count state for the next step's commit.
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from vllm_treewy.vllm_plugin.accepted_counts import gdn_slot_counts
from vllm_treewy.vllm_plugin.config import draft_tree_of
from vllm_treewy.vllm_plugin.patch_points import (
    CPU_ATTENTION_FORWARD,
    RUNNER_BUILD_ATTENTION_METADATA,
    RUNNER_PREPARE_INPUTS,
    RUNNER_SAMPLE,
)
from vllm_treewy.vllm_plugin.tree_attention_cpu import split_kv_cache, tree_attention
from vllm_treewy.vllm_plugin.tree_sampler import check_greedy, record_accepted_leaves, sample_with_trees
from vllm_treewy.vllm_plugin.tree_step import AttentionLayerCaches, TreeStep, find_tree_step, override_positions

TREE_STEP = "treewy_tree_step"  # attribute name on the step's metadata objects
_PENDING_TREE_STEP = "_treewy_pending_tree_step"  # on the runner, from _prepare_inputs to _build_attention_metadata


def _runner_tree(runner):
    return draft_tree_of(runner.speculative_config) if runner.speculative_config is not None else None


def _preparing_tree_rows(original):
    @functools.wraps(original)
    def prepare_inputs(self, scheduler_output, num_scheduled_tokens):
        result = original(self, scheduler_output, num_scheduled_tokens)
        setattr(self, _PENDING_TREE_STEP, None)
        tree = _runner_tree(self)
        spec_decode_metadata = result[1]
        if tree is None or spec_decode_metadata is None:
            return result
        num_reqs = self.input_batch.num_reqs
        step = find_tree_step(
            tree, self.num_decode_draft_tokens.np[:num_reqs], np.asarray(spec_decode_metadata.num_draft_tokens),
            self.query_start_loc.np[: num_reqs + 1], self.input_batch.num_computed_tokens_cpu[:num_reqs],
            self.positions.device)
        if step is not None:
            override_positions(self.positions, step)
            setattr(spec_decode_metadata, TREE_STEP, step)
            setattr(self, _PENDING_TREE_STEP, step)
        return result

    prepare_inputs.prepares_tree_rows = True
    return prepare_inputs


def _handing_tree_step_to_attention(original):
    @functools.wraps(original)
    def build_attention_metadata(self, *args, **kwargs):
        attn_metadata, spec_common = original(self, *args, **kwargs)
        step = getattr(self, _PENDING_TREE_STEP, None)
        setattr(self, _PENDING_TREE_STEP, None)  # one step's: never seen by a later (e.g. dummy) build
        if step is not None:
            per_layer = attn_metadata if isinstance(attn_metadata, dict) else {}
            from vllm.v1.attention.backends.cpu_attn import CPUAttentionMetadata

            for metadata in per_layer.values():
                if isinstance(metadata, CPUAttentionMetadata):
                    setattr(metadata, TREE_STEP, step)
        return attn_metadata, spec_common

    build_attention_metadata.hands_tree_step = True
    return build_attention_metadata


def _attending_tree_rows(original):
    @functools.wraps(original)
    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs):
        output = original(self, layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs)
        step: TreeStep | None = getattr(attn_metadata, TREE_STEP, None)
        if step is None:
            return output
        key_cache, value_cache = split_kv_cache(kv_cache)
        rows = step.request_indices
        block_table = attn_metadata.block_table[rows]
        tree_out = tree_attention(
            query[step.token_indices], key_cache, value_cache, query_start_loc=step.query_start_loc,
            seq_lens=attn_metadata.seq_lens[rows], block_table=block_table, block_ancestors=step.block_ancestors,
            max_query_len=step.block_len, max_seq_len=attn_metadata.max_seq_len, scale=self.scale, isa=layer.isa,
            sliding_window=self.sliding_window,
        )
        output.view(output.shape[0], -1)[step.token_indices] = tree_out.view(tree_out.shape[0], -1).to(output.dtype)
        step.attention_layers.append(AttentionLayerCaches(key_cache, value_cache, block_table, layer.isa))
        return output

    forward.attends_tree_rows = True
    return forward


def _sampling_trees(original):
    @functools.wraps(original)
    def sample(self, logits, spec_decode_metadata):
        step: TreeStep | None = getattr(spec_decode_metadata, TREE_STEP, None)
        if step is None:
            return original(self, logits, spec_decode_metadata)
        from vllm.v1.outputs import SamplerOutput

        check_greedy(self.input_batch.sampling_metadata)
        sampled, acceptance = sample_with_trees(logits, spec_decode_metadata, step, self.input_batch.num_reqs)
        for counts, slots in gdn_slot_counts(self, step.request_indices):
            record_accepted_leaves(counts, slots, acceptance)
        return SamplerOutput(sampled_token_ids=sampled, logprobs_tensors=None)

    sample.samples_trees = True
    return sample


def install() -> None:
    for point, wrap, marker in (
        (RUNNER_PREPARE_INPUTS, _preparing_tree_rows, "prepares_tree_rows"),
        (RUNNER_BUILD_ATTENTION_METADATA, _handing_tree_step_to_attention, "hands_tree_step"),
        (RUNNER_SAMPLE, _sampling_trees, "samples_trees"),
        (CPU_ATTENTION_FORWARD, _attending_tree_rows, "attends_tree_rows"),
    ):
        if not getattr(point.resolve(), marker, False):
            point.replace(wrap(point.resolve()))
