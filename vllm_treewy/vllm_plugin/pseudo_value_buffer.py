"""The pseudo-value buffer: per GDN layer and state slot, what the commit needs of the slot's last verified drafts.

Under reconstruct the verify pass writes, for each draft node of a request, its key, pseudo-value and log decay
(fp32, as the recurrence used them) and its pre-conv input (in the conv state's dtype) into the request's state
slot; the commit reads the accepted path back from there. The buffer is two more states on the GDN layer's
MambaSpec page, after vLLM's conv and SSM states: vLLM allocates it with the KV cache, counts it in its KV-cache
report and max concurrency, and frees or reuses it with the slot. Nothing that verify computes outlives the GDN op
in a Python object, so nothing aliases memory that a CUDA graph replay reuses (vLLM's piecewise graphs hand the
GDN op its inputs in the graph pool, which later pieces of the same forward overwrite).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from vllm_treewy.vllm_plugin.config import reconstructs_mamba_state
from vllm_treewy.vllm_plugin.patch_points import MODEL_STATE_DTYPES, MODEL_STATE_SHAPES

FACTORS_DTYPE = torch.float32


@dataclass(frozen=True)
class BufferLayout:
    """Per state slot: `num_nodes` rows of factors `[keys | pseudo-values | log decays]` and of conv inputs.

    Head counts and conv_dim are this tensor-parallel rank's.
    """

    num_k_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    conv_dim: int
    num_nodes: int

    @classmethod
    def of_model(cls, tp_size, num_k_heads, num_v_heads, head_k_dim, head_v_dim, num_spec) -> BufferLayout:
        conv_dim = 2 * num_k_heads * head_k_dim + num_v_heads * head_v_dim
        return cls(num_k_heads // tp_size, num_v_heads // tp_size, head_k_dim, head_v_dim, conv_dim // tp_size,
                   1 + num_spec)

    @property
    def key_width(self) -> int:
        return self.num_k_heads * self.head_k_dim

    @property
    def value_width(self) -> int:
        return self.num_v_heads * self.head_v_dim

    @property
    def factor_width(self) -> int:
        return self.key_width + self.value_width + self.num_v_heads

    def shapes(self) -> tuple[tuple[int, int], tuple[int, int]]:
        return (self.num_nodes, self.factor_width), (self.num_nodes, self.conv_dim)

    @staticmethod
    def dtypes(conv_dtype: torch.dtype) -> tuple[torch.dtype, torch.dtype]:
        return FACTORS_DTYPE, conv_dtype


@dataclass(frozen=True)
class PseudoValueBuffer:
    """Views of one layer's buffer: factors `[S, T, factor_width]`, conv inputs `[S, T, conv_dim]`."""

    factors: torch.Tensor
    conv_inputs: torch.Tensor
    layout: BufferLayout

    def write(self, slots: torch.Tensor, nodes: torch.Tensor, keys: torch.Tensor, pseudo_values: torch.Tensor,
              log_decays: torch.Tensor, conv_inputs: torch.Tensor) -> None:
        """Stores packed draft nodes `[N, ...]` at (slot, local node index) `slots[i], nodes[i]`."""
        n = keys.shape[0]
        row = torch.cat([keys.reshape(n, -1).float(), pseudo_values.reshape(n, -1).float(),
                         log_decays.reshape(n, -1).float()], dim=1)
        self.factors.index_put_((slots, nodes), row)
        self.conv_inputs.index_put_((slots, nodes), conv_inputs.to(self.conv_inputs.dtype))

    def read(self, slots: torch.Tensor, nodes: torch.Tensor):
        """(keys `[N, H, K]`, pseudo-values `[N, HV, V]`, log decays `[N, HV]`, conv inputs `[N, conv_dim]`)."""
        layout, n = self.layout, slots.shape[0]
        # One gather per factor from a column view: each comes out contiguous, as the Triton kernels want it.
        keys, values, decays = (
            part[slots, nodes]
            for part in self.factors.split([layout.key_width, layout.value_width, layout.num_v_heads], dim=-1)
        )
        return (keys.view(n, layout.num_k_heads, layout.head_k_dim),
                values.view(n, layout.num_v_heads, layout.head_v_dim), decays, self.conv_inputs[slots, nodes])


def _model_buffer_layout(vllm_config) -> BufferLayout:
    hf_config = vllm_config.model_config.hf_text_config
    return BufferLayout.of_model(
        vllm_config.parallel_config.tensor_parallel_size, hf_config.linear_num_key_heads,
        hf_config.linear_num_value_heads, hf_config.linear_key_head_dim, hf_config.linear_value_head_dim,
        vllm_config.speculative_config.num_speculative_tokens,
    )


def _appending_buffer_states(original, buffer_states):
    """Wraps a model's `get_mamba_state_{shape,dtype}_from_config` classmethod so that, under reconstruct, the
    buffer's two states follow vLLM's conv and SSM states: vLLM sizes a hybrid's pages from them."""

    @functools.wraps(original)
    def with_buffer(cls, vllm_config):
        states = original(cls, vllm_config)
        if not reconstructs_mamba_state(vllm_config.speculative_config):
            return states
        return (*states, *buffer_states(vllm_config, states))

    with_buffer.adds_pseudo_value_buffer = True
    return classmethod(with_buffer)


def install() -> None:
    """The GDN models' state shapes and dtypes (`MODEL_STATE_SHAPES`, `MODEL_STATE_DTYPES`) include the buffer."""
    for shape_point, dtype_point in zip(MODEL_STATE_SHAPES, MODEL_STATE_DTYPES, strict=True):
        if not getattr(shape_point.resolve(), "adds_pseudo_value_buffer", False):
            shape_point.replace(_appending_buffer_states(
                shape_point.resolve().__func__, lambda vllm_config, _: _model_buffer_layout(vllm_config).shapes()))
            dtype_point.replace(_appending_buffer_states(
                dtype_point.resolve().__func__, lambda _, dtypes: BufferLayout.dtypes(dtypes[0])))
