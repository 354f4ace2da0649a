"""Fused verify of packed draft chains/trees: one program per (value tile, value head, request) reads its tile of
the committed state h0 once, builds G and R, solves (I+G)U = R, and writes the outputs O and pseudo-values U.
It never writes a state, except with `pending`: then it first applies the previous step's commit to its tile
(one read, one write) and verifies on top of the rebuilt state, so a step costs one state read and one write.

Torch twin: `vllm_treewy.kernels.closed_form.verify_packed` (same packed API); ground truth:
`vllm_treewy.kernels.reference`.
"""

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ._tree import ancestor_table, ancestry, path_factors, rebuild_chunk

SOLVES = ("neumann", "substitution")
PRECISIONS = ("ieee", "tf32x3", "tf32")


@dataclass
class PendingCommit:
    """The previous step's factors and accepted nodes, committed inside the next verify (see module doc).
    Same meaning as `commit_packed_triton`'s arguments; `accepted[b] = -1` leaves request b's slot as it is."""

    k: torch.Tensor
    u: torch.Tensor
    g: torch.Tensor
    parents: torch.Tensor
    cu_nodes: torch.Tensor
    accepted: torch.Tensor
    max_nodes: int
    max_depth: int | None = None
    chain: bool = False
    ancestors: torch.Tensor | None = None


