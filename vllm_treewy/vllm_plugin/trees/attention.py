"""Draft trees in vLLM's attention backends, for both runners (V1's `v1.runner`, Model Runner V2's `v2.runner`): the
tree rows' attention in the CPU and TRITON_ATTN layers' `forward`, the check of each layer's backend and settings,
and the hand-over of a step's tree (bias or step) to the TRITON_ATTN layers' metadata.

- CPU: vLLM's kernel attends the whole batch causally, then `trees.attention_cpu.tree_attention` overwrites the
  tree rows' output; the layer's caches are recorded for the compaction.
- TRITON_ATTN (`trees.attention_triton`): with the tree bias on the metadata (a step whose tree rows cover the batch,
  or a CUDA-graph capture's uniform decode batch), vLLM's own launch is tree attention: the bias reaches
  `unified_attention` through vLLM's forward context for the launch's duration (FULL CUDA graphs capture it); a
  mixed batch (attention runs eagerly) runs vLLM's causal launch, then the tree rows alone with the bias overwrite
  their output.
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
    TRITON_ATTENTION_FORWARD,
    TRITON_UNIFIED_ATTENTION,
)
from vllm_treewy.vllm_plugin.trees import attention_triton
from vllm_treewy.vllm_plugin.trees.attention_cpu import split_kv_cache, tree_attention
from vllm_treewy.vllm_plugin.trees.metadata import replace_metadata, tree_qq_bias_of, tree_step_of, with_tree
from vllm_treewy.vllm_plugin.trees.run_state import TreeRunState
from vllm_treewy.vllm_plugin.trees.step import AttentionLayerCaches, PagedLayerCaches, TreeStep


def check_tree_backends(compilation_config, per_layer: dict) -> None:
    """Draft trees read the CPU or TRITON_ATTN KV layout; any other attention backend is refused with its name, and
    so are TRITON_ATTN layers with settings the tree bias leaves wrong (`check_triton_tree_support`)."""
    if current_platform.is_cpu():  # each backend module imports on its own platform only
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionMetadata as Supported
    else:
        from vllm.v1.attention.backends.triton_attn import TritonAttentionMetadata as Supported
    for name, metadata in per_layer.items():
        if not isinstance(metadata, (Supported, GDNAttentionMetadata)):
            raise ValueError(f"draft_tree_widths: layer {name} runs {type(metadata).__name__}; draft trees need "
                             "attention_backend='TRITON_ATTN' on CUDA (vLLM's CPU attention on CPU)")
        if not current_platform.is_cpu() and isinstance(metadata, Supported):
            check_triton_tree_support(compilation_config.static_forward_context[name].impl)
    mode = compilation_config.cudagraph_mode
    if mode is not None and mode.mixed_mode() == CUDAGraphMode.FULL:
        raise ValueError(f"draft_tree_widths: cudagraph_mode {mode.name} puts batches with prefills in FULL CUDA "
                         "graphs, where the tree rows' attention pass cannot run; use FULL_AND_PIECEWISE (vLLM's "
                         "default), FULL_DECODE_ONLY, PIECEWISE or NONE")


def hand_to_triton_layers(state: TreeRunState, layers: dict, attn_metadata, step: TreeStep | None,
                          prepared: bool, device) -> None:
    """The tree bias or the tree step onto the TRITON_ATTN metadata, and each layer's cache into the step."""
    from vllm.v1.attention.backends.triton_attn import TritonAttentionMetadata  # CUDA only: TRITON_ATTN's module

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
            # with a prefill is never replayed in a FULL graph: `v1.full_graph_batches`).
            return with_tree(metadata, tree_qq_bias=state.qq_bias(tree, device))
        return None

    replace_metadata(attn_metadata, replacement)
    if step is not None:
        for per_layer in attn_metadata if isinstance(attn_metadata, list) else [attn_metadata]:
            for name, metadata in per_layer.items():
                if isinstance(metadata, TritonAttentionMetadata):
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


def install() -> None:
    """The attention backend's hooks, for either runner: vLLM's CPU attention on CPU, TRITON_ATTN on CUDA."""
    if current_platform.is_cpu():
        CPU_ATTENTION_FORWARD.wrap(_attending_tree_rows)
    else:
        TRITON_ATTENTION_FORWARD.wrap(_attending_tree_rows_triton)
        TRITON_UNIFIED_ATTENTION.wrap(_passing_qq_bias)
