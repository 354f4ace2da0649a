"""Draft trees in vLLM's attention backends, for both runners (V1's `v1.runner`, Model Runner V2's `v2.runner`): the
tree rows' attention in the CPU, TRITON_ATTN and FLASH_ATTN layers' `forward`, the check of each layer's backend and
settings, and the hand-over of a step's tree (bias, ancestor table or step) to the layers' metadata.

- CPU: vLLM's kernel attends the whole batch causally, then `trees.attention_cpu.tree_attention` overwrites the
  tree rows' output; the layer's caches are recorded for the compaction.
- TRITON_ATTN (`trees.attention_triton`): with the tree bias on the metadata (a step whose tree rows cover the batch,
  or a CUDA-graph capture's uniform decode batch), vLLM's own launch is tree attention: the bias reaches
  `unified_attention` through vLLM's forward context for the launch's duration (FULL CUDA graphs capture it); a
  mixed batch (attention runs eagerly) runs vLLM's causal launch, then the tree rows alone with the bias overwrite
  their output. TRITON_ATTN keeps this one-launch path rather than the two passes: the bias is vLLM's own kernel
  argument, and a covering step costs one launch instead of two.
- FLASH_ATTN (`trees.attention_flash`, FlashAttention 2 or 3): with the tree's ancestor table on the metadata (the
  same covering steps and captures), the two passes (prefix over the paged cache with vLLM's FlashAttention call,
  then ancestors among the new tokens with the merge by log-sum-exp folded in, written into the layer's output)
  replace vLLM's launch for the whole batch (FULL CUDA graphs capture them); a mixed batch runs vLLM's causal launch,
  then the two passes over the tree rows alone overwrite their output. The prefix pass's committed lengths are
  computed once per step at the hand-over (`tree_prefix_lens` on the metadata; for covering steps in a persistent
  buffer, `TreeRunState.prefix_lens`), not per layer; the drafting levels' metadata has none (V2's level graphs
  write their lengths inside the graph, after the metadata is built; V1's levels' lengths are fresh tensors), so
  their layer (the MTP head's one) computes its own.

Both CUDA backends keep the same paged KV layout, so the accepted path's compaction is one kernel for both
(`trees.sampling.commit_accepted_path`: `kernels.paged_kv_compaction_*`), its layers recorded when the metadata is
built.
"""

from __future__ import annotations

import functools

from vllm.config import CUDAGraphMode
from vllm.forward_context import get_forward_context, is_forward_context_available
from vllm.platforms import current_platform
from vllm.utils.torch_utils import is_quantized_kv_cache
from vllm.v1.attention.backend import AttentionType
from vllm.v1.attention.backends.gdn_attn import GDNAttentionMetadata

from vllm_treewy.vllm_plugin.patch_points import (
    CPU_ATTENTION_FORWARD,
    FLASH_ATTENTION_FORWARD,
    FLASH_ATTN_VARLEN_FUNC,
    TRITON_ATTENTION_FORWARD,
    TRITON_UNIFIED_ATTENTION,
)
from vllm_treewy.vllm_plugin.trees import attention_flash, attention_triton
from vllm_treewy.vllm_plugin.trees.attention_cpu import split_kv_cache, tree_attention
from vllm_treewy.vllm_plugin.trees.metadata import (
    replace_metadata,
    tree_block_ancestors_of,
    tree_prefix_lens_of,
    tree_qq_bias_of,
    tree_step_of,
    with_tree,
)
from vllm_treewy.vllm_plugin.trees.run_state import TreeRunState
from vllm_treewy.vllm_plugin.trees.step import AttentionLayerCaches, PagedLayerCaches, TreeStep


TREE_BACKENDS_ON_CUDA = ("FLASH_ATTN", "TRITON_ATTN")  # vLLM's backend names, as `attention_backend` takes them


def _tree_metadata_classes() -> dict:
    """vLLM's metadata class of each backend with a tree path on this platform, by backend name. Looked up at call
    time: each backend module imports on its own platform only."""
    if current_platform.is_cpu():
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionMetadata
        return {"CPU_ATTN": CPUAttentionMetadata}
    from vllm.v1.attention.backends.flash_attn import FlashAttentionMetadata
    from vllm.v1.attention.backends.triton_attn import TritonAttentionMetadata
    return {"FLASH_ATTN": FlashAttentionMetadata, "TRITON_ATTN": TritonAttentionMetadata}


