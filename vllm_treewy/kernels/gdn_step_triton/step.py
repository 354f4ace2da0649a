"""The GDN layer's speculative decode step after the conv, on packed draft chains and trees: the previous step's
commit, gates, q/k L2 norm, the closed-form verify, and the gated RMSNorm with the output gate. It takes the same
inputs and gives the same output as vLLM's compiled store_all kernel `fused_gdn_decode_post_conv_mtp`, plus the
commit's factors in the slots' rows (`vllm_treewy.kernels.factor_rows`).

    g_i    = -exp(A_log) * softplus(a_i + dt_bias)            beta_i = sigmoid(b_i)
    q_i    = scale * q_i / sqrt(|q_i|^2 + 1e-6)              k_i    = k_i / sqrt(|k_i|^2 + 1e-6)
    h0     = the slot's state after its commit node a:  exp(c_a) h + sum_{j on path(a)} exp(c_a - c_j) u_j k_j^T
    (o_i, u_i) = closed-form tree verify from h0 (`vllm_treewy.kernels.closed_form`'s equations)
    o_i    <- o_i rounded to the output dtype (bf16 in vLLM), as vLLM's decode and compiled MTP kernel do
    out_i  = o_i * rsqrt(mean_v(o_i^2) + eps) * norm_weight * act(z_i)      act = silu or sigmoid

Two launches. The state pass (`state_pass`): per request and value head, the commit in place and the committed
state's products with this step's raw q/k rows, a head's value rows over several programs. Then, as its
programmatic dependent on Hopper, the epilogue: everything per node, from the products. Chains and trees of up to
8 nodes take the request epilogue (`request_epilogue`: a request's nodes in one program, by forward
substitution); larger trees the path epilogue (`path_epilogue`: each node solved from its own path, a request's
nodes over several programs). How each launch is tiled is a `StepLaunch`, chosen by `LAUNCH_TABLE`.

The adapter's call, where vLLM would call `fused_gdn_decode_post_conv_mtp` after the conv:

    out = gdn_step_triton(mixed_qkv, a, b, A_log, dt_bias, output_gate, norm_weight, state, state_indices,
                          cu_nodes, factors=slot_factors, commit_nodes=commit_nodes,
                          commit_ancestors=commit_table, num_key_heads=H, max_nodes=T, ancestors=tree_table,
                          scale=K**-0.5, norm_eps=eps, activation="silu", out=core_attn_out)

(``tree_table`` and ``commit_table`` None for chains: the ancestor tables are the one chain-or-tree signal.)

The end of a sequence (or a test) commits alone: `gdn_commit_triton`. Torch twin:
`vllm_treewy.kernels.gdn_step_torch` (`gdn_step_packed`, `gdn_commit_packed`); fp64 ground truth:
`vllm_treewy.kernels.reference.reference_gated_tree`.
"""

import dataclasses
import math

import torch
import triton

from ..factor_rows import slot_factor_width
from . import path_epilogue, request_epilogue, state_pass

ACTIVATIONS = ("silu", "sigmoid")
# the request epilogue's static per-node loops unroll BT x BT pairs: up to this many nodes
REQUEST_EPILOGUE_NODES = 8

__all__ = ["LAUNCH_TABLE", "StepLaunch", "gdn_commit_triton", "gdn_step_triton", "step_launch", "step_launches"]


@dataclasses.dataclass(frozen=True)
class StepLaunch:
    """How the step's two launches are tiled. The state pass: `state_rows` value rows of a head a program, key
    chunks of `state_block_k` columns, `state_warps` warps (tiles are at least 16 wide: a tensor-core dot's least
    size, masked to heads narrower than that). The epilogue: `epilogue_warps` warps a program; `path_nodes` 0 for
    the request epilogue (at most `REQUEST_EPILOGUE_NODES` nodes), else the path epilogue with that many nodes a
    program (a power of two)."""

    state_rows: int
    state_block_k: int
    state_warps: int
    epilogue_warps: int
    path_nodes: int = 0


