"""How many JIT variants reconstruct's two kernels compile in one engine: Triton compiles one per specialisation
key (argument dtypes, pointer alignment to 16 bytes, ints == 1 or divisible by 16, constexprs, launch options).
Here the launch arguments are built exactly as `gdn_step_triton` / `conv_step_triton` build them, from the views
vLLM's Qwen3.5 GDN layer hands over at every batch size it captures (FULL CUDA graphs: slices of persistent
buffers; mixed prefill batches: `index_select` copies), and bound with Triton's own binder; nothing is compiled.
Expected: one key per kernel, speculative length and launch configuration (the grid carries the batch, the integer
arguments are strides of model-shaped views; `step_launch` changes the launch with the batch at most twice, at 4
and 8 requests)."""

import pytest
import torch
from triton.backends.compiler import BaseBackend
from triton.runtime.jit import JITFunction, create_function_from_signature

from vllm_treewy.kernels.factor_rows import slot_factor_width
from vllm_treewy.kernels import conv_step_triton as conv_module
from vllm_treewy.kernels.gdn_step_triton import step as gdn_step_module

H, HV, K, V, WIDTH = 16, 32, 128, 128, 4  # Qwen3.5 GDN layer
QKV = 2 * H * K + HV * V
SLOTS = 4
BATCHES = (1, 2, 3, 4, 5, 8, 16, 31, 64, 100, 256)


def specialization_key(kernel, args, kwargs):
    """The part of Triton's cache key that the arguments decide."""
    jit = kernel if isinstance(kernel, JITFunction) else JITFunction(kernel.fn, **kernel.kwargs)
    binder = create_function_from_signature(jit.signature, jit.params, BaseBackend)
    _, specialization, options = binder(*args, **kwargs)
    return str(specialization), str(sorted(options.items()))


def launch_keys(launches):
    """The keys of `step_launches`' launches (the state pass and the epilogue), in order."""
    return tuple((kernel.fn.__name__, *specialization_key(kernel, args, kwargs))
                 for kernel, _, args, kwargs in launches)


def step_views(batch, tokens, mixed, state, factors, conv_state, conv_inputs, persistent):
    """The arguments of reconstruct.step_triton's two launches for `batch` speculating requests of `tokens` tokens:
    vLLM's in_proj outputs split into views (FULL graphs), or the speculative rows gathered out of a mixed batch."""
    n = batch * tokens
    mixed_qkvz = torch.empty(n + 3 * mixed, QKV + HV * V, dtype=torch.bfloat16)
    ba = torch.empty(n + 3 * mixed, 2 * HV, dtype=torch.bfloat16)
    mixed_qkv, gate_flat = mixed_qkvz.split([QKV, HV * V], dim=-1)
    output_gate = gate_flat.reshape(gate_flat.size(0), -1, V)
    b, a = ba.chunk(2, dim=-1)
    out = torch.zeros(n + 3 * mixed, HV, V, dtype=torch.bfloat16)
    if mixed:  # gdn_layer._forward_core_fused_norm: the speculative tokens after 3 prefill tokens
        spec = torch.arange(3, 3 + n)
        mixed_qkv, a, b, output_gate = (x.index_select(0, spec) for x in (mixed_qkv, a, b, output_gate))
        out = out.new_zeros((n, HV, V))
        slots = torch.arange(batch, dtype=torch.int32).remainder(SLOTS).contiguous()
        cu_nodes = torch.arange(0, n + 1, tokens, dtype=torch.int32)
        commit_nodes = torch.full((batch,), tokens - 1, dtype=torch.int32)
    else:
        mixed_qkv, a, b, output_gate, out = mixed_qkv[:n], a[:n], b[:n], output_gate[:n], out[:n]
        slots, cu_nodes, commit_nodes = (persistent[name][: batch + (name == "cu_nodes")]
                                         for name in ("slots", "cu_nodes", "commit_nodes"))
    parents = None  # chains: the adapter passes no parents (`gdn.reconstruct.step_triton`)
    weight = torch.empty(QKV, WIDTH, dtype=torch.bfloat16)
    bias = None
    conv = conv_module._conv_launch_arguments(
        mixed_qkv, conv_state, slots, weight, bias, parents, cu_nodes, conv_inputs, commit_nodes,
        commit_ancestors=None, activation="silu", out=None, block_nodes=16, block_d=256)
    conv_out = conv[3]
    A_log, dt_bias = torch.empty(HV), torch.empty(HV, dtype=torch.bfloat16)
    norm_weight = torch.empty(V, dtype=torch.bfloat16)
    gated = gdn_step_module.step_launches(
        conv_out, a, b, A_log, dt_bias, output_gate, norm_weight, state, slots, cu_nodes, factors,
        commit_nodes, None, num_key_heads=H, max_nodes=tokens, scale=K**-0.5, norm_eps=1e-6, activation="silu",
        ancestors=None, out=out, launch=None)
    return conv, gated


