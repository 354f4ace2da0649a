"""The GDN layer under reconstruct-on-commit: one state block per request, drafts verified from it.

`ReconstructGatedDeltaNetAttention` replaces vLLM's `QwenGatedDeltaNetAttention` (out-of-tree layer
registration); with `mamba_state_commit="store_all"` it behaves exactly like its parent. On CUDA it takes the
speculative tokens out of `_forward_core` (which vLLM's GDN custom op calls) and leaves the prefill and plain
decode tokens of the same batch to vLLM; on CPU the same happens through `gdn_cpu`.
"""

from __future__ import annotations

import dataclasses
import functools
from math import prod

import torch
from vllm.forward_context import get_forward_context
from vllm.v1.attention.backend import AttentionCGSupport
from vllm.model_executor.custom_op import op_registry_oot
from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import QwenGatedDeltaNetAttention
from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first
from vllm.platforms import current_platform
from vllm.utils.torch_utils import get_dtype_size

from vllm_treewy.vllm_plugin import reconstruct
from vllm_treewy.vllm_plugin.config import reconstructs_mamba_state
from vllm_treewy.vllm_plugin.patch_points import (
    CPU_SSM_STATE_VIEW,
    CPU_UNPACKED_CONV_WEIGHT,
    GDN_CUDAGRAPH_SUPPORT,
)
from vllm_treewy.vllm_plugin.pseudo_value_buffer import BufferLayout, PseudoValueBuffer
from vllm_treewy.vllm_plugin.spec_step import SpecStep, spec_step


