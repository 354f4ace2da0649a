"""Causal depthwise conv1d over packed draft trees and the conv-history commit of the accepted path, as one
speculative step (`conv_step_triton`: the previous step's commit, then this step's conv).

A node's input sequence is its request's committed history `conv_state[slot, :, 0 .. L-1]` (oldest first,
L >= w-1; any strides, e.g. vLLM's) followed by its root-to-node path; its window is the last w entries.
Walking up from a node, `cur >= 0` is a node of the path and `cur = -1, -2, ...` is history column L+cur (one step
past the root is the newest column). Torch twin: `vllm_treewy.kernels.conv_step_torch` (same packed API).
"""

import torch
import triton
import triton.language as tl


@triton.jit
def _step_up(parents, bos, cur, CHAIN: tl.constexpr):
    """One step towards the root; past the root, count down into the history. A chain's parent is the node before
    (the first node's, -1, the newest history column): no load."""
    if CHAIN:
        return cur - 1
    return tl.where(cur >= 0, tl.load(parents + bos + cur, mask=cur >= 0, other=-1), cur - 1)


@triton.jit
def _conv_of_nodes(x, p_hist, weight, bias, parents, out, bos, n, o_d, mask_d, stride_x, stride_out, stride_cs_col,
                   W: tl.constexpr, L: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr, HAS_BIAS: tl.constexpr,
                   SILU: tl.constexpr, ROUND_PRODUCTS: tl.constexpr, CHAIN: tl.constexpr):
    """The conv outputs of one request's n nodes (packed from bos) over channels o_d; history at p_hist.
    Rounded as vLLM's CUDA `causal_conv1d_update`: when the history and the weight share a 16-bit dtype, inputs in
    it and each product rounded to it (vLLM's kernel multiplies two bf16 in bf16: `mul.bf16` on sm_90, as here),
    silu as x / (1 + exp(-x)). vLLM sums the window oldest first, we newest first (the walk up the tree; a
    register array for the other order spills): sums of W bf16 products are exact in fp32 unless they span
    more than ~16 binades, so the order rarely shows."""
    for start in range(0, n, BN):
        nodes = start + tl.arange(0, BN)
        valid = nodes < n
        m = valid[:, None] & mask_d[None, :]
        cur = tl.where(valid, nodes, 0)
        acc = tl.zeros([BN, BD], dtype=tl.float32)
        if HAS_BIAS:
            acc += tl.load(bias + o_d, mask=mask_d, other=0.0).to(tl.float32)[None, :]
        for t in tl.static_range(W):
            if t > 0:
                cur = _step_up(parents, bos, cur, CHAIN)
            from_x = tl.load(x + (bos + cur)[:, None].to(tl.int64) * stride_x + o_d[None, :],
                             mask=m & (cur >= 0)[:, None], other=0.0)
            from_hist = tl.load(p_hist + (L + cur)[:, None] * stride_cs_col, mask=m & (cur < 0)[:, None], other=0.0)
            tap = tl.load(weight + o_d * W + (W - 1 - t), mask=mask_d, other=0.0).to(tl.float32)
            value = from_x.to(tl.float32) + from_hist.to(tl.float32)
            if ROUND_PRODUCTS:  # vLLM casts x to the history's dtype (a no-op for bf16 x), then multiplies in it
                value = value.to(p_hist.dtype.element_ty).to(tl.float32)
                acc += (value * tap[None, :]).to(p_hist.dtype.element_ty).to(tl.float32)
            else:
                acc += value * tap[None, :]
        if SILU:
            acc = acc / (1.0 + tl.exp(-acc))
        tl.store(out + (bos + nodes)[:, None].to(tl.int64) * stride_out + o_d[None, :], acc.to(out.dtype.element_ty),
                 mask=m)


