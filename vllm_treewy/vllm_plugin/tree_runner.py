"""Draft trees in vLLM's V1 model runner (CPU backend, or CUDA with TRITON_ATTN): one target pass verifies every
request's whole tree.

Per step, when the speculative config has a tree (`draft_tree_widths` with a width > 1) and the step's drafts are
trees (with `draft_tree_max_batch_size`, a step of a larger batch verifies MTP chains of the tree's depth: vLLM's own
chain path, causal attention and rejection sampler, with the GDN commit of what each slot verified last,
`step_metadata`):

1. `_prepare_inputs`: vLLM computes positions and slot mapping as for a chain of N drafts; the tree rows
   (`tree_step.find_tree_step`) get depth-based RoPE positions. The `TreeStep` rides on the step's
   `SpecDecodeMetadata` (a copy with the tree's fields, `tree_metadata`), and in the runner's tree state
   (`tree_run_state`, owned by its drafter) only until `_build_attention_metadata`, which hands it to the step's
   attention metadata. It also says whether the tree rows cover the batch (every other request a one-token query).
2. CUDA: a batch that looks like a uniform decode (every request 1 + N tokens) but is not all tree rows (a prefill
   chunk of 1 + N tokens) is not given to a FULL CUDA graph (`full_graph_batches`, for chains too).
3. `_build_attention_metadata`: CPU: the tree step rides on the CPU attention metadata. TRITON_ATTN: a covering step
   (and every uniform decode batch of a CUDA-graph capture, where `_prepare_inputs` did not run) gets the tree bias
   on its metadata; a mixed step gets the tree step; the layers' caches are recorded for the compaction. The first
   build checks the layers' backends and settings.
4. Attention `forward`: CPU: vLLM's kernel attends the whole batch causally, then `tree_attention` overwrites the
   tree rows' output; the layer's caches are recorded. TRITON_ATTN (`tree_attention_triton`): with the bias, vLLM's
   own launch is tree attention (the bias reaches `unified_attention` through vLLM's forward context for the
   launch's duration; FULL CUDA graphs capture it); a mixed batch (PIECEWISE: attention runs eagerly)
   runs vLLM's causal launch, then the tree rows alone with the bias overwrite their output.
5. GDN layers: the step metadata carries the tree (`step_metadata`), reconstruct verifies it and commits the
   previous step's accepted leaf (`reconstruct.step_torch` on CPU, `step_triton` on CUDA).
6. `_sample`: tree acceptance with vLLM's sampler (`tree_sampler`), the accepted path's K/V compacted, the accepted
   leaf written into each GDN slot's count state for the next step's commit; the acceptance left in the tree state
   for the MTP proposer (`mtp_tree_proposer`), which drafts the next tree in the same step.

Refused at admission (`REFUSED_ON_V1_TREES`, through `tree_admission`): a thinking-token budget and structured
outputs, the two sampling parameters whose vLLM state reads a tree row's drafts as a chain (below). A grammar bitmask
that still reaches the runner (`sample_tokens`, before vLLM's `apply_grammar_bitmask` masks a row's logits by its
position in node order) raises instead of being applied.

CUDA graphs: FULL for uniform decode batches of tree rows (vLLM's FULL_AND_PIECEWISE or FULL_DECODE_ONLY), attention
outside the graphs otherwise. `cudagraph_mode` FULL (mixed batches in full graphs too) is refused: a mixed batch's
tree rows need the eager post-pass.
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from vllm_treewy.vllm_plugin import tree_attention_triton
from vllm_treewy.vllm_plugin.accepted_counts import gdn_slot_counts
from vllm_treewy.vllm_plugin.mtp_tree_proposer import TreeMtpProposer
from vllm_treewy.vllm_plugin.prefix_caching import caches_gdn_prefixes
from vllm_treewy.vllm_plugin.tree_metadata import replace_metadata, tree_qq_bias_of, tree_step_of, with_tree
from vllm_treewy.vllm_plugin.tree_run_state import TreeRunState, tree_state_of
from vllm_treewy.vllm_plugin.patch_points import (
    CPU_ATTENTION_FORWARD,
    RUNNER_BUILD_ATTENTION_METADATA,
    RUNNER_EAGLE_PROPOSER,
    RUNNER_PREPARE_INPUTS,
    RUNNER_SAMPLE,
    RUNNER_SAMPLE_TOKENS,
    TRITON_ATTENTION_FORWARD,
    TRITON_UNIFIED_ATTENTION,
)
from vllm_treewy.vllm_plugin.tree_attention_cpu import split_kv_cache, tree_attention
from vllm_treewy.vllm_plugin.tree_sampler import record_accepted_leaves, sample_with_trees
from vllm_treewy.vllm_plugin.tree_step import (
    AttentionLayerCaches,
    PagedLayerCaches,
    TreeStep,
    find_tree_step,
    override_positions,
)

def covers_batch(step: TreeStep | None, query_start_loc: np.ndarray, num_reqs: int) -> bool:
    """Whether every request of the batch is a tree row or has a one-token query (`query_start_loc [num_reqs + 1]`
    numpy): then the tree bias is right for all of them (`tree_attention_triton`)."""
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


def _check_tree_backends(runner, per_layer: dict) -> None:
    """Draft trees read the CPU or TRITON_ATTN KV layout; any other attention backend is refused with its name, and
    so are TRITON_ATTN layers with settings the tree bias leaves wrong (`check_triton_tree_support`)."""
    from vllm.config import CUDAGraphMode
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.gdn_attn import GDNAttentionMetadata

    if current_platform.is_cpu():
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionMetadata as Supported
    else:
        from vllm.v1.attention.backends.triton_attn import TritonAttentionMetadata as Supported
    for name, metadata in per_layer.items():
        if not isinstance(metadata, (Supported, GDNAttentionMetadata)):
            raise ValueError(f"draft_tree_widths: layer {name} runs {type(metadata).__name__}; draft trees need "
                             "attention_backend='TRITON_ATTN' on CUDA (vLLM's CPU attention on CPU)")
        if not current_platform.is_cpu() and isinstance(metadata, Supported):
            check_triton_tree_support(runner.compilation_config.static_forward_context[name].impl)
    mode = runner.compilation_config.cudagraph_mode
    if mode is not None and mode.mixed_mode() == CUDAGraphMode.FULL:
        raise ValueError(f"draft_tree_widths: cudagraph_mode {mode.name} puts batches with prefills in FULL CUDA "
                         "graphs, where the tree rows' attention pass cannot run; use FULL_AND_PIECEWISE (vLLM's "
                         "default), FULL_DECODE_ONLY, PIECEWISE or NONE")


def _hand_to_triton_layers(state: TreeRunState, layers: dict, attn_metadata, step: TreeStep | None,
                           prepared: bool, device) -> None:
    """The tree bias or the tree step onto the TRITON_ATTN metadata, and each layer's cache into the step."""
    from vllm.v1.attention.backends.triton_attn import TritonAttentionMetadata

    tree = state.tree
    recorded = set()  # caches already recorded: a cache that layers share (KV sharing) is compacted once
    tree_rows_of = {}  # the tree rows of each block table: layers of one KV-cache group share theirs
    if step is not None:
        step.qq_bias = state.qq_bias(tree, device)

    def record(name, metadata):
        kv_cache = layers[name].kv_cache
        if kv_cache.data_ptr() not in recorded:
            recorded.add(kv_cache.data_ptr())
            table = metadata.block_table
            if id(table) not in tree_rows_of:
                tree_rows_of[id(table)] = table.index_select(0, step.request_indices)
            step.attention_layers.append(PagedLayerCaches(kv_cache, tree_rows_of[id(table)]))

    def replacement(name, metadata):
        if not isinstance(metadata, TritonAttentionMetadata):
            return None
        if step is not None:
            return with_tree(metadata, **({"tree_qq_bias": step.qq_bias} if step.covers_batch else
                                          {"tree_step": step}))
        if not prepared and metadata.max_query_len == 1 + tree.num_nodes:
            # A dummy run (CUDA-graph capture): its uniform decode batch stands for steps of tree rows only (a batch
            # with a prefill is never replayed in a FULL graph: `full_graph_batches`).
            return with_tree(metadata, tree_qq_bias=state.qq_bias(tree, device))
        return None

    replace_metadata(attn_metadata, replacement)
    if step is not None:
        for per_layer in attn_metadata if isinstance(attn_metadata, list) else [attn_metadata]:
            for name, metadata in per_layer.items():
                if isinstance(metadata, TritonAttentionMetadata):
                    record(name, metadata)


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
            _check_tree_backends(self, per_layer)
            state.backends_checked = bool(per_layer)
        from vllm.platforms import current_platform

        if current_platform.is_cpu():
            if step is not None:
                from vllm.v1.attention.backends.cpu_attn import CPUAttentionMetadata

                replace_metadata(attn_metadata, lambda name, metadata: with_tree(metadata, tree_step=step)
                                 if isinstance(metadata, CPUAttentionMetadata) else None)
        else:
            _hand_to_triton_layers(state, self.compilation_config.static_forward_context, attn_metadata, step,
                                   prepared, self.device)
        return attn_metadata, spec_common

    return build_attention_metadata