class ReconstructGatedDeltaNetAttention(QwenGatedDeltaNetAttention):
    """Qwen3.5 / Qwen3-Next GDN layer that can verify drafts without writing a state per draft position."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.reconstructs_state = reconstructs_mamba_state(self.speculative_config)
        # The step whose drafts this layer verified and has not committed yet (indices only: the factors are in
        # the pseudo-value buffer).
        self.pending_step: SpecStep | None = None
        if self.reconstructs_state:
            # vLLM's fused spec-decode kernel writes a state per draft position: not under reconstruct.
            self.enable_fused_gdn_spec_decode = False
            self.chain_kernels = (
                reconstruct.TORCH_KERNELS if current_platform.is_cpu() else reconstruct.triton_kernels()
            )

    def buffer_layout(self) -> BufferLayout:
        return BufferLayout.of_model(self.tp_size, self.num_k_heads, self.num_v_heads, self.head_k_dim,
                                     self.head_v_dim, self.num_spec)

    def get_kv_cache_spec(self, vllm_config):
        spec = super().get_kv_cache_spec(vllm_config)
        if not self.reconstructs_state:
            return spec
        # One state block per request: drafts are verified from the committed state, which the commit updates
        # in place, so no block per draft position is needed; the page also holds the pseudo-value buffer.
        layout = self.buffer_layout()
        return dataclasses.replace(
            spec, num_speculative_blocks=0, shapes=(*spec.shapes, *layout.shapes()),
            dtypes=(*spec.dtypes, *layout.dtypes(spec.dtypes[0])),
        )

    def bind_kv_cache(self, kv_cache: torch.Tensor) -> None:
        """vLLM's conv and SSM states, then (under reconstruct) the pseudo-value buffer's two views of the page."""
        super().bind_kv_cache(kv_cache)
        if not self.reconstructs_state:
            return
        pages = kv_cache.squeeze(dim=(1, 2))
        offset = sum(prod(shape) * get_dtype_size(dtype)
                     for shape, dtype in zip(self.get_state_shape(), self.get_state_dtype()))
        layout, views = self.buffer_layout(), []
        for shape, dtype in zip(layout.shapes(), layout.dtypes(self.get_state_dtype()[0])):
            nbytes = prod(shape) * get_dtype_size(dtype)
            views.append(pages[:, offset : offset + nbytes].view(dtype).view(-1, *shape))
            offset += nbytes
        # In the tuple vLLM clears on teardown, so the buffer goes with the rest of the KV cache.
        self.kv_cache = (*self.kv_cache, *views)

    # -- cache views ------------------------------------------------------------------------------------------
    def conv_history(self) -> torch.Tensor:
        """`[S, conv_dim, width-1]`: the committed conv inputs (the first width-1 columns of vLLM's conv state)."""
        conv_state = self.kv_cache[0] if is_conv_state_dim_first() else self.kv_cache[0].transpose(-1, -2)
        return conv_state[:, :, : self.conv_kernel_size - 1]

    def ssm_state(self) -> torch.Tensor:
        """`[S, HV, V, K]` (vLLM's CPU kernels store `[HV, K, V]` in the same buffer: a transposed view there)."""
        if current_platform.is_cpu():
            return CPU_SSM_STATE_VIEW.resolve()(self).transpose(-1, -2)
        return self.kv_cache[1]

    def pseudo_value_buffer(self) -> PseudoValueBuffer:
        return PseudoValueBuffer(self.kv_cache[2], self.kv_cache[3], self.buffer_layout())

    def conv_weight(self) -> torch.Tensor:
        """`(conv_dim, width)`; on CPU with AMX vLLM packs `conv1d.weight` in place and keeps a plain copy."""
        if current_platform.is_cpu():
            return CPU_UNPACKED_CONV_WEIGHT.resolve()(self)
        weight = self.conv1d.weight
        return weight.view(weight.size(0), weight.size(-1))

    # -- verify and commit ------------------------------------------------------------------------------------
    def verify_spec_chains(self, metadata, x, a, b) -> torch.Tensor:
        step = spec_step(metadata, x.device)
        out = reconstruct.verify_chains(
            self, self.chain_kernels, x, a, b,
            conv_weight=self.conv_weight(), conv_history=self.conv_history(), ssm_state=self.ssm_state(),
            slots=step.slots, parents=step.parents, cu_nodes=step.cu_nodes, max_nodes=1 + self.num_spec,
            buffer=self.pseudo_value_buffer(), node_slots=step.node_slots, node_indices=step.node_indices,
        )
        self.pending_step = step
        return out

    def commit_pending(self, accepted: torch.Tensor) -> None:
        """Rebuilds the accepted states of the step this layer verified; `accepted` as `reconstruct.accepted_nodes`
        gives it for the step's `batch_rows`."""
        step, self.pending_step = self.pending_step, None
        reconstruct.commit_layer(
            self.chain_kernels, accepted, buffer=self.pseudo_value_buffer(), conv_history=self.conv_history(),
            ssm_state=self.ssm_state(), slots=step.slots, parents=step.parents, cu_nodes=step.cu_nodes,
            node_slots=step.node_slots, node_indices=step.node_indices, max_nodes=1 + self.num_spec,
        )

    def _forward_core(self, mixed_qkv, b, a, core_attn_out):
        metadata = None
        if self.reconstructs_state:
            self.pending_step = None  # an earlier pass that was never sampled (warm-up runs)
            attn_metadata = get_forward_context().attn_metadata
            metadata = attn_metadata.get(self.prefix) if isinstance(attn_metadata, dict) else None
        if metadata is None or metadata.spec_sequence_masks is None:
            return super()._forward_core(mixed_qkv, b, a, core_attn_out)
        if metadata.num_prefills == 0 and metadata.num_decodes == 0:
            n = metadata.num_actual_tokens
            core_attn_out[:n] = self.verify_spec_chains(metadata, mixed_qkv[:n], a[:n], b[:n])
            return
        spec, rest = metadata.spec_token_indx, metadata.non_spec_token_indx
        core_attn_out.index_copy_(
            0, spec, self.verify_spec_chains(metadata, mixed_qkv.index_select(0, spec), a.index_select(0, spec),
                                             b.index_select(0, spec)))
        # The prefills and plain decodes of the batch: vLLM's own path, shown a batch without speculation.
        rest_out = core_attn_out.new_zeros((rest.shape[0], *core_attn_out.shape[1:]))
        rest_metadata = spec_step(metadata, mixed_qkv.device).rest_metadata
        attn_metadata = get_forward_context().attn_metadata
        attn_metadata[self.prefix] = rest_metadata
        try:
            super()._forward_core(mixed_qkv.index_select(0, rest), b.index_select(0, rest),
                                  a.index_select(0, rest), rest_out)
        finally:
            attn_metadata[self.prefix] = metadata
        core_attn_out.index_copy_(0, rest, rest_out)


def _no_full_graphs_under_reconstruct(original):
    """The commit finds the step it commits through a Python object (`pending_step`), which a replayed FULL CUDA
    graph would not refresh: under reconstruct the GDN builder declines FULL graphs and vLLM falls back to PIECEWISE
    graphs (the GDN core op already runs between the pieces, eagerly)."""

    @classmethod
    @functools.wraps(original)
    def get_cudagraph_support(cls, vllm_config, kv_cache_spec):
        if reconstructs_mamba_state(vllm_config.speculative_config):
            return AttentionCGSupport.NEVER
        return original(vllm_config, kv_cache_spec)

    get_cudagraph_support.__func__.declines_full_graphs = True
    return get_cudagraph_support


def install() -> None:
    if not getattr(GDN_CUDAGRAPH_SUPPORT.resolve().__func__, "declines_full_graphs", False):
        GDN_CUDAGRAPH_SUPPORT.replace(_no_full_graphs_under_reconstruct(GDN_CUDAGRAPH_SUPPORT.resolve()))
    if op_registry_oot.get(QwenGatedDeltaNetAttention.__name__) is not ReconstructGatedDeltaNetAttention:
        QwenGatedDeltaNetAttention.register_oot(ReconstructGatedDeltaNetAttention)