# integer arrays read as scalars or gathers: no alignment key (as the GDN step's kernels); D and the strides are
# model constants and stay specialised
@triton.jit(do_not_specialize=["state_indices", "parents", "cu_nodes", "commit_nodes", "commit_ancestors"])
def _conv_step_kernel(
    x, conv_state, state_indices, weight, bias, parents, cu_nodes, out, inputs, commit_nodes, commit_ancestors,
    stride_x, stride_out, stride_cs_slot, stride_cs_dim, stride_cs_col, stride_in_slot, stride_in_node, D,
    W: tl.constexpr, L: tl.constexpr, BL: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr,
    HAS_BIAS: tl.constexpr, SILU: tl.constexpr, HAS_COMMIT: tl.constexpr, COMMIT_DEPTH: tl.constexpr,
    COMMIT_IS_CHAIN: tl.constexpr, ROUND_PRODUCTS: tl.constexpr, CHAIN: tl.constexpr,
):
    i_d, i_b = tl.program_id(0), tl.program_id(1)
    slot = tl.load(state_indices + i_b).to(tl.int64)
    if slot < 0:
        return
    o_d = i_d * BD + tl.arange(0, BD)
    mask_d = o_d < D
    p_hist = conv_state + slot * stride_cs_slot + o_d[None, :] * stride_cs_dim
    p_inputs = inputs + slot * stride_in_slot + o_d[None, :]
    if HAS_COMMIT:
        # the previous step's draft, committed at its commit node: new column L-1-t takes the input t steps up
        # from it, continued into the old history (src = -1, -2, ..: its newest columns)
        node = tl.load(commit_nodes + i_b)
        if node >= 0:
            steps = tl.arange(0, BL)
            if COMMIT_IS_CHAIN:
                src = node - steps
            else:
                # the node's table row is its path, node first, then -1 past the root; counted over BL >= L
                # entries, path_len is min(length, BL): exact wherever a kept step (< L) is on the path
                path = tl.load(commit_ancestors + node * COMMIT_DEPTH + steps, mask=steps < COMMIT_DEPTH,
                               other=-1)
                path_len = tl.sum((path >= 0).to(tl.int32), 0)
                src = tl.where(steps < path_len, path, path_len - 1 - steps)
            m = (steps < L)[:, None] & mask_d[None, :]
            from_inputs = tl.load(p_inputs + src[:, None] * stride_in_node, mask=m & (src >= 0)[:, None], other=0.0)
            from_hist = tl.load(p_hist + (L + src)[:, None] * stride_cs_col, mask=m & (src < 0)[:, None], other=0.0)
            new_hist = from_inputs.to(conv_state.dtype.element_ty) + from_hist
            tl.debug_barrier()  # every old column and input row is read before any is overwritten
            tl.store(p_hist + (L - 1 - steps)[:, None] * stride_cs_col, new_hist, mask=m)
            tl.debug_barrier()  # the conv below reads the new history
    bos = tl.load(cu_nodes + i_b)
    n = tl.load(cu_nodes + i_b + 1) - bos
    _conv_of_nodes(x, p_hist, weight, bias, parents, out, bos, n, o_d, mask_d, stride_x, stride_out, stride_cs_col,
                   W, L, BN, BD, HAS_BIAS, SILU, ROUND_PRODUCTS, CHAIN)
    # this step's inputs, for the commit inside the next step (the previous rows were read above)
    for start in range(0, n, BN):
        nodes = start + tl.arange(0, BN)
        m = (nodes < n)[:, None] & mask_d[None, :]
        own = tl.load(x + (bos + nodes)[:, None].to(tl.int64) * stride_x + o_d[None, :], mask=m, other=0.0)
        tl.store(p_inputs + nodes[:, None] * stride_in_node, own.to(inputs.dtype.element_ty), mask=m)