def _attending_tree_rows(original):
    @functools.wraps(original)
    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs):
        output = original(self, layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs)
        step: TreeStep | None = tree_step_of(attn_metadata)
        if step is None:
            return output
        key_cache, value_cache = split_kv_cache(kv_cache)
        rows = step.request_indices
        block_table = attn_metadata.block_table[rows]
        tree_out = tree_attention(
            query[step.token_indices], key_cache, value_cache, query_start_loc=step.query_start_loc,
            seq_lens=attn_metadata.seq_lens[rows], block_table=block_table, block_ancestors=step.block_ancestors,
            max_query_len=step.block_len, max_seq_len=attn_metadata.max_seq_len, scale=self.scale, isa=layer.isa,
            # the layer's other settings too: tree_attention refuses what it does not compute
            sliding_window=self.sliding_window, logits_soft_cap=self.logits_soft_cap, alibi_slopes=self.alibi_slopes,
            sinks=self.sinks,
        )
        output.view(output.shape[0], -1)[step.token_indices] = tree_out.view(tree_out.shape[0], -1).to(output.dtype)
        step.attention_layers.append(AttentionLayerCaches(key_cache, value_cache, block_table, layer.isa))
        return output

    return forward


QQ_BIAS_KEY = "treewy_tree_qq_bias"  # in vLLM's forward context (additional_kwargs) while a biased launch runs