ROWS_16 = StepLaunch(state_rows=16, state_block_k=128, state_warps=2, epilogue_warps=1)
ROWS_32 = StepLaunch(state_rows=32, state_block_k=128, state_warps=1, epilogue_warps=1)
ROWS_64 = StepLaunch(state_rows=64, state_block_k=64, state_warps=4, epilogue_warps=1)
TREE_ROWS_16 = StepLaunch(state_rows=16, state_block_k=128, state_warps=2, epilogue_warps=4, path_nodes=8)
TREE_ROWS_64 = StepLaunch(state_rows=64, state_block_k=64, state_warps=4, epilogue_warps=2, path_nodes=4)

# (state dtype, requests, nodes per request) -> launch; for every step exactly one row holds. Each row is the fastest
# launch measured at Qwen3.5 GDN dims (H=16, HV=32, K=V=128, bf16 q/k/v), chains at T = 2, 4, 8 and B = 1, 8, 64, trees
# [2,2,1] / [4,2,2] at B = 1, 64, 256; the sizes between were not all run and go with their neighbours. Chain rows
# measured on an NVIDIA H200 by `python3 bench/kernels/gated_bench.py --name final --tune-tokens 4 8 2 --tune-batches 64
# 8 1 --tokens 4 2 8 --batches 1 2 4 8 64 256 --short-batches 1 8 64 256 --separate-batches 1 64`, results in
# bench/results/kernels/tuning/chains.json; tree rows measured on an NVIDIA H200 by `python3
# bench/kernels/gated_bench.py --name trees_final --states bf16 fp32 --tune-tokens --tokens --trees --gated-trees 4,2,2
# 2,2,1 --gated-tree-batches 64 1 256`, results in bench/results/kernels/tuning/trees.json (both commands of the bench
# as it was then; its tuning options are gone). The table as it runs now, against vLLM's compiled kernel: measured on an
# NVIDIA H200 by `python3 bench/kernels/gated_bench.py --name gated --no-fallback --separate-batches`, results in
# bench/results/kernels/step_vs_compiled.json. The 16-bit row above 8 requests at 3-4 nodes (32 rows, 1 warp)
# measured on an NVIDIA H100 by `python3 -m bench.kernels.gated_bench --name bf16_candidates2 --states bf16 --tokens 4
# --batches 8 64 256 --separate-batches --trees --no-fallback --candidates ...`, results in
# bench/results/kernels/tuning/bf16_rows.json. Which row came from which run: bench/results/kernels/README.md, "Launch
# table".
LAUNCH_TABLE = (
    # states    requests        nodes           launch
    ("any", (0, 4), (0, 8), ROWS_16),
    ("any", (0, 4), (9, math.inf), TREE_ROWS_16),
    ("any", (5, math.inf), (9, math.inf), TREE_ROWS_64),
    ("any", (5, math.inf), (5, 8), ROWS_16),
    ("fp32", (5, 8), (0, 4), ROWS_64),
    ("fp32", (9, math.inf), (0, 2), ROWS_16),
    ("fp32", (9, math.inf), (3, 4), ROWS_64),
    ("16-bit", (5, math.inf), (0, 2), ROWS_16),
    ("16-bit", (5, 8), (3, 4), ROWS_64),
    ("16-bit", (9, math.inf), (3, 4), ROWS_32),
)


def step_launch(state_dtype: torch.dtype, batch: int, max_nodes: int) -> StepLaunch:
    """`LAUNCH_TABLE`'s launch for a state dtype ("fp32", else "16-bit"), a batch of requests (a CUDA graph's padded
    batch is static, so each captured size keeps its own launch) and the nodes per request (a static shape)."""
    states = "fp32" if state_dtype == torch.float32 else "16-bit"
    for row_states, (b_lo, b_hi), (n_lo, n_hi), launch in LAUNCH_TABLE:
        if row_states in ("any", states) and b_lo <= batch <= b_hi and n_lo <= max_nodes <= n_hi:
            return launch
    raise ValueError(f"no launch for a {state_dtype} state, {batch} requests of {max_nodes} nodes")


# bf16 and fp16 values are exact in tf32 (at most 11 significant bits, exponents within tf32's range)
EXACT_IN_TF32 = (torch.bfloat16, torch.float16)


