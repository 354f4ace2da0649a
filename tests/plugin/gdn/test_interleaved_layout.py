"""Qwen3-Next's GDN projections (interleaved by key head) reach the CUDA fused-norm path as Qwen3.5's flat ones do.

vLLM's packed fused-norm op (`_forward_core_fused_norm_packed`) splits the flat layout; the plugin's layer unpacks the
interleaved one first. Runs on CPU with the fused-norm path itself a stand-in (what it is handed is recorded): the
same tokens projected in either layout must hand it the same q/k/v, output gate z, b and a.
"""

from types import SimpleNamespace

import pytest
import torch
from vllm.model_executor.layers.mamba.gdn import qwen_gdn_linear_attn
from vllm.v1.attention.backends.gdn_attn import GDNAttentionMetadata

from vllm_treewy.vllm_plugin.gdn.layer import ReconstructGatedDeltaNetAttention

PREFIX = "model.layers.0.linear_attn"
TOKENS = 5


def _layer(interleaved: bool, heads: tuple[int, int, int, int], tp_size: int = 1):
    num_k, num_v, head_k, head_v = heads
    layer = object.__new__(ReconstructGatedDeltaNetAttention)
    layer.prefix, layer.gqa_interleaved_layout, layer.tp_size, layer.disable_tp_for_ba_proj = (
        PREFIX, interleaved, tp_size, False)
    layer.num_k_heads, layer.num_v_heads, layer.head_k_dim, layer.head_v_dim = heads
    layer.key_dim, layer.value_dim = num_k * head_k, num_v * head_v
    return layer


def _projections(heads, tp_size):
    """One rank's q, k `[T, HK, K]`, v, z `[T, HV, V]`, b, a `[T, HV]` (its HK = num_k / tp key heads, and the value
    heads of each in order), and their packing in the flat and in the interleaved layout."""
    num_k, num_v, head_k, head_v = heads
    hk, hv = num_k // tp_size, num_v // tp_size
    q, k = torch.randn(TOKENS, hk, head_k), torch.randn(TOKENS, hk, head_k)
    v, z = torch.randn(TOKENS, hv, head_v), torch.randn(TOKENS, hv, head_v)
    b, a = torch.randn(TOKENS, hv), torch.randn(TOKENS, hv)
    flat = (torch.cat([t.flatten(1) for t in (q, k, v, z)], dim=-1), torch.cat([b, a], dim=-1))
    per_group = num_v // num_k  # value heads per key head
    by_group = lambda t: t.reshape(TOKENS, hk, -1)  # noqa: E731  [T, HK, per_group * ...]
    interleaved = (torch.cat([q, k, by_group(v), by_group(z)], dim=-1).flatten(1),
                   torch.cat([by_group(b), by_group(a)], dim=-1).flatten(1))
    assert interleaved[1].shape[-1] == hk * 2 * per_group
    return (q, k, v, z, b, a), flat, interleaved


@pytest.mark.parametrize("heads", [(2, 4, 8, 6), (2, 2, 4, 4), (4, 16, 4, 2)], ids=str)
@pytest.mark.parametrize("tp_size", [1, 2])
def test_interleaved_projections_reach_the_fused_norm_path_as_flat_ones(monkeypatch, heads, tp_size):
    handed = {}

    def fused_norm(self, mixed_qkv, b, a, output_gate, core_attn_out):
        handed[self.gqa_interleaved_layout] = (mixed_qkv, b, a, output_gate)

    monkeypatch.setattr(ReconstructGatedDeltaNetAttention, "_forward_core_fused_norm", fused_norm)
    metadata = GDNAttentionMetadata(num_prefills=0, num_prefill_tokens=0, num_decodes=0, num_decode_tokens=0,
                                    num_spec_decodes=1, num_spec_decode_tokens=TOKENS, num_actual_tokens=TOKENS)
    context = SimpleNamespace(attn_metadata={PREFIX: metadata})
    monkeypatch.setattr(qwen_gdn_linear_attn, "get_forward_context", lambda: context)

    (q, k, v, z, b, a), flat, interleaved = _projections(heads, tp_size)
    out = torch.zeros(TOKENS, heads[1] // tp_size, heads[3])
    _layer(False, heads, tp_size)._forward_core_fused_norm_packed(*flat, out)  # vLLM's own split
    _layer(True, heads, tp_size)._forward_core_fused_norm_packed(*interleaved, out)

    expected = (torch.cat([t.flatten(1) for t in (q, k, v)], dim=-1), b, a, z)
    for layout in (False, True):
        for name, got, want in zip(("qkv", "b", "a", "z"), handed[layout], expected):
            assert torch.equal(got.reshape(want.shape), want), (layout, name)