def _passing_qq_bias(original):
    @functools.wraps(original)
    def unified_attention(*args, **kwargs):
        from vllm.forward_context import get_forward_context, is_forward_context_available

        if kwargs.get("qq_bias") is None and is_forward_context_available():
            bias = get_forward_context().additional_kwargs.get(QQ_BIAS_KEY)
            if bias is not None:
                kwargs["qq_bias"] = bias
        return original(*args, **kwargs)

    return unified_attention


def check_triton_tree_support(impl) -> None:
    """What the tree bias leaves right: positions enter vLLM's kernel only through sliding windows, ALiBi and
    chunked attention (block index there, not depth), and quantized caches take other loads; all refused."""
    from vllm.utils.torch_utils import is_quantized_kv_cache
    from vllm.v1.attention.backend import AttentionType

    reasons = []
    if is_quantized_kv_cache(impl.kv_cache_dtype):
        reasons.append(f"kv_cache_dtype {impl.kv_cache_dtype!r} (only unquantized KV)")
    if tuple(impl.sliding_window) != (-1, -1) or impl.chunk_lookback != -1:
        reasons.append("a sliding window or chunked attention")
    if impl.alibi_slopes is not None:
        reasons.append("ALiBi")
    if impl.attn_type != AttentionType.DECODER:
        reasons.append(f"attention type {impl.attn_type}")
    if reasons:
        raise NotImplementedError("draft_tree_widths with TRITON_ATTN: not supported with " + ", ".join(reasons))