def state_products_mode(state_dtype: torch.dtype, qkv_dtype: torch.dtype) -> str:
    """How the state pass's tensor-core products reach fp32 accuracy (`state_pass._state_products`): one exact
    bf16 pass for a bf16 state with bf16 q/k, one exact tf32 pass where both are exact in tf32; an fp32 state in
    three bf16 pieces against bf16 q/k, two tf32 pieces against fp16 q/k; tf32x3 for fp32 q/k."""
    if qkv_dtype in EXACT_IN_TF32:
        if state_dtype == torch.bfloat16 and qkv_dtype == torch.bfloat16:
            return "bf16"
        if state_dtype in EXACT_IN_TF32:
            return "tf32"
        return "3xbf16" if qkv_dtype == torch.bfloat16 else "2xtf32"
    return "tf32x3"


def interpreting() -> bool:
    return bool(triton.knobs.runtime.interpret)


def max_ancestors(max_nodes: int, ancestors: torch.Tensor | None) -> int:
    """Strict ancestors of the deepest node: a chain's max_nodes - 1; a tree's table holds each node's path, the
    node first (D columns: the most nodes on a root-to-node path, vllm_treewy.tree's max_depth), so D - 1."""
    return max_nodes - 1 if ancestors is None else ancestors.shape[1] - 1


def tree_ancestors(cu_nodes, ancestors: torch.Tensor | None) -> torch.Tensor:
    """The epilogues' ancestry argument: the table for trees; for chains (None) any pointer, never read (cu_nodes)."""
    if ancestors is None:
        return cu_nodes
    assert ancestors.dim() == 2 and ancestors.is_contiguous()
    return ancestors


def _check_factors(factors, state, state_indices, commit_nodes, commit_ancestors):
    S, HV, V, K = state.shape
    assert factors.dtype == torch.float32 and factors.dim() == 3 and factors.stride(2) == 1
    assert factors.shape[0] >= S and factors.shape[2] == slot_factor_width(HV, K, V)
    assert commit_nodes is None or (commit_nodes.shape == state_indices.shape and
                                    commit_nodes.dtype == torch.int32 and commit_nodes.stride(0) == 1)
    assert commit_ancestors is None or (commit_ancestors.dim() == 2 and commit_ancestors.is_contiguous() and
                                        commit_ancestors.dtype == torch.int32), \
        "commit_ancestors: int32 [T, P] contiguous, row a the path of commit node a in the slot's factor rows"
    assert state_indices.stride(0) == 1, "the kernels index state_indices flat (a strided column would be misread)"


