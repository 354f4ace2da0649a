"""The pseudo-value buffer: the commit's factors live in vLLM's KV-cache page, not in what verify was handed.

Under vLLM's piecewise CUDA graphs the GDN op's input `mixed_qkv` is a graph output in the graph pool, which the
later pieces of the same forward overwrite before the commit runs after sampling; the commit must not read it.
"""

import functools
from types import SimpleNamespace

import pytest
import torch
from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import QwenGatedDeltaNetAttention
from vllm.model_executor.layers.mamba.mamba_utils import MambaStateShapeCalculator

from vllm_treewy.vllm_plugin import reconstruct
from vllm_treewy.vllm_plugin.gdn_layer import ReconstructGatedDeltaNetAttention
from vllm_treewy.vllm_plugin.patch_points import MODEL_STATE_SHAPES
from vllm_treewy.vllm_plugin.pseudo_value_buffer import BufferLayout, PseudoValueBuffer, install

H, HV, K, V, WIDTH, NUM_SPEC, NUM_SLOTS = 2, 4, 8, 8, 4, 3, 5
CONV_DIM = 2 * H * K + HV * V


def _gdn_layer_stand_in():
    """What `verify_chains` reads of a GDN layer, with vLLM's own `rearrange_mixed_qkv`."""
    layer = SimpleNamespace(
        activation="silu", key_dim=H * K, value_dim=HV * V, tp_size=1, head_k_dim=K, head_v_dim=V,
        conv1d=SimpleNamespace(bias=torch.randn(CONV_DIM) * 0.1),
        A_log=torch.randn(HV) * 0.5, dt_bias=torch.randn(HV) * 0.5,
    )
    layer.rearrange_mixed_qkv = functools.partial(QwenGatedDeltaNetAttention.rearrange_mixed_qkv, layer)
    return layer


def _verify_then_commit(x, a, b, clobber_inputs: bool):
    torch.manual_seed(1)
    layer = _gdn_layer_stand_in()
    conv_weight = torch.randn(CONV_DIM, WIDTH) * 0.3
    conv_history = torch.randn(NUM_SLOTS, CONV_DIM, WIDTH - 1)
    ssm_state = torch.randn(NUM_SLOTS, HV, V, K) * 0.1
    layout = BufferLayout.of_model(1, H, HV, K, V, NUM_SPEC)
    factors_shape, conv_shape = layout.shapes()
    buffer = PseudoValueBuffer(torch.full((NUM_SLOTS, *factors_shape), float("nan")),
                               torch.full((NUM_SLOTS, *conv_shape), float("nan")), layout)
    # Two requests of 1 + 3 nodes in slots 3 and 1.
    slots, cu_nodes = torch.tensor([3, 1], dtype=torch.int32), torch.tensor([0, 4, 8], dtype=torch.int32)
    parents = torch.tensor([-1, 0, 1, 2, -1, 0, 1, 2], dtype=torch.int32)
    node_slots, node_indices = torch.tensor([3, 3, 3, 3, 1, 1, 1, 1]), torch.tensor([0, 1, 2, 3, 0, 1, 2, 3])
    history_before = conv_history.clone()
    out = reconstruct.verify_chains(
        layer, reconstruct.TORCH_KERNELS, x, a, b, conv_weight=conv_weight, conv_history=conv_history,
        ssm_state=ssm_state, slots=slots, parents=parents, cu_nodes=cu_nodes, max_nodes=1 + NUM_SPEC,
        buffer=buffer, node_slots=node_slots, node_indices=node_indices,
    )
    if clobber_inputs:  # what the next CUDA graph pieces do to the op's inputs before the commit runs
        for t in (x, a, b):
            t.normal_()
    accepted = torch.tensor([2, 0], dtype=torch.int32)
    reconstruct.commit_layer(
        reconstruct.TORCH_KERNELS, accepted, buffer=buffer, conv_history=conv_history, ssm_state=ssm_state,
        slots=slots, parents=parents, cu_nodes=cu_nodes, node_slots=node_slots, node_indices=node_indices,
        max_nodes=1 + NUM_SPEC,
    )
    return out, conv_history, ssm_state, history_before


def test_commit_reads_the_buffer_not_the_verify_inputs():
    torch.manual_seed(0)
    x, a, b = torch.randn(8, CONV_DIM), torch.randn(8, HV), torch.randn(8, HV)
    out, history, state, before = _verify_then_commit(x.clone(), a.clone(), b.clone(), clobber_inputs=False)
    out_c, history_c, state_c, _ = _verify_then_commit(x.clone(), a.clone(), b.clone(), clobber_inputs=True)
    torch.testing.assert_close(out_c, out)
    torch.testing.assert_close(state_c, state)
    torch.testing.assert_close(history_c, history)
    # The conv history continues with the accepted path's inputs: slot 3 accepted node 2, slot 1 node 0.
    torch.testing.assert_close(history[3], x[0:3].T)
    torch.testing.assert_close(history[1], torch.cat([before[1][:, 1:], x[4:5].T], dim=1))
    untouched = [0, 2, 4]
    torch.testing.assert_close(history[untouched], before[untouched])