@pytest.mark.parametrize("tokens", [2, 4, 8])
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_one_variant_per_kernel_across_batch_sizes(tokens, state_dtype):
    state = torch.empty(SLOTS, HV, V, K, dtype=state_dtype)
    pages = torch.empty(SLOTS, tokens + 1, slot_factor_width(HV, K, V) + 8)  # the buffer's views into KV pages
    factors = pages[:, :tokens, : slot_factor_width(HV, K, V)]
    # vLLM's conv state [S, D, W - 1 + tokens - 1]; reconstruct reads its first W - 1 columns
    conv_state = torch.empty(SLOTS, QKV, WIDTH - 1 + tokens - 1, dtype=torch.bfloat16)[:, :, : WIDTH - 1]
    conv_inputs = torch.empty(SLOTS, tokens, QKV, dtype=torch.bfloat16)
    persistent = dict(slots=torch.zeros(max(BATCHES), dtype=torch.int32),
                      cu_nodes=torch.arange(0, (max(BATCHES) + 1) * tokens, tokens, dtype=torch.int32),
                      commit_nodes=torch.full((max(BATCHES),), -1, dtype=torch.int32))
    keys = {"conv": set(), "gated": set()}
    for batch in BATCHES:
        for mixed in (False, True):
            conv, gated = step_views(batch, tokens, mixed, state, factors, conv_state, conv_inputs, persistent)
            keys["conv"].add(specialization_key(conv_module._conv_step_kernel, *conv[1:3]))
            keys["gated"].add(launch_keys(gated[0]))
    launches = {gdn_step_module.step_launch(state_dtype, batch, tokens) for batch in BATCHES}
    assert len(keys["conv"]) == 1 and len(keys["gated"]) == len(launches), keys


def test_index_arrays_carry_no_alignment_key():
    """An integer array at an odd offset (a slice of a larger index buffer) binds to the same key."""
    tokens, batch = 4, 8
    state = torch.empty(SLOTS, HV, V, K)
    factors = torch.empty(SLOTS, tokens, slot_factor_width(HV, K, V))
    conv_state = torch.empty(SLOTS, QKV, WIDTH - 1, dtype=torch.bfloat16)
    conv_inputs = torch.empty(SLOTS, tokens, QKV, dtype=torch.bfloat16)
    found = []
    for offset in (0, 1):
        persistent = dict(slots=torch.zeros(batch + offset, dtype=torch.int32)[offset:],
                          cu_nodes=torch.arange(-offset, batch + 1, dtype=torch.int32)[offset:] * tokens,
                          commit_nodes=torch.full((batch + offset,), -1, dtype=torch.int32)[offset:])
        conv, gated = step_views(batch, tokens, False, state, factors, conv_state, conv_inputs, persistent)
        found.append((specialization_key(conv_module._conv_step_kernel, *conv[1:3]), launch_keys(gated[0])))
    assert found[0] == found[1]
