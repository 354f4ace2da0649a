"""The per-node serial baseline for draft trees (what SGLang does), a benchmark yardstick only: each node's state is
computed from its parent's state by one gated delta rule step and written to that node's own scratch slot, so the
tree costs one state write per node. The fair kernel to hold the fused tree step against (`bench/kernels/gated_bench.py`);
its torch twin is `vllm_treewy.kernels.serial_tree`, the fp64 ground truth `vllm_treewy.kernels.reference`
(`tests/bench_scripts/test_serial_baseline.py`).

Inputs are what the layer holds at that point: q, k (normalised, q scaled), v in bf16; g, beta fp32.
"""

import torch
import triton
import triton.language as tl

from vllm_treewy.tree import DraftTree, pack_trees


@triton.jit
def _serial_tree_kernel(
    q, k, v, g, beta, state, state_indices, parents, cu_nodes, o, node_states,
    stride_slot, stride_head, stride_v,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr,
):
    i_v, i_hv, i_b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_h = i_hv // (HV // H)
    slot = tl.load(state_indices + i_b).to(tl.int64)
    if slot < 0:
        return
    bos = tl.load(cu_nodes + i_b)
    n = tl.load(cu_nodes + i_b + 1) - bos
    o_k = tl.arange(0, K)
    o_v = i_v * BV + tl.arange(0, BV)
    tile = o_v[:, None] * K + o_k[None, :]
    p_h0 = state + slot * stride_slot + i_hv * stride_head + o_v[:, None] * stride_v + o_k[None, :]
    for i in range(n):
        node = (bos + i).to(tl.int64)
        parent = tl.load(parents + node)
        if parent < 0:
            h = tl.load(p_h0).to(tl.float32)
        else:
            h = tl.load(node_states + ((bos + parent).to(tl.int64) * HV + i_hv) * V * K + tile).to(tl.float32)
        b_q = tl.load(q + (node * H + i_h) * K + o_k).to(tl.float32)
        b_k = tl.load(k + (node * H + i_h) * K + o_k).to(tl.float32)
        b_v = tl.load(v + (node * HV + i_hv) * V + o_v).to(tl.float32)
        b_g = tl.load(g + node * HV + i_hv).to(tl.float32)
        b_beta = tl.load(beta + node * HV + i_hv).to(tl.float32)
        h *= tl.exp(b_g)
        b_u = b_beta * (b_v - tl.sum(h * b_k[None, :], 1))
        h += b_u[:, None] * b_k[None, :]
        tl.store(o + (node * HV + i_hv) * V + o_v, tl.sum(h * b_q[None, :], 1).to(o.dtype.element_ty))
        tl.store(node_states + (node * HV + i_hv) * V * K + tile, h.to(node_states.dtype.element_ty))
        # the next node may read this state back (same tile, same program)
        tl.debug_barrier()


def serial_tree_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    state_indices: torch.Tensor,
    parents: torch.Tensor,
    cu_nodes: torch.Tensor,
    *,
    node_states: torch.Tensor | None = None,
    o: torch.Tensor | None = None,
    block_v: int = 32,
    num_warps: int = 4,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k [N, H, K]; v [N, HV, V]; g, beta [N, HV]; state pool [S, HV, V, K]; state_indices [B]; parents [N]
    local, cu_nodes [B+1]. Returns o [N, HV, V] and every node's state [N, HV, V, K] in the state's dtype
    (committing node a is then a copy of node_states[a])."""
    n_nodes, H, K = k.shape
    HV, V = v.shape[1], v.shape[2]
    assert state.stride(-1) == 1 and V % block_v == 0
    o = torch.empty_like(v) if o is None else o
    if node_states is None:
        node_states = torch.empty(n_nodes, HV, V, K, dtype=state.dtype, device=state.device)
    _serial_tree_kernel[(V // block_v, HV, state_indices.shape[0])](
        q, k, v, g, beta, state, state_indices, parents, cu_nodes, o, node_states,
        state.stride(0), state.stride(1), state.stride(2),
        H=H, HV=HV, K=K, V=V, BV=block_v, num_warps=num_warps,
    )
    return o, node_states


def serial_per_node_us(widths, batch: int, state_dtype: torch.dtype, heads=(16, 32), dims=(128, 128)) -> float:
    """The serial baseline's time (us, `timing.graph_time_us`) on `batch` copies of the tree `widths` with its root
    node (vLLM verifies root + N), Qwen3.5 GDN heads and dims by default."""
    from bench.kernels.timing import graph_time_us

    (H, HV), (K, V) = heads, dims
    packed = pack_trees([DraftTree.from_widths(list(widths)).with_root()] * batch, device="cuda")
    n = packed.num_nodes
    q = torch.nn.functional.normalize(torch.randn(n, H, K, device="cuda"), dim=-1).mul_(K**-0.5).bfloat16()
    k = torch.nn.functional.normalize(torch.randn(n, H, K, device="cuda"), dim=-1).bfloat16()
    v = torch.randn(n, HV, V, device="cuda").bfloat16()
    g, beta = -torch.rand(n, HV, device="cuda"), torch.rand(n, HV, device="cuda")
    pool = torch.randn(1 + batch, HV, V, K, device="cuda").mul_(0.05).to(state_dtype)
    slots = 1 + torch.arange(batch, device="cuda", dtype=torch.int32)  # slot 0: vLLM's null block
    node_states = torch.empty(n, HV, V, K, dtype=state_dtype, device="cuda")
    o = torch.empty_like(v)
    return graph_time_us([lambda: serial_tree_triton(q, k, v, g, beta, pool, slots, packed.parents, packed.cu_nodes,
                                                     node_states=node_states, o=o)], min_calls=8)