def _attending_tree_rows_triton(original):
    @functools.wraps(original)
    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs):
        bias, step = tree_qq_bias_of(attn_metadata), tree_step_of(attn_metadata)
        if bias is None and step is None:
            return original(self, layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs)
        if bias is not None:  # the whole batch: tree rows and one-token queries; vLLM's launch takes the bias
            from vllm.forward_context import get_forward_context

            extra = get_forward_context().additional_kwargs
            extra[QQ_BIAS_KEY] = bias
            try:
                return original(self, layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs)
            finally:
                del extra[QQ_BIAS_KEY]
        output = original(self, layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs)
        key_cache, value_cache = tree_attention_triton.split_kv_cache(kv_cache, self.head_size)
        descale = layer._k_scale.expand(step.num_requests, key_cache.shape[2])
        tree_attention_triton.tree_rows_attention(
            TRITON_UNIFIED_ATTENTION.resolve(), query, key_cache, value_cache, output,
            token_indices=step.token_indices, request_indices=step.request_indices,
            tree_query_start_loc=step.query_start_loc, seq_lens=attn_metadata.seq_lens,
            block_table=attn_metadata.block_table, block_len=step.block_len, max_seq_len=attn_metadata.max_seq_len,
            scale=self.scale, qq_bias=step.qq_bias, k_descale=descale, v_descale=descale,
            softcap=self.logits_soft_cap, sinks=self.sinks)
        return output

    return forward


def _sampling_trees(original):
    @functools.wraps(original)
    def sample(self, logits, spec_decode_metadata):
        state = tree_state_of(self)
        step: TreeStep | None = tree_step_of(spec_decode_metadata)
        if state is not None:
            state.accepted = None
        if step is None:
            return original(self, logits, spec_decode_metadata)
        from vllm.v1.outputs import SamplerOutput

        sampled, acceptance, logprobs = sample_with_trees(logits, spec_decode_metadata, step, self.sampler,
                                                          self.input_batch.sampling_metadata)
        if not caches_gdn_prefixes(self.cache_config):  # align mode: `accepted_counts` records them with the
            for counts, slots in gdn_slot_counts(self, step.request_indices):  # boundary states, in the running slot
                record_accepted_leaves(counts, slots, acceptance)
        state.accepted = (step, acceptance)  # for the MTP proposer's propose of this step
        return SamplerOutput(sampled_token_ids=sampled, logprobs_tensors=logprobs)

    return sample


# What the V1 tree path does not make exact, as (name, neutral value); refused at admission (`tree_admission`):
# - thinking_token_budget: vLLM's `ThinkingBudgetStateHolder` counts a row's context as its committed output plus
#   `spec_token_ids` (a tree row's drafts in node order) and advances its state machine on every sampler call (the
#   level path calls it once per level), so a node's forced end-of-thinking lands at the wrong depth or not at all;
# - structured_outputs: the scheduler validates a row's drafts as a chain in node order (keeping them up to the
#   first node that does not follow its predecessor: a partial tree, which `find_tree_step` raises on) and fills the
#   grammar bitmask of draft position i from the grammar advanced over drafts 0 .. i - 1, which
#   `apply_grammar_bitmask` puts on the logits row of node i, not of its path.
# Penalties, bad words and seeds are exact on V1 (the level path hands vLLM each node's path).
REFUSED_ON_V1_TREES = (("thinking_token_budget", None), ("structured_outputs", None))


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
    from vllm.platforms import current_platform

    RUNNER_EAGLE_PROPOSER.replace(TreeMtpProposer)  # MTP trees; chains and other methods run vLLM's class as is
    RUNNER_PREPARE_INPUTS.wrap(_preparing_tree_rows)
    RUNNER_BUILD_ATTENTION_METADATA.wrap(_handing_tree_step_to_attention)
    RUNNER_SAMPLE.wrap(_sampling_trees)
    RUNNER_SAMPLE_TOKENS.wrap(_refusing_grammar_on_trees)
    if current_platform.is_cpu():
        CPU_ATTENTION_FORWARD.wrap(_attending_tree_rows)
    else:
        TRITON_ATTENTION_FORWARD.wrap(_attending_tree_rows_triton)
        TRITON_UNIFIED_ATTENTION.wrap(_passing_qq_bias)
