"""The GDN layer under reconstruct-on-commit: one state block per request, drafts verified from it.

`ReconstructGatedDeltaNetAttention` replaces vLLM's `QwenGatedDeltaNetAttention` (out-of-tree layer
registration); with `mamba_state_commit="store_all"` it behaves exactly like its parent. On CUDA it runs vLLM's
fused-norm GDN path (`_forward_core_fused_norm`, where vLLM would call its compiled MTP kernel; bf16 and fp16
models) and takes the speculative tokens out of it; the prefills of the same batch stay with vLLM. FULL CUDA graphs
capture decode batches: every step's inputs are tensors of the GDN metadata (`gdn.step_metadata`). On CPU the same
happens through `gdn.cpu`, which also runs the store_all draft tree baseline (`gdn.store_all_tree`): vLLM's chain
kernels cannot follow a tree's parents. Qwen3-Next's layer (the same class, its projections interleaved by key head) is
unpacked into Qwen3.5's flat q/k/v, z, b, a before either path: by vLLM on CPU, here on CUDA. """

from __future__ import annotations

import dataclasses
from math import prod

import torch
from vllm.config import get_current_vllm_config
from vllm.forward_context import get_forward_context
from vllm.model_executor.custom_op import op_registry_oot
from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import QwenGatedDeltaNetAttention
from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first
from vllm.platforms import current_platform
from vllm.utils.torch_utils import get_dtype_size

from vllm_treewy.vllm_plugin.gdn import prefix_caching
from vllm_treewy.vllm_plugin.gdn import reconstruct
from vllm_treewy.vllm_plugin.gdn import store_all_tree
from vllm_treewy.vllm_plugin.config import draft_shape_of, keeps_slot_counts, reconstructs_mamba_state
from vllm_treewy.vllm_plugin.patch_points import (
    CPU_SSM_STATE_VIEW,
    CPU_UNPACKED_CONV_WEIGHT,
    ENCODE_LAYER_NAME,
    GDN_FUSED_NORM_OP,
)
from vllm_treewy.vllm_plugin.gdn.pseudo_value_buffer import (
    BufferLayout,
    GDNPage,
    PseudoValueBuffer,
    extra_page_dtypes,
    extra_page_shapes,
)
from vllm_treewy.vllm_plugin.gdn.sampling_tables import SamplingTables
from vllm_treewy.vllm_plugin.gdn.step_metadata import (
    GroupStepBuffers,
    ReconstructGDNAttentionMetadata,
    uses_runner_accepted_counts,
)

GATE_ACTIVATIONS = ("silu", "sigmoid")
encode_layer_name = ENCODE_LAYER_NAME.resolve()  # at import: torch.compile traces forward_cuda, not importlib