def conv_step_triton(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    state_indices: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    parents: torch.Tensor | None,
    cu_nodes: torch.Tensor,
    inputs: torch.Tensor,
    commit_nodes: torch.Tensor | None,
    *,
    commit_ancestors: torch.Tensor | None = None,
    activation: str | None = None,
    out: torch.Tensor | None = None,
    block_nodes: int = 16,
    block_d: int = 256,
) -> torch.Tensor:
    """One speculative step of the causal depthwise conv1d over packed draft chains or trees, per request b in slot
    s = state_indices[b]:

    1. if ``commit_nodes[b] >= 0``, commit the slot's previous step: its draft's inputs are ``inputs[s, 0..]``
       (written by the previous call), and the history moves on along the path to its node ``commit_nodes[b]``, in
       place;
    2. the conv of this step's nodes: ``act(bias + sum_t weight[:, w-1-t] * (the entry t steps up the node's path,
       continued into the history))``, fp32 accumulation, from the committed history; with a bf16 (or fp16)
       history and weight, each product rounded to that dtype first, as vLLM's CUDA conv computes it (the twin, also
       the CPU path, keeps exact products, as vLLM's CPU conv does);
    3. this step's inputs x go to ``inputs[s, 0 .. n_b-1]`` for the commit inside the next step.

    Args:
        x (torch.Tensor):
            pre-conv inputs of every node ``[N, D]``, last dim contiguous, row stride free.
        conv_state (torch.Tensor):
            the history pool ``[S, D, L]``, oldest column first, L >= w-1, any strides (vLLM's page view). Written
            in place by the commit.
        state_indices (torch.Tensor):
            ``[B]`` int32, contiguous: request b's slot; negative marks a padding request (nothing read or written,
            its rows of ``out`` untouched).
        weight (torch.Tensor):
            ``[D, w]``, contiguous; ``weight[:, -1]`` multiplies the node's own input.
        bias (Optional[torch.Tensor]):
            ``[D]`` or None.
        parents (Optional[torch.Tensor]), cu_nodes (torch.Tensor):
            the packed trees (`vllm_treewy.tree.pack_trees`): ``parents [N]`` int32 local, ``cu_nodes [B+1]`` int32.
            A chain is the tree whose parents are i - 1: ``parents`` None says every request is a chain, and the
            conv steps to the node before without reading a table (given a chain's parents, it walks them).
        inputs (torch.Tensor):
            the slots' input rows ``[S', T, D]`` (slot and row strides free, last dim contiguous; x is cast to
            their dtype): read by the commit (the previous call's rows), then this step's rows written in place.
        commit_nodes (Optional[torch.Tensor]):
            ``[B]`` int32 or None (no commit); -1 leaves the slot's history as it is.
        commit_ancestors (Optional[torch.Tensor]):
            ``[T', P]`` int32, contiguous, shared by every slot: row a the path of commit node a in the slot's input
            rows (a first, -1 past the root): the previous step's tree as its ancestor table
            (`vllm_treewy.kernels.ancestor_table_triton.ancestor_table`), or one table of several block shapes (T'
            may exceed the rows: a node's table row need not be its input row). None: the previous step was a chain.
        activation (Optional[str]):
            None or "silu".
        out (Optional[torch.Tensor]):
            ``[N, D]`` (row stride free, last dim contiguous); allocated like x if None.
        block_nodes (int), block_d (int):
            nodes and channels a program takes at once (powers of two).

    Returns:
        torch.Tensor: ``out [N, D]``, the conv output of every node in out's dtype (x's when allocated here);
        padding requests' rows untouched.

    Written in place: ``conv_state`` (the committed slots' history), ``inputs`` (rows 0 .. n_b - 1 of each live
    slot), ``out``. Allocations: ``out`` if None, nothing else. One launch, grid (D / block_d, B); no host sync, no
    data-dependent shapes, the topology as tensors: capturable in a CUDA graph. Twin:
    `vllm_treewy.kernels.conv_step_torch.conv_step_packed`.
    """
    grid, kernel_args, kernel_kwargs, out = _conv_launch_arguments(
        x, conv_state, state_indices, weight, bias, parents, cu_nodes, inputs, commit_nodes,
        commit_ancestors=commit_ancestors, activation=activation, out=out, block_nodes=block_nodes, block_d=block_d)
    _conv_step_kernel[grid](*kernel_args, **kernel_kwargs)
    return out


def _conv_launch_arguments(x, conv_state, state_indices, weight, bias, parents, cu_nodes, inputs, commit_nodes, *,
                           commit_ancestors, activation, out, block_nodes, block_d):
    """(grid, positional and keyword arguments of `_conv_step_kernel`, out), nothing launched."""
    D, W = weight.shape
    assert x.stride(-1) == 1 and weight.is_contiguous() and activation in (None, "silu")
    assert inputs.stride(-1) == 1 and inputs.shape[2] == D and state_indices.stride(0) == 1
    L = conv_state.shape[2]
    assert L >= W - 1
    assert commit_ancestors is None or (commit_ancestors.dim() == 2 and commit_ancestors.is_contiguous() and
                                         commit_ancestors.dtype == torch.int32)
    out = torch.empty_like(x) if out is None else out
    kernel_args = (
        x, conv_state, state_indices, weight, weight if bias is None else bias,
        cu_nodes if parents is None else parents, cu_nodes, out, inputs,
        state_indices if commit_nodes is None else commit_nodes,
        state_indices if commit_ancestors is None else commit_ancestors,
        x.stride(0), out.stride(0), *conv_state.stride(), inputs.stride(0), inputs.stride(1), D)
    kernel_kwargs = dict(
        W=W, L=L, BL=triton.next_power_of_2(L), BN=block_nodes, BD=block_d, HAS_BIAS=bias is not None,
        SILU=activation == "silu", HAS_COMMIT=commit_nodes is not None,
        COMMIT_DEPTH=1 if commit_ancestors is None else commit_ancestors.shape[1],
        COMMIT_IS_CHAIN=commit_ancestors is None,
        ROUND_PRODUCTS=conv_state.dtype == weight.dtype and conv_state.dtype in (torch.bfloat16, torch.float16),
        CHAIN=parents is None,
    )
    return (triton.cdiv(D, block_d), state_indices.shape[0]), kernel_args, kernel_kwargs, out