def step_launches(mixed_qkv, a, b, A_log, dt_bias, output_gate, norm_weight, state, state_indices, cu_nodes, factors,
                  commit_nodes, commit_ancestors, *, num_key_heads, max_nodes, scale, norm_eps, activation,
                  ancestors, out, launch):
    """([(kernel, grid, positional arguments, keyword arguments)] in launch order, out): checks done, the launch
    resolved (None: `step_launch`'s), nothing launched. `mixed_qkv` None: the commit alone (the state pass without
    products; the other verify arguments unused). Allocates the products workspace [B, HV, 2 BT, V] fp32 (BT the
    node count padded to a power of two, at least 2; 8 MiB at B=64, T=4; 256 MiB at B=256 with 29-node trees)
    and `out` if None; under CUDA-graph capture both come from the graph's pool."""
    do_verify = mixed_qkv is not None
    S, HV, V, K = state.shape
    H = num_key_heads
    assert HV % H == 0 and state.stride(-1) == 1 and K == triton.next_power_of_2(K)
    assert V == triton.next_power_of_2(V) and activation in ACTIVATIONS
    _check_factors(factors, state, state_indices, commit_nodes, commit_ancestors)
    batch = state_indices.shape[0]
    launch = launch or step_launch(state.dtype, batch, max_nodes)
    path_nodes = launch.path_nodes
    assert path_nodes == triton.next_power_of_2(path_nodes) or path_nodes == 0, "path_nodes: a power of 2"
    assert not do_verify or path_nodes or max_nodes <= REQUEST_EPILOGUE_NODES, \
        f"the request epilogue takes at most {REQUEST_EPILOGUE_NODES} nodes, the path epilogue (path_nodes) any"
    bt = 2
    if do_verify:
        n_nodes = mixed_qkv.shape[0]
        assert mixed_qkv.shape[1] == 2 * H * K + HV * V
        assert n_nodes == 0 or (mixed_qkv.stride(1) == 1 and a.stride(1) == 1 and b.stride(1) == 1 and
                                output_gate.stride(2) == 1)
        assert max_nodes <= factors.shape[1], "a slot holds factors.shape[1] node rows"
        max_anc = max_ancestors(max_nodes, ancestors)
        is_chain = ancestors is None
        assert is_chain or ancestors.shape[0] == n_nodes, "a tree's ancestor table has a row per node"
        ancestors = tree_ancestors(cu_nodes, ancestors)
        if out is None:
            out = torch.empty(n_nodes, HV, V, dtype=mixed_qkv.dtype, device=mixed_qkv.device)
        out3 = out.view(n_nodes, HV, V)
        bt = max(2, triton.next_power_of_2(max_nodes))
    commit = dict(HAS_COMMIT=commit_nodes is not None,
                  COMMIT_ROWS=factors.shape[1] if commit_ancestors is None else commit_ancestors.shape[1],
                  COMMIT_IS_CHAIN=commit_ancestors is None)
    # absent arrays stand in as pointers that are never dereferenced
    commit_arrays = (state_indices if commit_nodes is None else commit_nodes,
                     state_indices if commit_ancestors is None else commit_ancestors)
    rows = max(16, min(launch.state_rows, V))
    # Hopper's programmatic dependent launch (not in the interpreter: inline PTX)
    dependent = do_verify and not interpreting()
    # the commit alone writes no products: `factors` stands in for the pointer
    products = torch.empty(batch, HV, 2 * bt, V, device=state.device) if do_verify else factors
    launches = [(state_pass._state_pass_kernel, (triton.cdiv(V, rows), HV, batch), (
        mixed_qkv if do_verify else factors, state, state_indices, cu_nodes if do_verify else state_indices,
        factors, *commit_arrays, products, mixed_qkv.stride(0) if do_verify else 0, state.stride(0),
        state.stride(1), state.stride(2), factors.stride(0), factors.stride(1)), dict(
        H=H, HV=HV, K=K, V=V, BV=rows, BK=max(16, min(launch.state_block_k, K)), BT=bt, DO_PRODUCTS=do_verify,
        STATE_PRODUCTS=state_products_mode(state.dtype, mixed_qkv.dtype) if do_verify else "tf32x3",
        LAUNCH_DEPENDENTS=dependent, num_warps=launch.state_warps, num_stages=1, **commit))]
    if not do_verify:
        return launches, None
    strides = (mixed_qkv.stride(0), a.stride(0), b.stride(0), output_gate.stride(0), output_gate.stride(1),
               out3.stride(0), out3.stride(1))
    scalars = (float(K**-0.5 if scale is None else scale), float(norm_eps))
    epilogue_args = (mixed_qkv, a, b, A_log, dt_bias, output_gate, norm_weight, state_indices, ancestors, cu_nodes,
                     out3, factors, products, *strides, factors.stride(0), factors.stride(1), *scalars)
    epilogue_kwargs = dict(H=H, HV=HV, K=K, V=V, BT=bt, MAX_ANC=max_anc, IS_CHAIN=is_chain, ACT=activation,
                           DEPENDENT_LAUNCH=dependent, launch_pdl=dependent, num_warps=launch.epilogue_warps,
                           num_stages=1)
    if path_nodes:
        launches.append((path_epilogue._path_epilogue_kernel, (HV, batch, triton.cdiv(max_nodes, path_nodes)),
                         epilogue_args, dict(epilogue_kwargs, NB=path_nodes)))
    else:
        launches.append((request_epilogue._request_epilogue_kernel, (HV, batch), epilogue_args, epilogue_kwargs))
    return launches, out


def _run(launches):
    for kernel, grid, kernel_args, kernel_kwargs in launches:
        kernel[grid](*kernel_args, **kernel_kwargs)