def test_buffer_round_trip_keeps_each_node_in_its_slot_row():
    layout = BufferLayout.of_model(1, H, HV, K, V, NUM_SPEC)
    factors_shape, conv_shape = layout.shapes()
    assert factors_shape == (1 + NUM_SPEC, H * K + HV * V + HV) and conv_shape == (1 + NUM_SPEC, CONV_DIM)
    buffer = PseudoValueBuffer(torch.zeros(NUM_SLOTS, *factors_shape), torch.zeros(NUM_SLOTS, *conv_shape,
                                                                                   dtype=torch.bfloat16), layout)
    slots, nodes = torch.tensor([4, 4, 0]), torch.tensor([0, 1, 0])
    keys, values, decays = torch.randn(3, H, K), torch.randn(3, HV, V), -torch.rand(3, HV)
    conv_inputs = torch.randn(3, CONV_DIM).bfloat16()
    buffer.write(slots, nodes, keys, values, decays, conv_inputs)
    read = buffer.read(torch.tensor([0, 4]), torch.tensor([0, 1]))
    for got, want in zip(read, (keys[[2, 1]], values[[2, 1]], decays[[2, 1]], conv_inputs[[2, 1]])):
        torch.testing.assert_close(got, want)
    assert buffer.factors[[1, 2, 3]].abs().sum() == 0 and buffer.factors[4, 2:].abs().sum() == 0


def _layer_for_binding(reconstructs: bool):
    layer = object.__new__(ReconstructGatedDeltaNetAttention)
    torch.nn.Module.__init__(layer)
    layer.reconstructs_state = reconstructs
    layer.tp_size, layer.num_k_heads, layer.num_v_heads, layer.head_k_dim, layer.head_v_dim = 1, H, HV, K, V
    layer.conv_kernel_size, layer.num_spec = WIDTH, NUM_SPEC
    layer.model_config = SimpleNamespace(dtype=torch.bfloat16)
    layer.cache_config = SimpleNamespace(mamba_cache_dtype="auto", mamba_ssm_cache_dtype="float32")
    return layer


def test_buffer_views_follow_vllms_states_on_the_page():
    layer = _layer_for_binding(reconstructs=True)
    conv_shape, ssm_shape = layer.get_state_shape()
    layout = layer.buffer_layout()
    state_bytes = torch.Size(conv_shape).numel() * 2 + torch.Size(ssm_shape).numel() * 4
    buffer_bytes = layout.num_nodes * (layout.factor_width * 4 + layout.conv_dim * 2)
    page = state_bytes + buffer_bytes + 64  # vLLM pads pages to the attention page
    raw = torch.zeros(NUM_SLOTS, 1, 1, page, dtype=torch.int8)
    layer.bind_kv_cache(raw)
    conv, ssm, factors, conv_inputs = layer.kv_cache
    assert factors.shape == (NUM_SLOTS, *layout.shapes()[0]) and factors.dtype == torch.float32
    assert conv_inputs.shape == (NUM_SLOTS, *layout.shapes()[1]) and conv_inputs.dtype == torch.bfloat16
    factors.fill_(1.0)
    conv_inputs.fill_(2.0)
    assert conv.abs().sum() == 0 and ssm.abs().sum() == 0  # the buffer does not overlap vLLM's states
    assert int(raw[:, 0, 0, state_bytes + buffer_bytes:].abs().sum()) == 0  # nor the padding
    plain = _layer_for_binding(reconstructs=False)
    plain.bind_kv_cache(torch.zeros(NUM_SLOTS, 1, 1, page, dtype=torch.int8))
    assert len(plain.kv_cache) == 2


@pytest.mark.parametrize("strategy", ["store_all", "reconstruct"])
def test_model_state_shapes_match_the_layers_page(strategy):
    """vLLM sizes the attention pages from the model's classmethods: they must hold the buffer too."""
    install()
    hf = SimpleNamespace(linear_num_key_heads=H, linear_num_value_heads=HV, linear_key_head_dim=K,
                         linear_value_head_dim=V, linear_conv_kernel_dim=WIDTH)
    vllm_config = SimpleNamespace(
        model_config=SimpleNamespace(hf_text_config=hf, dtype=torch.bfloat16),
        parallel_config=SimpleNamespace(tensor_parallel_size=1),
        cache_config=SimpleNamespace(mamba_cache_dtype="auto", mamba_ssm_cache_dtype="float32"),
        speculative_config=SimpleNamespace(num_speculative_tokens=NUM_SPEC, mamba_state_commit=strategy),
    )
    layer = _layer_for_binding(reconstructs=strategy == "reconstruct")
    base = MambaStateShapeCalculator.gated_delta_net_state_shape(1, H, HV, K, V, WIDTH, NUM_SPEC)
    expected = (*base, *layer.buffer_layout().shapes()) if strategy == "reconstruct" else base
    for model_cls in {point.resolve().__self__ for point in MODEL_STATE_SHAPES}:
        assert model_cls.get_mamba_state_shape_from_config(vllm_config) == expected
        dtypes = model_cls.get_mamba_state_dtype_from_config(vllm_config)
        assert len(dtypes) == len(expected)
