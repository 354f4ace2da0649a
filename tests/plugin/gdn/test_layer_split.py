"""The CUDA path's split of a mixed batch: speculative chains to reconstruct, the prefills to vLLM's own GDN code
and its gated RMSNorm (the fused-norm path, `_forward_core_fused_norm`).

Runs on CPU with stand-ins for both halves (the kernels themselves are tested in tests/kernels and on the H200):
it checks the plumbing, i.e. which tokens go where, what metadata vLLM's half sees, and that the layer's
metadata is restored afterwards.
"""

from types import SimpleNamespace

import pytest
import torch
from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import QwenGatedDeltaNetAttention

from vllm_treewy.vllm_plugin.gdn import layer as gdn_layer
from vllm_treewy.vllm_plugin.patch_points import ENCODE_LAYER_NAME
from vllm_treewy.vllm_plugin.gdn.step_metadata import ReconstructGDNAttentionMetadata

HV, V, CONV_DIM = 2, 3, 5


def _mixed_batch_metadata():
    # Batch rows: 0 prefill (3 tokens), 1 spec decode (1 + 2 drafts), 2 plain decode, 3 spec decode (1 + 2).
    # Token order in the batch: prefill 0-2, spec 3-5, decode 6, spec 7-9.
    spec = torch.tensor([3, 4, 5, 7, 8, 9])
    rest = torch.tensor([0, 1, 2, 6])
    masks = torch.tensor([False, True, False, True])
    return ReconstructGDNAttentionMetadata(
        num_prefills=1, num_prefill_tokens=3, num_decodes=1, num_decode_tokens=1, num_spec_decodes=2,
        num_spec_decode_tokens=6, num_actual_tokens=10, spec_query_start_loc=torch.tensor([0, 3, 6]),
        non_spec_query_start_loc=torch.tensor([0, 3, 4]), spec_state_indices_tensor=torch.tensor([[7], [9]]),
        non_spec_state_indices_tensor=torch.tensor([5, 6]), spec_sequence_masks=masks, spec_sequence_masks_cpu=masks,
        spec_token_indx=spec, non_spec_token_indx=rest, num_accepted_tokens=torch.tensor([1, 2, 1, 3]),
        commit_nodes=torch.tensor([0, 2]),
    )


def _layer(monkeypatch, prefix, seen):
    """A layer whose reconstruct step and vLLM half are stand-ins: the spec output is token + 100, vLLM's -1, and
    the gated RMSNorm doubles."""

    def step_triton(layer, md, x, a, b, output_gate, out, **caches):
        seen["spec_tokens"] = x[:, 0].tolist()
        seen["spec_gate"] = output_gate[:, 0, 0].tolist()
        out.copy_(x[:, :1, None].expand(-1, HV, V) + 100.0)

    monkeypatch.setattr(gdn_layer.reconstruct, "step_triton", step_triton)
    monkeypatch.setattr(gdn_layer.ReconstructGatedDeltaNetAttention, "_caches", lambda self, metadata: {})
    monkeypatch.setattr(QwenGatedDeltaNetAttention, "_rms_norm_gated_cuda",
                        lambda self, x, gate, out: out.copy_(2 * x))
    layer = object.__new__(gdn_layer.ReconstructGatedDeltaNetAttention)
    layer.prefix, layer.reconstructs_state = prefix, True
    return layer


def test_mixed_batch_goes_half_to_reconstruct_half_to_vllm(monkeypatch):
    metadata = _mixed_batch_metadata()
    context = SimpleNamespace(attn_metadata={"model.layers.0.linear_attn": metadata})
    monkeypatch.setattr(gdn_layer, "get_forward_context", lambda: context)
    seen = {}

    def vllm_forward_core(self, mixed_qkv, b, a, core_attn_out):
        seen["metadata"] = context.attn_metadata[self.prefix]
        seen["tokens"] = mixed_qkv[:, 0].tolist()
        core_attn_out.fill_(-1.0)

    monkeypatch.setattr(QwenGatedDeltaNetAttention, "_forward_core", vllm_forward_core)
    layer = _layer(monkeypatch, "model.layers.0.linear_attn", seen)

    tokens = torch.arange(10.0)
    mixed_qkv = tokens[:, None].expand(-1, CONV_DIM).contiguous()
    gate = tokens[:, None, None].expand(-1, HV, V).contiguous()
    out = torch.zeros(10, HV, V)
    layer._forward_core_fused_norm(mixed_qkv, torch.zeros(10, HV), torch.zeros(10, HV), gate, out)

    assert seen["spec_tokens"] == [3, 4, 5, 7, 8, 9] and seen["spec_gate"] == [3, 4, 5, 7, 8, 9]
    assert seen["tokens"] == [0, 1, 2, 6]
    rest_md = seen["metadata"]
    assert rest_md.spec_sequence_masks is None and rest_md.num_spec_decodes == 0
    assert rest_md.num_actual_tokens == 4 and rest_md.num_prefills == 1 and rest_md.num_decodes == 1
    assert rest_md.non_spec_state_indices_tensor.tolist() == [5, 6]
    assert context.attn_metadata["model.layers.0.linear_attn"] is metadata  # restored
    expected = torch.full((10,), -2.0)  # vLLM's half, then the gated RMSNorm
    expected[[3, 4, 5, 7, 8, 9]] = torch.tensor([103.0, 104, 105, 107, 108, 109])
    torch.testing.assert_close(out[:, 0, 0], expected)