def gdn_step_triton(
    mixed_qkv: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    output_gate: torch.Tensor,
    norm_weight: torch.Tensor,
    state: torch.Tensor,
    state_indices: torch.Tensor,
    cu_nodes: torch.Tensor,
    *,
    factors: torch.Tensor,
    commit_nodes: torch.Tensor | None = None,
    commit_ancestors: torch.Tensor | None = None,
    num_key_heads: int,
    max_nodes: int,
    scale: float | None = None,
    norm_eps: float = 1e-6,
    activation: str = "silu",
    ancestors: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    launch: StepLaunch | None = None,
) -> torch.Tensor:
    """One GDN layer's speculative decode step after the conv, on packed draft chains or trees: first each slot's
    commit of its previous step (with `commit_nodes`), then the verify of this step's nodes from the committed state;
    returns every node's normed, gated core output and leaves this step's commit factors in the slots' rows.

    Args:
        mixed_qkv (torch.Tensor):
            post-conv ``q | k | v`` of every node, ``[N, 2*H*K + HV*V]``, fp32, bf16 or fp16; last dim contiguous,
            row stride free. Raw: the step applies the q/k L2 norms and ``scale``.
        a (torch.Tensor), b (torch.Tensor):
            raw gate inputs ``[N, HV]``, last dim contiguous: ``g = -exp(A_log) * softplus(a + dt_bias)``,
            ``beta = sigmoid(b)``.
        A_log (torch.Tensor), dt_bias (torch.Tensor):
            ``[HV]``.
        output_gate (torch.Tensor):
            ``z [N, HV, V]``, last dim contiguous.
        norm_weight (torch.Tensor):
            the gated RMSNorm's weight ``[V]``.
        state (torch.Tensor):
            the state pool ``[S, HV, V, K]``, vLLM's GPU layout (``state[s, hv, v, k]``), fp32, bf16 or fp16; last
            dim contiguous, other strides free; K and V powers of two. Written in place by the commit only.
        state_indices (torch.Tensor):
            ``[B]`` int32, contiguous: request b's slot; negative marks a padding request (nothing read or written,
            its rows of ``out`` untouched).
        cu_nodes (torch.Tensor):
            the packed trees' offsets (`vllm_treewy.tree.pack_trees`), ``[B+1]`` int32: request b's nodes are rows
            ``cu_nodes[b] .. cu_nodes[b+1]``; a request may have 0 nodes. A tree's topology comes from ``ancestors``
            alone (the twin, `gdn_step_packed`, takes the packed parents instead); a chain needs none.
        factors (torch.Tensor):
            the slots' factor rows ``[S', T, F]`` fp32 (`vllm_treewy.kernels.factor_rows`: S' >= S, T >= max_nodes,
            F = ``slot_factor_width(HV, K, V)``; first two strides free, last dim contiguous). The commit reads the
            rows the previous call left; then request b's node t writes ``factors[state_indices[b], t]`` in place.
        commit_nodes (Optional[torch.Tensor]):
            ``[B]`` int32, contiguous, or None (no commit). ``commit_nodes[b] = a >= 0`` first replaces slot
            ``state_indices[b]``'s state by the state after the previous step's node a (as `gdn_commit_triton`);
            -1 leaves the slot as it is.
        commit_ancestors (Optional[torch.Tensor]):
            ``[T', P]`` int32, contiguous (P <= T), shared by every slot: row a the path of commit node a in the
            slot's factor rows (a first, -1 past the root): the previous step's tree as its ancestor table, or one
            table of several block shapes (T' may exceed T: a node's table row need not be its factor row). None: the
            previous step was a chain, a's path is ``a, a-1, .., 0``.
        num_key_heads (int):
            H; HV a multiple of it (GQA: value head hv reads key head ``hv // (HV // H)``).
        max_nodes (int):
            the most nodes a request has (static: it sizes the epilogue's tiles and picks the launch); the request
            epilogue takes at most `REQUEST_EPILOGUE_NODES`, the path epilogue any.
        scale (Optional[float]):
            the query scale, ``K ** -0.5`` if None.
        norm_eps (float):
            the gated RMSNorm's epsilon.
        activation (str):
            the output gate's activation, "silu" or "sigmoid".
        ancestors (Optional[torch.Tensor]):
            the one chain-or-tree signal of this step's verify. Trees: the ancestor table ``[N, D]`` int32,
            contiguous (`ancestor_table_triton.ancestor_table`: row i node i's path, local indices, i first, -1
            past the root; D the most nodes on a root-to-node path); build it once per step, every GDN layer shares
            it. None: every request is a chain (node i's parent is i - 1), no table read.
        out (Optional[torch.Tensor]):
            ``[N, HV, V]`` or a ``[N, HV*V]`` view, mixed_qkv's dtype; allocated if None.
        launch (Optional[StepLaunch]):
            how the two launches are tiled; None takes `step_launch`'s for this state dtype, batch and max_nodes.

    Returns:
        torch.Tensor: ``out [N, HV, V]`` in mixed_qkv's dtype (the ``out`` argument when given), per node
        ``o_i * rsqrt(mean_v(o_i^2) + norm_eps) * norm_weight * act(z_i)``, with o_i rounded to that dtype first (as
        vLLM's decode rounds it); padding requests' rows untouched.

    Written in place: ``state`` (the slots with a commit node >= 0; one state read and at most one write per
    request), ``factors`` (rows 0 .. n_b - 1 of each live request's slot), ``out``.

    Allocations (`step_launches`): the products workspace ``[B, HV, 2 BT, V]`` fp32 (BT the node count padded to a
    power of two, at least 2: 8 MiB at B=64, T=4; 256 MiB at B=256 with 29-node trees) and ``out`` if None; under
    CUDA-graph capture both come from the graph's pool.

    Capturability: capturable in a CUDA graph. No host sync; no data-dependent shapes (the grids and buffers depend
    only on B, N, max_nodes and the model's dims); the topology comes as tensors (cu_nodes, ancestors,
    commit_nodes, commit_ancestors), so one captured graph serves every tree of those sizes. Two launches (the state
    pass, then its programmatic dependent epilogue on Hopper); one compiled variant per dtypes and static arguments.
    """
    launches, out = step_launches(
        mixed_qkv, a, b, A_log, dt_bias, output_gate, norm_weight, state, state_indices, cu_nodes, factors,
        commit_nodes, commit_ancestors, num_key_heads=num_key_heads, max_nodes=max_nodes, scale=scale,
        norm_eps=norm_eps, activation=activation, ancestors=ancestors, out=out, launch=launch)
    _run(launches)
    return out