def check_tree_backends(compilation_config, per_layer: dict) -> None:
    """Draft trees run on vLLM's CPU attention on CPU, and on FLASH_ATTN (FlashAttention 2 or 3) or TRITON_ATTN on
    CUDA; any other attention backend is refused with its name and the supported ones, and so are layers whose
    settings the tree path leaves wrong (`check_triton_tree_support`, `check_flash_tree_support`)."""
    supported = _tree_metadata_classes()
    for name, metadata in per_layer.items():
        if not isinstance(metadata, (*supported.values(), GDNAttentionMetadata)):
            raise ValueError(f"draft_tree_widths: layer {name} runs {type(metadata).__name__}; draft trees need "
                             f"attention_backend in {TREE_BACKENDS_ON_CUDA} on CUDA (vLLM's CPU attention on CPU)")
        if isinstance(metadata, supported.get("TRITON_ATTN", ())):
            check_triton_tree_support(compilation_config.static_forward_context[name].impl)
        elif isinstance(metadata, supported.get("FLASH_ATTN", ())):
            check_flash_tree_support(compilation_config.static_forward_context[name].impl)
    mode = compilation_config.cudagraph_mode
    if mode is not None and mode.mixed_mode() == CUDAGraphMode.FULL:
        raise ValueError(f"draft_tree_widths: cudagraph_mode {mode.name} puts batches with prefills in FULL CUDA "
                         "graphs, where the tree rows' attention pass cannot run; use FULL_AND_PIECEWISE (vLLM's "
                         "default), FULL_DECODE_ONLY, PIECEWISE or NONE")


def uniform_tree_marking(state: TreeRunState, tree, device, prefix_lens=None):
    """`replace_metadata`'s replacement for a batch whose requests are all rows of `tree` or one-token decodes: the
    tree's bias onto TRITON_ATTN metadata, its ancestor table onto FLASH_ATTN metadata (the whole batch's launch
    becomes tree attention); other metadata kept. `prefix_lens(metadata)`: the FLASH_ATTN metadata's committed
    lengths for its `tree_prefix_lens`, where its `seq_lens` already hold the step's (the target's hand-over); None
    (the drafting levels): the layer's forward computes them."""
    # CUDA only: the two backends' modules, looked up at call time (tests stand them in)
    from vllm.v1.attention.backends.flash_attn import FlashAttentionMetadata
    from vllm.v1.attention.backends.triton_attn import TritonAttentionMetadata

    def replacement(name, metadata):
        if isinstance(metadata, TritonAttentionMetadata):
            return with_tree(metadata, tree_qq_bias=state.qq_bias(tree, device))
        if isinstance(metadata, FlashAttentionMetadata):
            return with_tree(metadata, tree_block_ancestors=state.block_ancestors(tree, device),
                             tree_prefix_lens=None if prefix_lens is None else prefix_lens(metadata))
        return None

    return replacement