@triton.jit
def _verify_kernel(
    q, k, v, g, beta, state, state_indices, ancestors, cu_nodes, o, u,
    p_k, p_u, p_g, p_ancestors, p_cu_nodes, p_accepted,
    stride_slot, stride_head, stride_v,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BV: tl.constexpr, BK: tl.constexpr, MAX_ANC: tl.constexpr, IS_CHAIN: tl.constexpr,
    SOLVE: tl.constexpr, PRECISION: tl.constexpr, LOWP_DOTS: tl.constexpr,
    HAS_PENDING: tl.constexpr, P_BP: tl.constexpr, P_MAX_ANC: tl.constexpr, P_IS_CHAIN: tl.constexpr,
):
    i_v, i_hv, i_b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_h = i_hv // (HV // H)
    slot = tl.load(state_indices + i_b).to(tl.int64)
    if slot < 0:
        return
    bos = tl.load(cu_nodes + i_b)
    n = tl.load(cu_nodes + i_b + 1) - bos

    rows = tl.arange(0, BT)
    valid = rows < n
    o_v = i_v * BV + tl.arange(0, BV)
    p_state = state + slot * stride_slot + i_hv * stride_head + o_v[:, None] * stride_v
    qk_rows = ((bos + rows) * H + i_h) * K
    # everything that does not depend on h0 is issued first, so its latency hides under the state reads
    v_offs = ((bos + rows) * HV + i_hv)[:, None] * V + o_v[None, :]
    b_v = tl.load(v + v_offs, mask=valid[:, None], other=0.0).to(tl.float32)
    b_beta = tl.load(beta + (bos + rows) * HV + i_hv, mask=valid, other=0.0).to(tl.float32)
    decay, b_c = ancestry(ancestors, g, bos, n, i_hv, HV, BT, MAX_ANC, IS_CHAIN)
    if HAS_PENDING:
        accepted = tl.load(p_accepted + i_b)
        p_bos = tl.load(p_cu_nodes + i_b)
        p_rows, p_on_path, p_wu, p_root = path_factors(p_k, p_u, p_g, p_ancestors, p_bos, accepted, i_h, i_hv, o_v,
                                                       H, HV, K, V, P_BP, P_MAX_ANC, P_IS_CHAIN)
        store_commit = (o_v[:, None] * 0 + accepted) >= 0  # as a tile: a scalar mask does not broadcast everywhere

    # h0 k_i, h0 q_i as [BT, BV] rows, k_i.k_j and q_i.k_j, accumulated over key-dim chunks (h0 read once). A
    # 16-bit state with keys of the same dtype multiplies exactly into fp32 accumulators.
    hk = tl.zeros([BT, BV], dtype=tl.float32)
    hq = tl.zeros([BT, BV], dtype=tl.float32)
    kk = tl.zeros([BT, BT], dtype=tl.float32)
    qk = tl.zeros([BT, BT], dtype=tl.float32)
    for i_k in tl.static_range(K // BK):
        o_k = i_k * BK + tl.arange(0, BK)
        h0 = tl.load(p_state + o_k[None, :])
        if HAS_PENDING:
            # branch-free (keeps the chunk loop one basic block); nothing accepted rebuilds h0 itself, unstored
            h0 = rebuild_chunk(h0.to(tl.float32), p_k, p_rows, p_on_path, p_wu, p_root, o_k,
                               PRECISION).to(state.dtype.element_ty)
            tl.store(p_state + o_k[None, :], h0, mask=store_commit)
        b_q = tl.load(q + qk_rows[:, None] + o_k[None, :], mask=valid[:, None], other=0.0)
        b_k = tl.load(k + qk_rows[:, None] + o_k[None, :], mask=valid[:, None], other=0.0)
        if LOWP_DOTS:
            h0t = tl.trans(h0)
            hk = tl.dot(b_k, h0t, hk)
            hq = tl.dot(b_q, h0t, hq)
            kk = tl.dot(b_k, tl.trans(b_k), kk)
            qk = tl.dot(b_q, tl.trans(b_k), qk)
        else:
            h0t = tl.trans(h0.to(tl.float32))
            b_k = b_k.to(tl.float32)
            b_q = b_q.to(tl.float32)
            hk = tl.dot(b_k, h0t, hk, input_precision=PRECISION)
            hq = tl.dot(b_q, h0t, hq, input_precision=PRECISION)
            kk = tl.dot(b_k, tl.trans(b_k), kk, input_precision=PRECISION)
            qk = tl.dot(b_q, tl.trans(b_k), qk, input_precision=PRECISION)

    exp_c = tl.exp(b_c)
    r = b_beta[:, None] * (b_v - exp_c[:, None] * hk)
    gmat = tl.where(rows[None, :] != rows[:, None], b_beta[:, None] * decay * kk, 0.0)
    pmat = decay * qk
    b_u = r
    if SOLVE == "neumann":
        # G is nilpotent (G^max_depth = 0): U = sum_{m <= MAX_ANC} (-G)^m R, in Horner form
        for _ in tl.static_range(MAX_ANC):
            b_u = r - tl.dot(gmat, b_u, input_precision=PRECISION)
    else:
        # forward substitution: rows above i are final when row i is solved
        for i in range(1, n):
            g_row = tl.sum(tl.where(rows[:, None] == i, gmat, 0.0), 0)
            b_u = tl.where(rows[:, None] == i, b_u - tl.sum(g_row[:, None] * b_u, 0)[None, :], b_u)

    b_o = exp_c[:, None] * hq + tl.dot(pmat, b_u, input_precision=PRECISION)
    tl.store(o + v_offs, b_o.to(o.dtype.element_ty), mask=valid[:, None])
    tl.store(u + v_offs, b_u.to(u.dtype.element_ty), mask=valid[:, None])


# (block_v, block_k, num_warps, max_registers) measured fastest on the H200 at H=16, HV=32, K=V=128, B=64
# (bench/launch_sweep.py, bench/kernels.py --tune; bench/results/), keyed by (kind, fp32 state); "large": trees of
# more than 64 nodes.
# max_registers (ptxas .maxnreg; None: the compiler's choice) buys a fourth resident program per SM for a few spills.
VERIFY_CONFIGS = {
    ("chain", False): (128, 128, 4, 128), ("chain", True): (64, 64, 4, None),
    ("fused", False): (64, 128, 4, 128), ("fused", True): (64, 64, 4, None),
    ("tree", False): (64, 64, 4, 128), ("tree", True): (32, 32, 4, None),
    ("large", False): (32, 32, 8, None), ("large", True): (32, 32, 8, None),
}
# Few requests leave most SMs idle with the wide tiles: narrower value tiles, as (up to this batch, configuration).
# Narrow tiles measured faster at B=1 and slower at B=8 (bench/results/2026-11-29/sweep_small_batch.log); they
# serve up to the geometric midpoint of the two.
SMALL_BATCH_VERIFY_CONFIGS = {
    ("chain", False): (2, (32, 128, 4, None)),
    ("fused", False): (2, (32, 128, 4, None)),
}


def measured_config(configs, small_batch_configs, key, batch: int):
    """The launch configuration measured for `key` at this batch size (a static shape: no sync)."""
    max_batch, config = small_batch_configs.get(key, (0, None))
    return config if batch <= max_batch else configs[key]


def launch_config(measured, V, K, block_v, block_k, num_warps, max_registers):
    """Explicit arguments win; otherwise the measured configuration, clipped to the head dims. Returns the tile
    sizes and the launch options."""
    options = dict(num_warps=num_warps or measured[2], num_stages=1)
    max_registers = max_registers or measured[3]
    if max_registers and not interpreting():
        options["maxnreg"] = max_registers
    return block_v or min(measured[0], V), block_k or min(measured[1], K), options


def interpreting() -> bool:
    return bool(triton.knobs.runtime.interpret)


def block_nodes(max_nodes: int) -> int:
    """Padded node-block size; tl.dot needs every dimension >= 16."""
    return max(16, triton.next_power_of_2(max_nodes))


def max_ancestors(max_nodes: int, max_depth: int | None, chain: bool) -> int:
    """Strict ancestors of the deepest node; max_depth counts the nodes of a root-to-node path (vllm_treewy.tree)."""
    return max_nodes - 1 if chain or max_depth is None else max_depth - 1


def tree_ancestors(parents, cu_nodes, max_anc: int, chain: bool, ancestors: torch.Tensor | None) -> torch.Tensor:
    """The kernels' ancestry argument: unused (parents) for chains, else the given or a freshly built table."""
    if chain:
        return parents
    if ancestors is None:
        return ancestor_table(parents, cu_nodes, max_anc + 1)
    assert ancestors.shape == (parents.numel(), max_anc + 1) and ancestors.is_contiguous()
    return ancestors


def default_precision(state_dtype: torch.dtype) -> str:
    """ieee fp32 dots for fp32 states; tf32 (10-bit mantissa) is far below a 16-bit state's rounding."""
    return "ieee" if state_dtype == torch.float32 else "tf32"


def verify_packed_triton(
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
    max_nodes: int,
    max_depth: int | None = None,
    chain: bool = False,
    solve: str = "neumann",
    precision: str | None = None,
    block_v: int | None = None,
    block_k: int | None = None,
    num_warps: int | None = None,
    max_registers: int | None = None,
    pending: PendingCommit | None = None,
    ancestors: torch.Tensor | None = None,
    o: torch.Tensor | None = None,
    u: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Outputs o [N, HV, V] (v's dtype) and pseudo-values u [N, HV, V] (fp32) of B packed chains or trees.

    q, k [N, H, K]; v [N, HV, V]; g, beta [N, HV]; state pool [S, HV, V, K] (last dim contiguous), only read
    unless `pending`; state_indices [B] (negative: padding request, its rows are not written); parents [N] local
    (-1: child of the committed state); cu_nodes [B+1]. Compile-time bounds: max_nodes per request and max_depth
    (nodes on a root-to-node path, `vllm_treewy.tree`; default max_nodes); `chain=True` ignores parents.
    `ancestors`: the tree's `ancestor_table(parents, cu_nodes, max_depth)`, built here when not given (pass it to
    share one table across layers). Launch configuration (block_v, block_k, num_warps, max_registers): measured
    defaults for this batch size.
    No host sync, no data-dependent shapes: capturable in a CUDA graph."""
    n_nodes, H, K = k.shape
    HV, V = v.shape[1], v.shape[2]
    kind = "fused" if pending is not None and chain else "chain" if chain else "tree" if max_nodes <= 64 else "large"
    measured = measured_config(VERIFY_CONFIGS, SMALL_BATCH_VERIFY_CONFIGS, (kind, state.dtype == torch.float32),
                               state_indices.shape[0])
    block_v, block_k, options = launch_config(measured, V, K, block_v, block_k, num_warps, max_registers)
    assert HV % H == 0 and K == triton.next_power_of_2(K) and V % block_v == 0 and K % block_k == 0
    assert state.stride(-1) == 1 and solve in SOLVES
    precision = precision or default_precision(state.dtype)
    assert precision in PRECISIONS
    o = torch.empty_like(v) if o is None else o
    u = torch.empty(v.shape, dtype=torch.float32, device=v.device) if u is None else u
    # the interpreter multiplies 16-bit floats as raw integers: upcast there
    lowp = state.dtype in (torch.bfloat16, torch.float16) and k.dtype == q.dtype == state.dtype and not interpreting()
    max_anc = max_ancestors(max_nodes, max_depth, chain)
    ancestors = tree_ancestors(parents, cu_nodes, max_anc, chain, ancestors)
    if pending is None:
        p_args, p_bp, p_anc, p_chain = (k, u, g, ancestors, cu_nodes, state_indices), 16, 0, True
    else:
        p = pending
        p_anc, p_chain = max_ancestors(p.max_nodes, p.max_depth, p.chain), p.chain
        p_args = (p.k, p.u, p.g, tree_ancestors(p.parents, p.cu_nodes, p_anc, p_chain, p.ancestors), p.cu_nodes,
                  p.accepted)
        p_bp = block_nodes(p_anc + 1)
    _verify_kernel[(V // block_v, HV, state_indices.shape[0])](
        q, k, v, g, beta, state, state_indices, ancestors, cu_nodes, o, u, *p_args,
        state.stride(0), state.stride(1), state.stride(2),
        H=H, HV=HV, K=K, V=V, BT=block_nodes(max_nodes), BV=block_v, BK=block_k,
        MAX_ANC=max_anc, IS_CHAIN=chain,
        SOLVE=solve, PRECISION=precision, LOWP_DOTS=lowp,
        HAS_PENDING=pending is not None, P_BP=p_bp, P_MAX_ANC=p_anc, P_IS_CHAIN=p_chain,
        **options,
    )
    return o, u
