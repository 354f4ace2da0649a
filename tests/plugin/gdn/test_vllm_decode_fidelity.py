"""Our CUDA path's two steps against vLLM 0.32's own CUDA kernels, run on CPU in Triton's interpreter with bf16
rounded as on the GPU (`vllm_interpreted`).

The conv (`conv_step_triton`) against vLLM's `causal_conv1d_update`, for one token per request (plain decode) and
for chains read from the committed history (vLLM's speculative conv, what store_all runs): bit for bit (we sum the
window in the other order, which shows only where four bf16 products do not sum exactly in fp32: not here).

The torch twin of the conv is the CPU path: it keeps exact products, as vLLM's CPU conv does (bit for bit with it
below), where vLLM's CUDA conv rounds each product to bf16.

The fused GDN step after the conv (one token, nothing pending) against vLLM's non-speculative decode of that token,
composed from the pieces the CPU wheel ships:

- the core output: fla's `fused_recurrent_gated_delta_rule_packed_decode` (decode-only batches, the default) or
  `fused_sigmoid_gating_delta_rule_update` (the decodes of a batch with prefills), both written in bf16;
- the gated RMSNorm over that bf16 output: `RMSNormGated.forward_static` (what Inductor compiles under the default
  compilation, custom ops off) and fla's Triton `layer_norm_fwd` (custom ops on; vLLM's speculative fallback).

Exact equality is not reachable: vLLM takes o = (alpha h0 + k u^T) q from the updated state, the closed form
o = alpha (h0 q) + (q.k) u without it, so the fp32 core outputs differ by float32 rounding (~1e-7 relative) and a
few elements round to the neighbouring bf16 value before the norm. Bound: at most 0.2% of the outputs differ (1 to 5
of 8192 here), each by less than one bf16 step of its head's largest output (an element of o near zero, where the
terms cancel, can be a few of its own steps off). Without rounding the core output to bf16 before the norm, as our
kernels did, a quarter of the outputs differ (2046 of 8192; checked below).
"""

import functools

import pytest
import torch
from vllm.model_executor.layers.layernorm import RMSNormGated

from vllm_treewy.kernels.conv_step_torch import conv_step_packed
from vllm_treewy.kernels.factor_rows import slot_factor_width
from vllm_treewy.kernels.gdn_step_torch import gdn_step_packed
from vllm_treewy.kernels.conv_step_triton import conv_step_triton
from vllm_treewy.kernels.gdn_step_triton import gdn_step_triton

from tests.plugin.vllm_interpreted import load_fla, load_vllm_module

pytestmark = [
    pytest.mark.skipif(torch.cuda.is_available(), reason="CPU: vLLM's Triton kernels in the interpreter"),
    pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning"),  # the interpreter
]

H, HV, K, V, B = 2, 4, 128, 128, 16  # Qwen3.5's head dims and value/key head ratio, a few heads
EPS = 1e-6
MAX_DIFFERING = 0.002


def decode_inputs(seed):
    """Post-conv bf16 mixed_qkv, a, b, z; A_log fp32, dt_bias and norm weight bf16 (as vLLM holds them); fp32 state
    slots 1..B (vLLM's kernels skip slot 0, the null block)."""
    gen = torch.Generator().manual_seed(seed)
    mixed_qkv = torch.randn(B, 2 * H * K + HV * V, generator=gen).bfloat16()
    a = (2 * torch.randn(B, HV, generator=gen)).bfloat16()
    b = (2 * torch.randn(B, HV, generator=gen)).bfloat16()
    A_log = 0.5 * torch.randn(HV, generator=gen)
    dt_bias = torch.randn(HV, generator=gen).bfloat16()
    z = torch.randn(B, HV, V, generator=gen).bfloat16()
    weight = (1 + 0.1 * torch.randn(V, generator=gen)).bfloat16()
    state = 0.05 * torch.randn(B + 1, HV, V, K, generator=gen)
    return (mixed_qkv, a, b, A_log, dt_bias, z, weight), state