def hand_tree_to_attention_layers(state: TreeRunState, layers: dict, attn_metadata, step: TreeStep | None,
                                  prepared: bool, device) -> None:
    """The step's tree onto the TRITON_ATTN and FLASH_ATTN metadata (a covering step's bias or ancestor table for
    the whole batch's launch, else the tree step for the tree rows' own passes), and each layer's cache into the
    step for the compaction. FLASH_ATTN metadata also gets the prefix pass's committed lengths, computed here once
    per step for all its layers: a covering step's (or a capture's) into `TreeRunState.prefix_lens`'s persistent
    buffer, which a FULL CUDA graph reads; a mixed step's tree rows' as a plain tensor (eager)."""
    # CUDA only: the two backends' modules, looked up at call time (tests stand them in)
    from vllm.v1.attention.backends.flash_attn import FlashAttentionMetadata
    from vllm.v1.attention.backends.triton_attn import TritonAttentionMetadata

    paged = (TritonAttentionMetadata, FlashAttentionMetadata)
    tree = state.tree
    recorded = set()  # caches already recorded: a cache that layers share (KV sharing) is compacted once
    tree_rows_of = {}  # the tree rows of each block table: layers of one KV-cache group share theirs
    if step is not None:
        step.qq_bias = state.qq_bias(tree, device)
    prefix_lens_of = {}  # one computation per vLLM length view: metadata objects of several groups share theirs

    def covering_prefix_lens(metadata):
        key = (metadata.seq_lens.data_ptr(), metadata.seq_lens.numel(), metadata.query_start_loc.data_ptr())
        if key not in prefix_lens_of:
            prefix_lens_of[key] = state.prefix_lens(metadata.seq_lens, metadata.query_start_loc)
        return prefix_lens_of[key]

    whole_batch = uniform_tree_marking(state, tree, device, prefix_lens=covering_prefix_lens)

    def record(name, metadata):
        kv_cache = layers[name].kv_cache
        if kv_cache.data_ptr() not in recorded:
            recorded.add(kv_cache.data_ptr())
            table = metadata.block_table
            if id(table) not in tree_rows_of:
                tree_rows_of[id(table)] = table.index_select(0, step.request_indices)
            step.attention_layers.append(PagedLayerCaches(kv_cache, tree_rows_of[id(table)]))

    def replacement(name, metadata):
        if not isinstance(metadata, paged):
            return None
        if step is not None:
            if step.covers_batch:
                return whole_batch(name, metadata)
            if isinstance(metadata, FlashAttentionMetadata):
                tree_seq_lens = metadata.seq_lens.index_select(0, step.request_indices)
                return with_tree(metadata, tree_step=step, tree_block_ancestors=state.block_ancestors(tree, device),
                                 tree_prefix_lens=attention_flash.prefix_lengths(tree_seq_lens, step.query_start_loc))
            return with_tree(metadata, tree_step=step)
        if not prepared and metadata.max_query_len == 1 + tree.num_nodes:
            # A dummy run (CUDA-graph capture): its uniform decode batch stands for steps of tree rows only (a batch
            # with a prefill is never replayed in a FULL graph: `v1.full_graph_batches`).
            return whole_batch(name, metadata)
        return None

    replace_metadata(attn_metadata, replacement)
    if step is not None:
        for per_layer in attn_metadata if isinstance(attn_metadata, list) else [attn_metadata]:
            for name, metadata in per_layer.items():
                if isinstance(metadata, paged):
                    record(name, metadata)


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
        if kwargs.get("qq_bias") is None and is_forward_context_available():
            bias = get_forward_context().additional_kwargs.get(QQ_BIAS_KEY)
            if bias is not None:
                kwargs["qq_bias"] = bias
        return original(*args, **kwargs)

    return unified_attention


def check_triton_tree_support(impl) -> None:
    """What the tree bias leaves right: positions enter vLLM's kernel only through sliding windows, ALiBi and
    chunked attention (block index there, not depth), and quantized caches take other loads; all refused."""
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
            extra = get_forward_context().additional_kwargs
            extra[QQ_BIAS_KEY] = bias
            try:
                return original(self, layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs)
            finally:
                del extra[QQ_BIAS_KEY]
        output = original(self, layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs)
        key_cache, value_cache = attention_triton.split_kv_cache(kv_cache, self.head_size)
        descale = layer._k_scale.expand(step.num_requests, key_cache.shape[2])
        attention_triton.tree_rows_attention(
            TRITON_UNIFIED_ATTENTION.resolve(), query, key_cache, value_cache, output,
            token_indices=step.token_indices, request_indices=step.request_indices,
            tree_query_start_loc=step.query_start_loc, seq_lens=attn_metadata.seq_lens,
            block_table=attn_metadata.block_table, block_len=step.block_len, max_seq_len=attn_metadata.max_seq_len,
            scale=self.scale, qq_bias=step.qq_bias, k_descale=descale, v_descale=descale,
            softcap=self.logits_soft_cap, sinks=self.sinks)
        return output

    return forward