class ReconstructGatedDeltaNetAttention(QwenGatedDeltaNetAttention):
    """Qwen3.5 / Qwen3-Next GDN layer that can verify drafts without writing a state per draft position."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.reconstructs_state = reconstructs_mamba_state(self.speculative_config)
        self.keeps_slot_counts = keeps_slot_counts(self.speculative_config)
        # The draft shape, read from the config here once and handed down in the step buffers: the step metadata,
        # the commit tables and both runners' count hooks read it from the counts layer.
        shape = draft_shape_of(self.speculative_config)
        # What the step bookkeeping keeps across vLLM's calls, used where this layer is its group's first
        # (`gdn.step_metadata.counts_layer`) or the model's first GDN layer (`gdn.sampling_tables.of_runner`).
        vllm_config = get_current_vllm_config()
        self.step_buffers = (GroupStepBuffers(shape, uses_runner_accepted_counts(vllm_config, shape))
                             if self.keeps_slot_counts else None)
        self.sampling_tables = SamplingTables() if self.keeps_slot_counts else None
        _check_prefix_caching(vllm_config, shape.tree is not None, self.reconstructs_state, self.keeps_slot_counts)
        if self.reconstructs_state and current_platform.is_cuda_alike():
            self._check_cuda_support()
            # forward_cuda then takes vLLM's fused-norm path, whose speculative half `_forward_core_fused_norm` runs
            # here; vLLM's compiled kernel (a state per draft position) is never called.
            self.enable_fused_gdn_spec_decode = True

    def _check_cuda_support(self) -> None:
        reasons = []
        # (vLLM's own GDN prefill refuses float32 activations)
        if self.model_config.dtype not in (torch.bfloat16, torch.float16):
            reasons.append(f"a bfloat16 or float16 model (got {self.model_config.dtype})")
        if self.norm.activation not in GATE_ACTIVATIONS:
            reasons.append(f"a silu or sigmoid output gate (got {self.norm.activation})")
        for name, dim in (("head_k_dim", self.head_k_dim), ("head_v_dim", self.head_v_dim)):
            if dim & (dim - 1):
                reasons.append(f"a power-of-two {name} (got {dim})")
        if reasons:
            raise ValueError("mamba_state_commit='reconstruct' on CUDA runs the fused GDN step, which needs "
                             + ", ".join(reasons) + "; use mamba_state_commit='store_all' for this model")

    def forward_cuda(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if not self.reconstructs_state or hidden_states.dtype == torch.bfloat16:
            return super().forward_cuda(hidden_states)
        # vLLM takes its fused-norm path (where reconstruct verifies drafts) for bf16 activations only; its unfused
        # path would verify from a state per draft position. An fp16 model takes the fused-norm path too.
        mixed_qkvz, _ = self.in_proj_qkvz(hidden_states)
        ba, _ = self.in_proj_ba(hidden_states)
        core_attn_out = torch.zeros((hidden_states.size(0), self.num_v_heads // self.tp_size, self.head_v_dim),
                                    dtype=hidden_states.dtype, device=hidden_states.device)
        # the registered op (a split point of vLLM's piecewise graphs), not the Python function behind it
        getattr(torch.ops.vllm, GDN_FUSED_NORM_OP.attribute)(mixed_qkvz, ba, core_attn_out,
                                                              layer_name=encode_layer_name(self.prefix))
        output, _ = self.out_proj(core_attn_out.flatten(-2))
        return output

    def _forward_core_fused_norm_packed(self, mixed_qkvz, ba, core_attn_out):
        if not self.gqa_interleaved_layout:
            return super()._forward_core_fused_norm_packed(mixed_qkvz, ba, core_attn_out)
        # vLLM's packed op splits Qwen3.5's flat [q, k, v, z] and [b, a]; Qwen3-Next's rows are grouped by key head:
        # unpacked as vLLM's unfused path does (views and copies of static shapes), then the same fused-norm path.
        query, key, value, z, b, a = self.fix_query_key_value_ordering(mixed_qkvz, ba)
        mixed_qkv = torch.cat([t.flatten(1) for t in (query, key, value)], dim=-1)
        self._forward_core_fused_norm(mixed_qkv, b, a, z, core_attn_out)

    def buffer_layout(self) -> BufferLayout:
        return BufferLayout.of_model(self.tp_size, self.num_k_heads, self.num_v_heads, self.head_k_dim,
                                     self.head_v_dim, self.num_spec)

    def _extra_page_states(self) -> tuple[tuple, tuple]:
        """(shapes, dtypes) of the page's states after vLLM's conv and SSM states (`gdn.pseudo_value_buffer`)."""
        return (extra_page_shapes(self.speculative_config, self.buffer_layout),
                extra_page_dtypes(self.speculative_config, self.get_state_dtype()[0]))

    def get_kv_cache_spec(self, vllm_config):
        spec = super().get_kv_cache_spec(vllm_config)
        if not self.keeps_slot_counts:
            return spec
        shapes, dtypes = self._extra_page_states()
        spec = dataclasses.replace(spec, shapes=(*spec.shapes, *shapes), dtypes=(*spec.dtypes, *dtypes))
        if not self.reconstructs_state:
            return spec  # a store_all tree: vLLM's block per verified node stays
        # One state block per request: drafts are verified from the committed state, which the next step's commit
        # updates in place, so no block per draft position is needed; the page also holds the pseudo-value buffer.
        return dataclasses.replace(spec, num_speculative_blocks=0)

    def bind_kv_cache(self, kv_cache: torch.Tensor) -> None:
        """vLLM's conv and SSM states, then views of the page's extra states: under reconstruct the pseudo-value
        buffer's three, with a store_all tree the count."""
        super().bind_kv_cache(kv_cache)
        if not self.keeps_slot_counts:
            return
        pages = kv_cache.squeeze(dim=(1, 2))
        offset = sum(prod(shape) * get_dtype_size(dtype)
                     for shape, dtype in zip(self.get_state_shape(), self.get_state_dtype()))
        views = []
        for shape, dtype in zip(*self._extra_page_states()):
            nbytes = prod(shape) * get_dtype_size(dtype)
            views.append(pages[:, offset : offset + nbytes].view(dtype).view(-1, *shape))
            offset += nbytes
        # In the tuple vLLM clears on teardown, so they go with the rest of the KV cache.
        self.kv_cache = (*self.kv_cache, *views)

    # -- cache views ------------------------------------------------------------------------------------------
    def conv_history(self) -> torch.Tensor:
        """`[S, conv_dim, width-1]`: the committed conv inputs (the first width-1 columns of vLLM's conv state)."""
        conv_state = GDNPage.of(self.kv_cache).conv_state
        conv_state = conv_state if is_conv_state_dim_first() else conv_state.transpose(-1, -2)
        return conv_state[:, :, : self.conv_kernel_size - 1]

    def ssm_state(self) -> torch.Tensor:
        """`[S, HV, V, K]` (vLLM's CPU kernels store `[HV, K, V]` in the same buffer: a transposed view there)."""
        if current_platform.is_cpu():
            return CPU_SSM_STATE_VIEW.resolve()(self).transpose(-1, -2)
        return GDNPage.of(self.kv_cache).ssm_state

    def pseudo_value_buffer(self) -> PseudoValueBuffer:
        page = GDNPage.of(self.kv_cache)
        return PseudoValueBuffer(page.factors, page.conv_inputs, self.buffer_layout())

    def verified_node_counts(self) -> torch.Tensor | None:
        """`[S]` the count state (the page's last state) alone: what the metadata builder and the runner update every
        step; None without one, or before vLLM binds the KV cache (its profile run)."""
        counts = GDNPage.counts_of(self.kv_cache) if self.keeps_slot_counts else None
        return None if counts is None or counts.numel() == 0 else counts.view(-1)

    def conv_weight(self) -> torch.Tensor:
        """`(conv_dim, width)`; on CPU with AMX vLLM packs `conv1d.weight` in place and keeps a plain copy."""
        if current_platform.is_cpu():
            return CPU_UNPACKED_CONV_WEIGHT.resolve()(self)
        weight = self.conv1d.weight
        return weight.view(weight.size(0), weight.size(-1))

    def _caches(self, metadata: ReconstructGDNAttentionMetadata) -> dict:
        """The layer's caches for a speculative step, after the step's count update where this layer runs it."""
        metadata.update_counts(self)
        caches = dict(conv_weight=self.conv_weight(), conv_history=self.conv_history(), ssm_state=self.ssm_state())
        return dict(caches, buffer=self.pseudo_value_buffer()) if self.reconstructs_state else caches

    # -- the speculative step ---------------------------------------------------------------------------------
    def speculative_step(self, metadata: ReconstructGDNAttentionMetadata, x, a, b) -> torch.Tensor:
        """CPU: core outputs `[N, HV, V]` (before the gated RMSNorm) of the packed draft chains or trees `x`:
        reconstruct's, or the store_all tree's (a state per node)."""
        step = reconstruct.step_torch if self.reconstructs_state else store_all_tree.step_torch
        return step(self, metadata, x, a, b, **self._caches(metadata))

    def _metadata(self) -> ReconstructGDNAttentionMetadata | None:
        if not self.reconstructs_state:
            return None
        attn_metadata = get_forward_context().attn_metadata
        metadata = attn_metadata.get(self.prefix) if isinstance(attn_metadata, dict) else None
        if metadata is None or metadata.num_spec_decodes == 0:
            return None
        return metadata

    def _forward_core_fused_norm(self, mixed_qkv, b, a, output_gate, core_attn_out):
        metadata = self._metadata()
        if metadata is None:
            return super()._forward_core_fused_norm(mixed_qkv, b, a, output_gate, core_attn_out)
        caches = self._caches(metadata)
        if metadata.num_prefills == 0 and metadata.num_decodes == 0:
            n = metadata.num_actual_tokens
            reconstruct.step_triton(self, metadata, mixed_qkv[:n], a[:n], b[:n], output_gate[:n],
                                    core_attn_out[:n], **caches)
            return
        spec, rest = metadata.spec_token_indx, metadata.non_spec_token_indx
        spec_out = core_attn_out.new_zeros((spec.shape[0], *core_attn_out.shape[1:]))
        reconstruct.step_triton(self, metadata, mixed_qkv.index_select(0, spec), a.index_select(0, spec),
                                b.index_select(0, spec), output_gate.index_select(0, spec), spec_out, **caches)
        core_attn_out.index_copy_(0, spec, spec_out)
        # The prefills of the batch: vLLM's own path, shown a batch without speculation, then its gated RMSNorm.
        rest_out = core_attn_out.new_zeros((rest.shape[0], *core_attn_out.shape[1:]))
        attn_metadata = get_forward_context().attn_metadata
        attn_metadata[self.prefix] = metadata.rest_metadata
        try:
            super()._forward_core(mixed_qkv.index_select(0, rest), b.index_select(0, rest).contiguous(),
                                  a.index_select(0, rest).contiguous(), rest_out)
        finally:
            attn_metadata[self.prefix] = metadata
        self._rms_norm_gated_cuda(rest_out, output_gate.index_select(0, rest).contiguous(), rest_out)
        core_attn_out.index_copy_(0, rest, rest_out)

    def _forward_core(self, mixed_qkv, b, a, core_attn_out):
        if self._metadata() is not None:
            # vLLM's own speculative kernels would read a state per draft position, which reconstruct does not keep.
            raise RuntimeError("mamba_state_commit='reconstruct' on CUDA verifies drafts on the fused-norm GDN path "
                               "only; this batch took the unfused path")
        return super()._forward_core(mixed_qkv, b, a, core_attn_out)