def gdn_commit_triton(
    state: torch.Tensor,
    state_indices: torch.Tensor,
    factors: torch.Tensor,
    commit_nodes: torch.Tensor,
    *,
    num_key_heads: int,
    commit_ancestors: torch.Tensor | None = None,
    launch: StepLaunch | None = None,
) -> None:
    """The commit alone, in place (the end of a sequence, and tests): each slot's state becomes the state after its
    previous step's commit node, bit for bit as the commit inside `gdn_step_triton`.

    Args:
        state (torch.Tensor):
            the state pool ``[S, HV, V, K]`` (vLLM's GPU layout), fp32, bf16 or fp16; last dim contiguous, other
            strides free; K and V powers of two.
        state_indices (torch.Tensor):
            ``[B]`` int32, contiguous: request b's slot; negative marks a padding request (untouched).
        factors (torch.Tensor):
            the slots' factor rows ``[S', T, F]`` fp32 (`vllm_treewy.kernels.factor_rows`), as the previous
            `gdn_step_triton` left them; only read.
        commit_nodes (torch.Tensor):
            ``[B]`` int32, contiguous: the node a to commit, -1 to leave the slot as it is.
        num_key_heads (int):
            H (GQA, as in `gdn_step_triton`).
        commit_ancestors (Optional[torch.Tensor]):
            ``[T', P]`` int32, contiguous: row a the path of node a in the slot's factor rows (as in
            `gdn_step_triton`); None: a chain, a's path is ``a, a-1, .., 0``.
        launch (Optional[StepLaunch]):
            the state pass's tiles; None takes `step_launch`'s for one node a request.

    Returns:
        None. Written in place: ``state[s]`` for each request with slot s = state_indices[b] >= 0 and
        a = commit_nodes[b] >= 0, ``h_a = exp(c_a) h0 + sum_{j on path(a)} exp(c_a - c_j) (u_j key_scale_j)
        key_j^T`` from the path's rows ``factors[s, j]``.

    One launch (the state pass without products), no allocation, no host sync: capturable in a CUDA graph.
    """
    launches, _ = step_launches(
        None, None, None, None, None, None, None, state, state_indices, None, factors, commit_nodes,
        commit_ancestors, num_key_heads=num_key_heads, max_nodes=1, scale=None, norm_eps=0.0, activation="silu",
        ancestors=None, out=None, launch=launch)
    _run(launches)