def check_flash_tree_support(impl) -> None:
    """What the two passes leave right on FLASH_ATTN: FlashAttention 2 or 3 (their varlen call returns the
    log-sum-exp over a paged cache), unquantized KV, full causal decoder attention without soft cap, ALiBi or sinks
    (the ancestor pass computes none of them), no decode context parallelism; all else refused."""
    reasons = []
    if impl.vllm_flash_attn_version not in (2, 3):
        reasons.append(f"FlashAttention version {impl.vllm_flash_attn_version} (2 and 3 have a tree path)")
    if is_quantized_kv_cache(impl.kv_cache_dtype):
        reasons.append(f"kv_cache_dtype {impl.kv_cache_dtype!r} (only unquantized KV)")
    if tuple(impl.sliding_window) != (-1, -1):
        reasons.append("a sliding window")
    if impl.alibi_slopes is not None:
        reasons.append("ALiBi")
    if impl.logits_soft_cap:
        reasons.append("a logits soft cap")
    if impl.sinks is not None:
        reasons.append("attention sinks")
    if impl.attn_type != AttentionType.DECODER:
        reasons.append(f"attention type {impl.attn_type}")
    if impl.dcp_world_size > 1:
        reasons.append("decode context parallelism")
    if impl.kv_sharing_target_layer_name is not None:
        reasons.append("KV sharing (the ancestor pass reads the layer's own new K/V)")
    if reasons:
        raise NotImplementedError("draft_tree_widths with FLASH_ATTN: not supported with " + ", ".join(reasons)
                                  + "; attention_backend='TRITON_ATTN' may support it")


def _flash_prefix_kwargs(impl, layer, attn_metadata, num_requests: int) -> dict:
    """What vLLM's own FlashAttention call passes beside the tensors: version, KV descales, split count."""
    descale = layer._k_scale.expand(num_requests, impl.num_kv_heads)
    return {"fa_version": impl.vllm_flash_attn_version, "k_descale": descale,
            "v_descale": layer._v_scale.expand(num_requests, impl.num_kv_heads),
            "num_splits": attn_metadata.max_num_splits}


def _attending_tree_rows_flash(original):
    @functools.wraps(original)
    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs):
        ancestors, step = tree_block_ancestors_of(attn_metadata), tree_step_of(attn_metadata)
        if ancestors is None:
            return original(self, layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs)
        key_cache, value_cache = attention_triton.split_kv_cache(kv_cache, self.head_size)
        prefix_attention = FLASH_ATTN_VARLEN_FUNC.resolve()
        prefix_lens = tree_prefix_lens_of(attn_metadata)  # the hand-over's, once per step (`hand_tree_to_...`)
        if step is None:  # the whole batch: tree rows and one-token decodes; the two passes instead of vLLM's launch
            if prefix_lens is None:  # a drafting level (`uniform_tree_marking`): its one layer computes them
                prefix_lens = attention_flash.prefix_lengths(attn_metadata.seq_lens, attn_metadata.query_start_loc)
            attention_flash.tree_batch_attention(
                prefix_attention, query, key, value, key_cache, value_cache, output,
                query_start_loc=attn_metadata.query_start_loc, prefix_lens=prefix_lens,
                block_table=attn_metadata.block_table, max_query_len=attn_metadata.max_query_len,
                max_seq_len=attn_metadata.max_seq_len, block_ancestors=ancestors, scale=self.scale,
                prefix_kwargs=_flash_prefix_kwargs(self, layer, attn_metadata, attn_metadata.seq_lens.shape[0]))
            return output
        output = original(self, layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs)
        attention_flash.tree_rows_attention(
            prefix_attention, query, key, value, key_cache, value_cache, output,
            token_indices=step.token_indices, request_indices=step.request_indices,
            tree_query_start_loc=step.query_start_loc, prefix_lens=prefix_lens,
            block_table=attn_metadata.block_table, block_len=step.block_len, max_seq_len=attn_metadata.max_seq_len,
            block_ancestors=ancestors, scale=self.scale,
            prefix_kwargs=_flash_prefix_kwargs(self, layer, attn_metadata, step.num_requests))
        return output

    return forward


def install() -> None:
    """The attention backend's hooks, for either runner: vLLM's CPU attention on CPU, TRITON_ATTN and FLASH_ATTN on
    CUDA."""
    if current_platform.is_cpu():
        CPU_ATTENTION_FORWARD.wrap(_attending_tree_rows)
    else:
        TRITON_ATTENTION_FORWARD.wrap(_attending_tree_rows_triton)
        TRITON_UNIFIED_ATTENTION.wrap(_passing_qq_bias)
        FLASH_ATTENTION_FORWARD.wrap(_attending_tree_rows_flash)