def _check_prefix_caching(vllm_config, drafts_trees: bool, reconstructs_state: bool, keeps_slot_counts: bool) -> None:
    """Prefix caching of GDN states (align mode) runs reconstruct chains on either runner (`gdn.prefix_caching`), but
    on Model Runner V2 not with pipeline parallelism, and reconstruct draft trees alike (the boundary states along
    the accepted path: `gdn.prefix_caching.record_after_sampling`, `record_after_sampling_v2`); store_all trees are
    refused with it. `drafts_trees`: the config's draft shape is a tree."""
    mode = vllm_config.cache_config.mamba_cache_mode
    if not keeps_slot_counts or mode == "none":
        return
    if mode != prefix_caching.ALIGN:
        raise ValueError(f"vllm-treewy knows mamba_cache_mode 'none' and 'align', got {mode!r}")
    if drafts_trees:
        if not reconstructs_state:
            raise ValueError("draft_tree_widths with mamba_state_commit='store_all' and prefix caching "
                             "(mamba_cache_mode='align') is not supported: disable prefix caching "
                             "(--no-enable-prefix-caching) or use mamba_state_commit='reconstruct'")
    if reconstructs_state and vllm_config.use_v2_model_runner:
        feature = prefix_caching.v2_unsupported_with_prefix_caching(vllm_config)
        if feature is not None:
            raise ValueError(f"{feature} runs on the V1 model runner: unset VLLM_USE_V2_MODEL_RUNNER=1 or disable "
                             "prefix caching (--no-enable-prefix-caching)")


def install() -> None:
    if op_registry_oot.get(QwenGatedDeltaNetAttention.__name__) is not ReconstructGatedDeltaNetAttention:
        QwenGatedDeltaNetAttention.register_oot(ReconstructGatedDeltaNetAttention)