def test_batch_of_only_spec_decodes_skips_vllm(monkeypatch):
    metadata = ReconstructGDNAttentionMetadata(
        num_prefills=0, num_prefill_tokens=0, num_decodes=0, num_decode_tokens=0, num_spec_decodes=2,
        num_spec_decode_tokens=6, num_actual_tokens=6, spec_query_start_loc=torch.tensor([0, 3, 6]),
        spec_state_indices_tensor=torch.tensor([[7], [9]]), spec_sequence_masks=torch.tensor([True, True]),
        commit_nodes=torch.tensor([1, -1]),
    )
    context = SimpleNamespace(attn_metadata={"l": metadata})
    monkeypatch.setattr(gdn_layer, "get_forward_context", lambda: context)
    monkeypatch.setattr(QwenGatedDeltaNetAttention, "_forward_core",
                        lambda *args: (_ for _ in ()).throw(AssertionError("vLLM's half must not run")))
    layer = _layer(monkeypatch, "l", {})
    out = torch.zeros(8, HV, V)  # padded beyond the 6 real tokens, as under CUDA graphs
    layer._forward_core_fused_norm(torch.arange(8.0)[:, None].expand(-1, CONV_DIM), torch.zeros(8, HV),
                                   torch.zeros(8, HV), torch.zeros(8, HV, V), out)
    torch.testing.assert_close(out[:6, 0, 0], torch.arange(6.0) + 100)
    assert out[6:].abs().sum() == 0


def test_unfused_path_refuses_speculative_tokens_under_reconstruct(monkeypatch):
    metadata = _mixed_batch_metadata()
    monkeypatch.setattr(gdn_layer, "get_forward_context", lambda: SimpleNamespace(attn_metadata={"l": metadata}))
    layer = _layer(monkeypatch, "l", {})
    with pytest.raises(RuntimeError, match="fused-norm"):
        layer._forward_core(torch.zeros(10, CONV_DIM), torch.zeros(10, HV), torch.zeros(10, HV), torch.zeros(10, HV, V))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_reconstruct_takes_the_fused_norm_op_in_fp16_too(monkeypatch, dtype):
    """vLLM's forward_cuda takes the fused-norm op for bf16 activations only; under reconstruct an fp16 model takes it
    too (its unfused op would verify from a state per draft position). The projections are stand-ins here."""
    taken = []
    monkeypatch.setattr(QwenGatedDeltaNetAttention, "forward_cuda",
                        lambda self, hidden_states: taken.append("vllm") or hidden_states)

    def fused_norm_op(mixed_qkvz, ba, core_attn_out, layer_name):
        taken.append(("op", mixed_qkvz.dtype, ba.shape, core_attn_out.shape, layer_name))
        core_attn_out.fill_(3.0)

    monkeypatch.setattr(torch.ops.vllm, "qwen_gdn_attention_core_fused_norm_packed", fused_norm_op)
    layer = object.__new__(gdn_layer.ReconstructGatedDeltaNetAttention)
    layer.prefix, layer.reconstructs_state, layer.tp_size, layer.num_v_heads, layer.head_v_dim = "l", True, 1, HV, V
    layer.in_proj_qkvz = lambda h: (h.repeat(1, 2), None)
    layer.in_proj_ba = lambda h: (h[:, : 2 * HV], None)
    layer.out_proj = lambda x: (x.sum(-1, keepdim=True), None)
    hidden = torch.ones(4, 8, dtype=dtype)
    output = gdn_layer.ReconstructGatedDeltaNetAttention.forward_cuda(layer, hidden)
    if dtype == torch.bfloat16:
        assert taken == ["vllm"]  # vLLM's own forward_cuda, which takes the op itself
        return
    # vLLM's encoding of the name (a LayerName where torch lifts it as a graph input)
    assert taken == [("op", torch.float16, (4, 2 * HV), (4, HV, V), ENCODE_LAYER_NAME.resolve()("l"))]
    torch.testing.assert_close(output, torch.full((4, 1), 3.0 * HV * V, dtype=dtype))
