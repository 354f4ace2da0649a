"""Runner bookkeeping on CUDA: after sampling, with prefix caching of GDN states (align mode), every GDN layer's
accepted counts and block-boundary states in one launch. The semantics, row by row, are those of the torch twin
`boundary_states_torch.record_accepted_and_boundaries_torch`.

The layers come as a table (`boundary_table`): per layer the addresses of its state, factor rows, conv history, conv
inputs and count state (views into its KV-cache page) and of its KV-cache group's block table; every layer shares
the strides (one page layout). Grid (HV, layers, row blocks): program (hv, layer, block) writes the block's rows'
counts (hv = 0), then for each of them whose accepted tokens reached a block boundary (rare: one step in about
block_size / accepted tokens) the boundary node's state of value head hv, in BV x BK tiles, and the conv window of
channels hv * DC .. (hv + 1) * DC - 1. The commit sums its terms in the order of the GDN step's state pass
(`state_pass._commit_path`, `_committed_chunk`): the state written at a boundary is the one the next step's commit
would make (bit for bit in the interpreter, tests/kernels/test_boundary_states.py). No host sync; one compiled
variant per model and runner (the row count, the block size and the strides are not specialised; V1's batch rows and
V2's `idx_mapping` are two variants). On V2, `sampled_rows_triton` first derives the rows' draft and accepted
counts (one more launch). Draft trees pass the commit table (`commit_ancestors`: the path lookup of the twin's
docstring, a third variant; chains keep the implied path `a, a-1, .., 0`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from .boundary_states_torch import BoundaryLayer
from ..factor_rows import slot_factor_width
from ..factor_rows_triton import _factor_columns
from ..gdn_step_triton.state_pass import _committed_chunk

BLOCK_ROWS = 128  # rows per program: a decode batch of up to 128 requests is one program per (head, layer)
STATE_ROWS = 16  # value rows per tile (the state pass's common tile: 16 x 128)
STATE_COLUMNS = 128
CONV_CHANNELS = 64
TABLE_COLUMNS = 6
_DTYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def boundary_table(layers: Sequence[BoundaryLayer]) -> torch.Tensor:
    """`[L, 6]` int64 addresses per layer (state, factors, conv history, conv inputs, counts, block table), for
    `record_accepted_and_boundaries_triton`. Build it once: the views live as long as the KV cache."""
    first = layers[0]
    for layer in layers:
        for name, view in layer._asdict().items():
            assert view.stride() == getattr(first, name).stride() and view.dtype == getattr(first, name).dtype, \
                f"every layer's {name} must share the first's layout"
    return torch.tensor([[view.data_ptr() for view in layer] for layer in layers], dtype=torch.int64,
                        device=first.state.device)


def record_accepted_and_boundaries_triton(layers: Sequence[BoundaryLayer], table: torch.Tensor,
                                          seq_lens: torch.Tensor, draft_tokens: torch.Tensor,
                                          accepted: torch.Tensor, num_rows: int, *, block_size: int,
                                          null_block: int, idx_mapping: torch.Tensor | None = None,
                                          commit_ancestors: torch.Tensor | None = None) -> None:
    """`record_accepted_and_boundaries_torch` for the layers of `table` (`boundary_table(layers)`; `layers` give
    the shapes and strides), in one launch (none without rows). seq_lens, draft_tokens, accepted: int32 `[>=
    num_rows]`, contiguous; `idx_mapping` (V2: each batch row's block-table row, -1 to skip; V2 keeps it int64)
    contiguous, or None (V1: the batch row). `commit_ancestors [T', P]` int32 contiguous (draft trees: the commit
    table, `accepted` then the counts the slots record), or None (chains)."""
    if num_rows == 0:
        return
    first = layers[0]
    S, HV, V, K = first.state.shape
    _, T, F = first.factors.shape
    D, W1 = first.conv_history.shape[1:]
    assert F == slot_factor_width(HV, K, V) and first.factors.stride(2) == 1 and first.conv_inputs.stride(2) == 1
    assert first.state.stride(3) == 1 and first.factors.dtype == torch.float32
    assert first.counts.dtype == torch.int32 and first.block_table.dtype == torch.int32
    assert first.block_table.stride(1) == 1 and table.shape == (len(layers), TABLE_COLUMNS)
    for x in (seq_lens, draft_tokens, accepted):
        assert x.dtype == torch.int32 and x.stride(0) == 1
    assert idx_mapping is None or idx_mapping.stride(0) == 1
    if commit_ancestors is not None:
        assert commit_ancestors.dtype == torch.int32 and commit_ancestors.is_contiguous()
    channels = triton.cdiv(D, HV)
    _boundary_kernel[(HV, len(layers), triton.cdiv(num_rows, BLOCK_ROWS))](
        table, seq_lens, draft_tokens, accepted, seq_lens if idx_mapping is None else idx_mapping,
        seq_lens if commit_ancestors is None else commit_ancestors, num_rows, block_size,
        *first.state.stride()[:3], *first.factors.stride()[:2], *first.conv_history.stride(),
        *first.conv_inputs.stride()[:2], first.counts.stride(0), first.block_table.stride(0),
        HV=HV, K=K, V=V, T=T, D=D, W1=W1, DC=channels, STATE_DTYPE=_DTYPES[first.state.dtype],
        CONV_DTYPE=_DTYPES[first.conv_history.dtype], NULL_BLOCK=null_block, BLOCK=BLOCK_ROWS,
        BV=min(STATE_ROWS, V), BK=min(STATE_COLUMNS, K), BD=min(CONV_CHANNELS, triton.next_power_of_2(channels)),
        HAS_IDX_MAPPING=idx_mapping is not None, HAS_TABLE=commit_ancestors is not None,
        P=T if commit_ancestors is None else commit_ancestors.shape[1], num_warps=2)


@triton.jit
def _typed(address, DTYPE: tl.constexpr):
    if DTYPE == "bf16":
        return address.to(tl.pointer_type(tl.bfloat16))
    elif DTYPE == "fp16":
        return address.to(tl.pointer_type(tl.float16))
    else:
        return address.to(tl.pointer_type(tl.float32))


@triton.jit
def _request(idx_mapping, rows, live, HAS_IDX_MAPPING: tl.constexpr):
    """The block-table row of batch `rows` (-1: skip)."""
    if HAS_IDX_MAPPING:
        return tl.load(idx_mapping + rows, mask=live, other=-1)
    else:
        return tl.where(live, rows, -1)


@triton.jit
def _path_entry(commit_ancestors, commit, steps, P: tl.constexpr, HAS_TABLE: tl.constexpr):
    """The slot row `steps` steps above commit node `commit` on its path (-1 past the root, and for commit -1): the
    table's entry (commit, steps), or a chain's commit - steps. if / else: a chain's table is a placeholder pointer."""
    if HAS_TABLE:
        return tl.load(commit_ancestors + tl.maximum(commit, 0).to(tl.int64) * P + tl.minimum(steps, P - 1),
                       mask=(commit >= 0) & (steps < P), other=-1)
    else:
        return tl.where((commit >= 0) & (commit - steps >= 0), commit - steps, -1)


@triton.jit
def _row(seq_lens, draft_tokens, accepted, rows, live, block_size, commit_ancestors, P: tl.constexpr,
         HAS_TABLE: tl.constexpr):
    """(speculative, slot column, boundary node (-1: none; a slot row), boundary column, accepted (the count the
    slot records), the commit node a, the steps up from it to the boundary node, the boundary node's depth) of
    `rows` (`live`: rows with a block-table row). With the commit table, a = accepted - 1 reaches depth(a) (its
    row's entries >= 0, minus 1); without, a chain's a."""
    draft = tl.load(draft_tokens + rows, mask=live, other=-1)
    spec = live & (draft >= 0)
    seq_len = tl.load(seq_lens + rows, mask=spec, other=1)
    accept = tl.load(accepted + rows, mask=spec, other=1)
    running = seq_len - draft
    commit = accept - 1
    if HAS_TABLE:
        depth = commit * 0 - 1
        for d in tl.static_range(P):
            depth += (_path_entry(commit_ancestors, tl.where(spec, commit, -1), d, P, HAS_TABLE) >= 0).to(depth.dtype)
    else:
        depth = commit
    boundary = (running + depth) // block_size * block_size
    reached = spec & (boundary >= running)
    at = tl.maximum(boundary - running, 0)
    up = tl.maximum(depth - at, 0)
    node = _path_entry(commit_ancestors, tl.where(reached, commit, -1), up, P, HAS_TABLE)
    return spec, (seq_len - 1) // block_size, tl.where(reached, node, -1), boundary // block_size - 1, accept, \
        commit, up, at


@triton.jit
def _boundary_path(commit, up, commit_ancestors, f_kscale, f_g, stride_frow, P: tl.constexpr,
                   HAS_TABLE: tl.constexpr):
    """`state_pass._commit_path` for the node `up` steps above commit node `commit` (its path: the commit node's
    from entry `up` on), the same terms in the same order."""
    running = tl.zeros([], dtype=tl.float32)
    offsets = ()
    on_path = ()
    weights = ()
    for d in tl.static_range(P):
        path_row = _path_entry(commit_ancestors, commit, up + d, P, HAS_TABLE)
        on = path_row >= 0
        row = tl.maximum(path_row, 0).to(tl.int64) * stride_frow
        k_scale = tl.load(f_kscale + row, mask=on, other=0.0)
        weights = weights + (tl.where(on, tl.exp(running), 0.0) * k_scale,)
        running = running + tl.load(f_g + row, mask=on, other=0.0)
        offsets = offsets + (row,)
        on_path = on_path + (on,)
    return offsets, on_path, weights, tl.exp(running)


# the arrays are read as scalars or gathers, the row count and the block size vary: neither is specialised
@triton.jit(do_not_specialize=["num_rows", "block_size"],
            do_not_specialize_on_alignment=["table", "seq_lens", "draft_tokens", "accepted", "idx_mapping",
                                            "commit_ancestors"])
def _boundary_kernel(
    table, seq_lens, draft_tokens, accepted, idx_mapping, commit_ancestors, num_rows, block_size,
    stride_slot, stride_head, stride_v, stride_fslot, stride_frow, stride_cslot, stride_cdim, stride_ccol,
    stride_islot, stride_irow, stride_count, stride_bt,
    HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, T: tl.constexpr, D: tl.constexpr, W1: tl.constexpr,
    DC: tl.constexpr, STATE_DTYPE: tl.constexpr, CONV_DTYPE: tl.constexpr, NULL_BLOCK: tl.constexpr,
    BLOCK: tl.constexpr, BV: tl.constexpr, BK: tl.constexpr, BD: tl.constexpr, HAS_IDX_MAPPING: tl.constexpr,
    HAS_TABLE: tl.constexpr, P: tl.constexpr,
):
    i_hv, i_layer, i_block = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    entry = table + i_layer * 6  # a row of `boundary_table`
    state = _typed(tl.load(entry), STATE_DTYPE)
    factors = tl.load(entry + 1).to(tl.pointer_type(tl.float32))
    conv = _typed(tl.load(entry + 2), CONV_DTYPE)
    inputs = _typed(tl.load(entry + 3), CONV_DTYPE)
    counts = tl.load(entry + 4).to(tl.pointer_type(tl.int32))
    block_table = tl.load(entry + 5).to(tl.pointer_type(tl.int32))

    rows = i_block * BLOCK + tl.arange(0, BLOCK)
    requests = _request(idx_mapping, rows, rows < num_rows, HAS_IDX_MAPPING)
    spec, slot_col, node, dest_col, accept, _commits, _ups, _depths = _row(
        seq_lens, draft_tokens, accepted, rows, requests >= 0, block_size, commit_ancestors, P, HAS_TABLE)
    bt_rows = block_table + requests.to(tl.int64) * stride_bt
    slot = tl.load(bt_rows + slot_col, mask=spec, other=NULL_BLOCK)
    real = spec & (slot != NULL_BLOCK)
    dest = tl.load(bt_rows + dest_col, mask=real & (node >= 0), other=NULL_BLOCK)
    write = real & (node >= 0) & (dest != NULL_BLOCK)
    if i_hv == 0:
        # the slot's count first (0 where the boundary block is the slot: committed here), then the boundary block's
        tl.store(counts + slot.to(tl.int64) * stride_count, tl.where(write & (dest == slot), 0, accept), mask=real)
        tl.store(counts + dest.to(tl.int64) * stride_count, tl.zeros([BLOCK], tl.int32), mask=write)

    o_v = tl.arange(0, BV)
    o_k = tl.arange(0, BK)
    o_d = tl.arange(0, BD)
    for i in range(0, BLOCK):
        row = i_block * BLOCK + i
        if row < num_rows:
            request = _request(idx_mapping, row, row < num_rows, HAS_IDX_MAPPING)
            spec_i, slot_col_i, node_i, dest_col_i, _accept_i, commit_i, up_i, depth_i = _row(
                seq_lens, draft_tokens, accepted, row, request >= 0, block_size, commit_ancestors, P, HAS_TABLE)
            if node_i >= 0:
                bt_row = block_table + request.to(tl.int64) * stride_bt
                src = tl.load(bt_row + slot_col_i).to(tl.int64)
                dst = tl.load(bt_row + dest_col_i).to(tl.int64)
                if (src != NULL_BLOCK) & (dst != NULL_BLOCK):
                    # the state after node node_i along its path: rows node_i, node_i - 1, .., 0 of the slot's
                    # factors (a chain), or the accepted node's table row from `up_i` on
                    f_k, f_kscale, f_u, f_g = _factor_columns(factors, src, stride_fslot, i_hv, HV, K, V)
                    p_rows, p_on, p_weight, p_root = _boundary_path(commit_i, up_i, commit_ancestors, f_kscale, f_g,
                                                                    stride_frow, P, HAS_TABLE)
                    for v0 in tl.static_range(0, V, BV):
                        v_rows = v0 + o_v
                        p_wu = ()
                        for d in tl.static_range(P):
                            p_wu = p_wu + (tl.load(f_u + p_rows[d] + v_rows, mask=p_on[d], other=0.0) * p_weight[d],)
                        for k0 in tl.static_range(0, K, BK):
                            cols = k0 + o_k
                            keys = ()
                            for d in tl.static_range(P):
                                keys = keys + (tl.load(f_k + p_rows[d] + cols, mask=p_on[d], other=0.0),)
                            offsets = i_hv * stride_head + v_rows[:, None] * stride_v + cols[None, :]
                            h = tl.load(state + src * stride_slot + offsets).to(tl.float32)
                            h = _committed_chunk(h, p_root, p_wu, keys, P)
                            tl.store(state + dst * stride_slot + offsets, h.to(state.dtype.element_ty))
                    # the conv window after it: the last W1 of (history, the inputs of its path, root first), channels
                    # of this head; the input at position p is the path's node at depth p - W1
                    for c0 in tl.static_range(0, DC, BD):
                        ch = i_hv * DC + c0 + o_d
                        on = (c0 + o_d < DC) & (ch < D)
                        window = ()
                        for c in tl.static_range(W1):
                            position = depth_i + 1 + c
                            up = tl.minimum(tl.maximum(depth_i + W1 - position, 0), depth_i)
                            input_row = tl.maximum(_path_entry(commit_ancestors, commit_i, up_i + up, P, HAS_TABLE),
                                                   0)
                            from_history = tl.load(conv + src * stride_cslot + ch * stride_cdim
                                                   + tl.minimum(position, W1 - 1) * stride_ccol,
                                                   mask=on & (position < W1), other=0.0)
                            from_inputs = tl.load(inputs + src * stride_islot
                                                  + input_row.to(tl.int64) * stride_irow + ch,
                                                  mask=on & (position >= W1), other=0.0)
                            window = window + (from_history + from_inputs,)
                        for c in tl.static_range(W1):
                            tl.store(conv + dst * stride_cslot + ch * stride_cdim + c * stride_ccol, window[c],
                                     mask=on)


def sampled_rows_triton(counts: torch.Tensor, block_table: torch.Tensor, idx_mapping: torch.Tensor,
                        seq_lens: torch.Tensor, num_sampled: torch.Tensor, num_rows: int, *, block_size: int,
                        null_block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`boundary_states_torch.sampled_rows` in one launch: (draft tokens, accepted) int32 `[num_rows]`, new
    tensors (contiguous, as `record_accepted_and_boundaries_triton` takes them). counts `[S]` int32 (any stride),
    block_table `[R, C]` int32 (rows per request state), idx_mapping, seq_lens, num_sampled `[>= num_rows]`
    integer, contiguous. A separate launch from the boundary kernel: that one rewrites the counts it would read."""
    drafts = torch.empty(num_rows, dtype=torch.int32, device=counts.device)
    accepted = torch.empty_like(drafts)
    if num_rows == 0:
        return drafts, accepted
    assert counts.dtype == torch.int32 and block_table.dtype == torch.int32 and block_table.stride(1) == 1
    for x in (idx_mapping, seq_lens, num_sampled):
        assert x.stride(0) == 1
    _sampled_rows_kernel[(triton.cdiv(num_rows, BLOCK_ROWS),)](
        counts, counts.stride(0), block_table, block_table.stride(0), idx_mapping, seq_lens, num_sampled, drafts,
        accepted, num_rows, block_size, NULL_BLOCK=null_block, BLOCK=BLOCK_ROWS)
    return drafts, accepted


@triton.jit(do_not_specialize=["counts_stride", "bt_stride", "num_rows", "block_size"],
            do_not_specialize_on_alignment=["counts", "block_table", "idx_mapping", "seq_lens", "num_sampled"])
def _sampled_rows_kernel(counts, counts_stride, block_table, bt_stride, idx_mapping, seq_lens, num_sampled, drafts,
                         accepted, num_rows, block_size, NULL_BLOCK: tl.constexpr, BLOCK: tl.constexpr):
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = rows < num_rows
    request = tl.load(idx_mapping + rows, mask=live, other=-1)
    on = live & (request >= 0)
    seq_len = tl.load(seq_lens + rows, mask=on, other=1)
    column = tl.maximum(seq_len - 1, 0) // block_size
    slot = tl.load(block_table + request.to(tl.int64) * bt_stride + column, mask=on, other=NULL_BLOCK)
    on = on & (slot != NULL_BLOCK)
    # int64: the stride is a KV-cache page (megabytes), so slot * stride passes 2**31
    count = tl.load(counts + slot.to(tl.int64) * counts_stride, mask=on, other=0)
    tl.store(drafts + rows, count - 1, mask=live)
    sampled = tl.load(num_sampled + rows, mask=live, other=1)
    tl.store(accepted + rows, tl.maximum(sampled, 1).to(tl.int32), mask=live)