def vllm_core(kernel, inputs, state, dtype=torch.bfloat16):
    """vLLM's decode kernel's core output [B, HV, V] in `dtype` (vLLM's buffer is bf16)."""
    mixed_qkv, a, b, A_log, dt_bias = inputs[:5]
    fused_recurrent, fused_sigmoid_gating = load_fla("fused_recurrent", "fused_sigmoid_gating")
    slots = torch.arange(1, B + 1, dtype=torch.int32)
    if kernel == "packed":
        out = torch.zeros(B, 1, HV, V, dtype=dtype)
        fused_recurrent.fused_recurrent_gated_delta_rule_packed_decode(
            mixed_qkv=mixed_qkv, a=a, b=b, A_log=A_log, dt_bias=dt_bias, scale=K**-0.5, initial_state=state.clone(),
            out=out, ssm_state_indices=slots, use_qk_l2norm_in_kernel=True)
        return out[:, 0]
    assert dtype == torch.bfloat16  # this kernel's output takes q's dtype
    # vLLM's `rearrange_mixed_qkv`: contiguous [1, B, heads, dim] q, k, v
    q, k, v = (t.contiguous().view(1, B, -1, d) for t, d in
               zip(mixed_qkv.split([H * K, H * K, HV * V], dim=-1), (K, K, V)))
    out, _ = fused_sigmoid_gating.fused_sigmoid_gating_delta_rule_update(
        A_log=A_log, a=a, b=b, dt_bias=dt_bias, q=q, k=k, v=v, initial_state=state.clone(),
        inplace_final_state=True, cu_seqlens=torch.arange(B + 1, dtype=torch.int32), ssm_state_indices=slots,
        use_qk_l2norm_in_kernel=True)
    return out[0]


def vllm_norm(kind, o, z, weight):
    if kind == "native":
        return RMSNormGated.forward_static(o, z, weight, EPS, torch.bfloat16, None, True, "silu")
    (layernorm,) = load_fla("layernorm_guard")
    out = torch.empty(B * HV, V, dtype=torch.bfloat16)
    layernorm.layer_norm_fwd(o.reshape(-1, V), weight, None, EPS, z=z.reshape(-1, V), out=out, group_size=V,
                             norm_before_gate=True, is_rms_norm=True, activation="silu")
    return out.view(B, HV, V)


def ours(kind, inputs, state, **launch):
    slots = torch.arange(1, B + 1, dtype=torch.int32)
    parents = torch.full((B,), -1, dtype=torch.int32)
    cu_nodes = torch.arange(B + 1, dtype=torch.int32)
    factors = torch.zeros(B + 1, 1, slot_factor_width(HV, K, V))
    if kind == "twin":
        return gdn_step_packed(*inputs, state.clone(), slots, parents, cu_nodes, num_key_heads=H, factors=factors,
                               norm_eps=EPS)
    return gdn_step_triton(*inputs, state.clone(), slots, cu_nodes, factors=factors, num_key_heads=H,
                           max_nodes=1, norm_eps=EPS, **launch)


# Our decodes of `decode_inputs(seed=7)` (the torch twin, the Triton step as the adapter calls it), against which both
# vLLM decode kernels are held.
OUR_DECODES = [("twin", {}), ("triton", {})]


@functools.cache
def our_decode(index: int) -> torch.Tensor:
    """`ours` for `OUR_DECODES[index]` on `decode_inputs(seed=7)`: the same inputs for both vLLM kernels, so each
    interpreted launch runs once per session, not once per kernel it is compared with (read only)."""
    kind, launch = OUR_DECODES[index]
    inputs, state = decode_inputs(seed=7)
    return ours(kind, inputs, state, **launch)


def bf16_steps(x, y):
    """|x - y| in bf16 steps (ordered bit patterns)."""
    def ordered(t):
        bits = t.view(torch.int16).int()
        return torch.where(bits < 0, -(bits & 0x7FFF), bits)
    return (ordered(x) - ordered(y)).abs()


