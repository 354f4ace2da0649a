"""The pseudo-value buffer: per GDN layer and state slot, what the commit needs of the slot's last verified drafts.

Under reconstruct a step verifies each request's draft nodes from its one committed state and writes, per node, the
factors of the rank-one updates (raw key per value head, its inverse norm, pseudo-value, log decay; fp32, as the
recurrence used them) and the node's pre-conv input (conv state dtype) into the request's state slot. The next step
commits the accepted node from there before it verifies (`vllm_treewy.kernels.gdn_step_triton.gdn_step_triton`,
`conv_step_triton`; the factors' layout: `vllm_treewy.kernels.factor_rows`). A third, one-integer state is the slot's
count: between a step's metadata build and its sampling, the verified, uncommitted nodes (0: nothing pending); after
sampling, 1 + the accepted node's index, which the next step's commit reads (`gdn.step_metadata`, `v1.accepted_counts`;
chains on Model Runner V2 keep the node count, and the commit reads V2's own accepted count where it says a verify is
pending).

The buffer is three more states on the GDN layer's MambaSpec page, after vLLM's conv and SSM states: vLLM allocates
it with the KV cache, counts it in its KV-cache report and max concurrency, and frees or reuses it with the slot.
Nothing a step computes outlives the GDN op in a Python object, so a replayed CUDA graph keeps it all. A store_all
draft tree (the baseline) has no buffer but keeps the count state alone: the block of the node each slot accepted.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch

from vllm_treewy.kernels.factor_rows import slot_factor_width, split_slot_factors
from vllm_treewy.vllm_plugin.config import keeps_slot_counts, reconstructs_mamba_state
from vllm_treewy.vllm_plugin.patch_points import MODEL_STATE_DTYPES, MODEL_STATE_SHAPES

FACTORS_DTYPE = torch.float32
COUNT_DTYPE = torch.int32
COUNT_SHAPE = (1,)


class GDNPage(NamedTuple):
    """A GDN layer's KV-cache page by name: vLLM's conv and SSM states, then the extra page states
    (`extra_page_shapes`): reconstruct's factors, conv inputs and count, or a store_all draft tree's count alone;
    the absent ones None (all of them before vLLM binds the KV cache)."""

    conv_state: torch.Tensor | None
    ssm_state: torch.Tensor | None
    factors: torch.Tensor | None = None
    conv_inputs: torch.Tensor | None = None
    counts: torch.Tensor | None = None

    @classmethod
    def of(cls, kv_cache) -> GDNPage:
        """The layer's `kv_cache` tuple as vLLM binds it (the layer's `bind_kv_cache` appends the extra states)."""
        states = tuple(kv_cache)
        if len(states) < 2:  # a placeholder: what vLLM put there, as it is
            return cls(states[0] if states else None, None)
        conv_state, ssm_state, *extra = states
        if len(extra) == 3:
            return cls(conv_state, ssm_state, *extra)
        return cls(conv_state, ssm_state, counts=extra[0] if extra else None)

    @staticmethod
    def counts_of(kv_cache) -> torch.Tensor | None:
        """`of(kv_cache).counts` without building the page: the count is the last extra state of either layout (read
        every step by each GDN group's metadata build)."""
        return kv_cache[-1] if len(kv_cache) > 2 else None


@dataclass(frozen=True)
class BufferLayout:
    """Per state slot: `num_nodes` rows of factors `[raw keys (HV, K) | key inverse norms (HV) | pseudo-values
    (HV, V) | log decays (HV)]` (keys per value head: each (slot, value head) program owns what it reads and
    rewrites), `num_nodes` rows of conv inputs, and the count of verified nodes. Head counts and conv_dim are this
    tensor-parallel rank's."""

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
    def factor_width(self) -> int:
        return slot_factor_width(self.num_v_heads, self.head_k_dim, self.head_v_dim)

    def shapes(self) -> tuple[tuple[int, int], tuple[int, int], tuple[int]]:
        return (self.num_nodes, self.factor_width), (self.num_nodes, self.conv_dim), COUNT_SHAPE

    @staticmethod
    def dtypes(conv_dtype: torch.dtype) -> tuple[torch.dtype, torch.dtype, torch.dtype]:
        return FACTORS_DTYPE, conv_dtype, COUNT_DTYPE

    def split(self, factors: torch.Tensor):
        """Views of factor rows `[..., F]`: raw keys `[..., HV, K]`, key inverse norms `[..., HV]`, pseudo-values
        `[..., HV, V]`, log decays `[..., HV]`."""
        return split_slot_factors(factors, self.num_v_heads, self.head_k_dim, self.head_v_dim)


@dataclass(frozen=True)
class PseudoValueBuffer:
    """Views of one layer's buffer: factors `[S, T, F]`, conv inputs `[S, T, conv_dim]` (the count state is read
    through `verified_node_counts` of the layer)."""

    factors: torch.Tensor
    conv_inputs: torch.Tensor
    layout: BufferLayout

    def write_factors(self, slots, nodes, keys, key_scales, pseudo_values, log_decays) -> None:
        """Stores packed nodes `[N, ...]` at (slot, local node index) `slots[i], nodes[i]`; keys and key scales per
        key head `[N, H, K]`, `[N, H]` (stored per value head)."""
        ratio = self.layout.num_v_heads // keys.shape[1]
        row = torch.cat([keys.repeat_interleave(ratio, dim=1).flatten(1), key_scales.repeat_interleave(ratio, dim=1),
                         pseudo_values.flatten(1), log_decays], dim=1)
        self.factors.index_put_((slots, nodes), row.to(self.factors.dtype))

    def slot_factors(self, state_indices: torch.Tensor):
        """The factor rows `[B, T, ...]` of the slots `state_indices [B]` (a copy), split as `BufferLayout.split`."""
        return self.layout.split(self.factors[state_indices.long()])


def _model_buffer_layout(vllm_config) -> BufferLayout:
    hf_config = vllm_config.model_config.hf_text_config
    return BufferLayout.of_model(
        vllm_config.parallel_config.tensor_parallel_size, hf_config.linear_num_key_heads,
        hf_config.linear_num_value_heads, hf_config.linear_key_head_dim, hf_config.linear_value_head_dim,
        vllm_config.speculative_config.num_speculative_tokens,
    )


def extra_page_shapes(speculative_config, buffer_layout: Callable[[], BufferLayout]) -> tuple[tuple[int, ...], ...]:
    """The states after vLLM's conv and SSM states on a GDN page: reconstruct's buffer (factors, conv inputs, count;
    `buffer_layout()` says their sizes); a store_all draft tree's count alone; none otherwise."""
    if reconstructs_mamba_state(speculative_config):
        return buffer_layout().shapes()
    return (COUNT_SHAPE,) if keeps_slot_counts(speculative_config) else ()


def extra_page_dtypes(speculative_config, conv_dtype: torch.dtype) -> tuple[torch.dtype, ...]:
    """The dtypes of `extra_page_shapes`."""
    if reconstructs_mamba_state(speculative_config):
        return BufferLayout.dtypes(conv_dtype)
    return (COUNT_DTYPE,) if keeps_slot_counts(speculative_config) else ()


def _appending_page_states(original, extra_states):
    """Wraps a model's `get_mamba_state_{shape,dtype}_from_config` classmethod (`original`, as the class resolves
    it) so that the extra page states follow vLLM's conv and SSM states: vLLM sizes a hybrid's pages from them."""
    function = original.__func__

    @functools.wraps(function)
    def with_extra_states(cls, vllm_config):
        states = function(cls, vllm_config)
        return (*states, *extra_states(vllm_config, states))

    return classmethod(with_extra_states)


def install() -> None:
    """The GDN models' state shapes and dtypes (`MODEL_STATE_SHAPES`, `MODEL_STATE_DTYPES`) include the extra page
    states."""
    for shape_point, dtype_point in zip(MODEL_STATE_SHAPES, MODEL_STATE_DTYPES, strict=True):
        shape_point.wrap(_appending_page_states, lambda vllm_config, _: extra_page_shapes(
            vllm_config.speculative_config, lambda: _model_buffer_layout(vllm_config)))
        dtype_point.wrap(_appending_page_states, lambda vllm_config, dtypes: extra_page_dtypes(
            vllm_config.speculative_config, dtypes[0]))