@pytest.mark.parametrize("kernel", ["packed", "sigmoid_gating"])
def test_gated_step_matches_vllm_decode(kernel):
    inputs, state = decode_inputs(seed=7)
    z, weight = inputs[5:]
    core = vllm_core(kernel, inputs, state)
    expected = vllm_norm("native", core, z, weight)
    assert torch.equal(vllm_norm("fla", core, z, weight), expected)  # vLLM's two norms agree bit for bit
    for index, (kind, launch) in enumerate(OUR_DECODES):
        actual = our_decode(index)
        assert (bf16_steps(actual, expected) > 0).float().mean() <= MAX_DIFFERING, (kind, launch)
        head_step = expected.float().abs().amax(-1, keepdim=True) * 2.0**-8
        assert ((actual.float() - expected.float()).abs() < head_step).all(), (kind, launch)
    if kernel == "packed":
        # the rounding point matters: vLLM's norm of its own fp32 core output (no bf16 rounding first)
        unrounded = vllm_norm("native", vllm_core(kernel, inputs, state, torch.float32), z, weight)
        assert (bf16_steps(unrounded, expected) > 0).float().mean() > 0.1


@pytest.mark.parametrize("tokens", [1, 4])
@pytest.mark.parametrize("weight_dtype", [torch.bfloat16, torch.float32])
def test_conv_step_matches_vllm_conv(tokens, weight_dtype):
    """Our Triton conv vs vLLM's CUDA conv. bf16 inputs and history, silu, no bias (Qwen3.5's conv). With a bf16
    weight vLLM's kernel multiplies in bf16: each product is rounded before the fp32 sum (exact products put ~36% of
    the outputs one bf16 step off); with an fp32 weight the products are fp32 on both sides."""
    conv = load_vllm_module("vllm.model_executor.layers.mamba.ops.causal_conv1d")
    requests, channels, width = 8, 512, 4
    gen = torch.Generator().manual_seed(tokens)
    x = torch.randn(requests * tokens, channels, generator=gen).bfloat16()
    weight = (0.3 * torch.randn(channels, width, generator=gen)).to(weight_dtype)
    # vLLM's layout: [S, L, D] storage seen as [S, D, L]; speculative: L = w-1+T-1, read from column 0 at 1 accepted
    history = torch.randn(requests + 1, width - 1 + tokens - 1, channels, generator=gen).bfloat16().transpose(1, 2)
    slots = torch.arange(1, requests + 1, dtype=torch.int32)
    cu_nodes = torch.arange(0, requests * tokens + 1, tokens, dtype=torch.int32)
    speculative = {} if tokens == 1 else dict(num_accepted_tokens=torch.ones(requests, dtype=torch.int32),
                                               query_start_loc=cu_nodes, max_query_len=tokens)
    expected = conv.causal_conv1d_update(x.clone(), history.clone(), weight, None, "silu", conv_state_indices=slots,
                                         **speculative)
    parents = torch.tensor([-1, *range(tokens - 1)] * requests, dtype=torch.int32)
    inputs = torch.zeros(requests + 1, tokens, channels, dtype=torch.bfloat16)
    actual = conv_step_triton(x, history.clone()[:, :, : width - 1], slots, weight, None, parents, cu_nodes, inputs,
                              None, activation="silu")
    assert torch.equal(actual, expected)


def test_conv_twin_matches_vllm_cpu_conv():
    """The CPU path's conv (the torch twin) vs vLLM's CPU `causal_conv1d_update` for one token per request."""
    from vllm.model_executor.layers.mamba.ops.cpu.causal_conv1d import causal_conv1d_update_cpu

    requests, channels, width = 8, 512, 4
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(requests, channels, generator=gen).bfloat16()
    weight = (0.3 * torch.randn(channels, width, generator=gen)).bfloat16()
    history = torch.randn(requests + 1, width - 1, channels, generator=gen).bfloat16().transpose(1, 2)
    slots = torch.arange(1, requests + 1, dtype=torch.int32)
    try:
        expected = causal_conv1d_update_cpu(x.clone(), history.clone(), weight, None, "silu", conv_state_indices=slots)
    except RuntimeError as error:  # the op has kernels for some CPUs only (AVX-512 here)
        pytest.skip(f"vLLM's CPU conv does not run here: {error}")
    actual = conv_step_packed(x, history.clone(), slots, weight, None, torch.full((requests,), -1, dtype=torch.int32),
                              torch.arange(requests + 1, dtype=torch.int32),
                              torch.zeros(requests + 1, 1, channels, dtype=torch.bfloat16), None, activation="silu")
    assert torch.equal(actual, expected)
