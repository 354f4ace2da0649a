"""Tree attention and accepted-path KV compaction on vLLM's CPU paged KV cache (plain torch).

One target forward verifies a whole draft tree. Per request the verified block is its root (the last accepted token)
followed by its draft nodes in local node order (``vllm_treewy.spec_decode.acceptance``): block index 0 is the root,
1 + i is local node i. Every block token has its own KV slot at logical position ``committed_len + block index``
(the slot mapping must follow block indices, not RoPE positions), and its RoPE position is
``committed_len + depth`` (root depth 0). In full attention a block token attends to all committed positions and
to the block tokens that are its ancestors or itself; never to siblings or cousins.

vLLM's CPU backend keeps one tensor per layer, ``kv_cache [num_blocks, num_kv_heads, block_size, 2 * head_size]``,
and its ``forward`` splits it into ``key_cache``/``value_cache`` views ``[num_blocks, num_kv_heads, block_size,
head_size]`` (``split_kv_cache`` makes the same views). Those shapes are nominal: ``cpu_attn_reshape_and_cache``
packs each (block, head) for the kernel of the layer's ISA (``layer.isa``), so a token's vector is not the row
``cache[block, head, offset]``. ``token_major_view`` decodes the packings of the ISAs this module supports
(measured against ``cpu_attn_reshape_and_cache``; ``tests/plugin/trees/test_attention_cpu.py`` pins them):

- ``vec``/``vec16``: keys transposed per (block, head), ``[head_size, block_size]``; values ``[block_size,
  head_size]``.
- ``amx``: keys in VNNI pairs of dimensions, ``[block_size/16, head_size/2, 16, 2]``; values in pairs of tokens,
  ``[head_size/16, block_size/2, 16, 2]``.

Other ISAs (neon, vxe, vsx, rvv) pack differently and are refused.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from vllm_treewy.kernels.ancestor_table_triton import ancestor_table_torch
from vllm_treewy.spec_decode.acceptance import KVMoves, accepted_kv_moves, verified_block_offsets
from vllm_treewy.tree import node_requests

SUPPORTED_ISAS = ("vec", "vec16", "amx")


def _packing(isa: str, is_key: bool, block_size: int, head_size: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """One (block, head) packing as a 4-d memory shape, and the permutation that orders its axes as (token outer,
    token inner, dim outer, dim inner): token t is (t // inner, t % inner), a dimension likewise."""
    if isa in ("vec", "vec16"):
        if is_key:  # memory (dim, token)
            return (head_size, 1, block_size, 1), (1, 2, 0, 3)
        return (1, block_size, 1, head_size), (0, 1, 2, 3)
    if isa == "amx":
        if block_size % 16 or head_size % 16:
            raise ValueError(f"amx packing needs block_size and head_size divisible by 16: {block_size}, {head_size}")
        if is_key:  # memory (token // 16, dim // 2, token % 16, dim % 2)
            return (block_size // 16, head_size // 2, 16, 2), (0, 2, 1, 3)
        # memory (dim // 16, token // 2, dim % 16, token % 2)
        return (head_size // 16, block_size // 2, 16, 2), (1, 3, 0, 2)
    raise NotImplementedError(f"CPU attention ISA {isa!r}: its KV packing is not decoded here (only {SUPPORTED_ISAS})")


def split_kv_cache(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``(key_cache, value_cache)`` views that ``CPUAttentionBackendImpl.forward`` makes of a layer's cache."""
    num_blocks, num_kv_heads, block_size, _ = kv_cache.shape
    key_cache, value_cache = kv_cache.view(num_blocks, num_kv_heads, block_size * 2, -1).chunk(2, dim=2)
    return key_cache, value_cache


def token_major_view(cache: torch.Tensor, isa: str, is_key: bool) -> torch.Tensor:
    """A view of one cache half as ``[num_blocks, num_kv_heads, token_outer, token_inner, dim_outer, dim_inner]``.

    ``cache`` is a ``split_kv_cache`` half (nominal shape ``[num_blocks, num_kv_heads, block_size, head_size]``).
    Token ``t`` of a block is ``[..., t // token_inner, t % token_inner, :, :]``; flattening the last two axes gives
    its head_size vector. A view, so indexed writes land in the cache.
    """
    num_blocks, num_kv_heads, block_size, head_size = cache.shape
    if cache.stride(3) != 1 or cache.stride(2) != head_size:
        raise ValueError("each (block, head) of the cache must be one contiguous run, as vLLM allocates it")
    memory_shape, order = _packing(isa, is_key, block_size, head_size)
    packed = cache.flatten(2).unflatten(2, memory_shape)
    return packed.permute(0, 1, *(2 + axis for axis in order))


def _slot_coordinates(view: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    token_outer, token_inner = view.shape[2], view.shape[3]
    block, offset = slots // (token_outer * token_inner), slots % (token_outer * token_inner)
    return block, offset // token_inner, offset % token_inner


def read_slots(cache: torch.Tensor, slots: torch.Tensor, isa: str, is_key: bool) -> torch.Tensor:
    """``[len(slots), num_kv_heads, head_size]``: the vectors stored at flat slots (block * block_size + offset)."""
    view = token_major_view(cache, isa, is_key)
    block, outer, inner = _slot_coordinates(view, slots.long())
    return view[block, :, outer, inner].flatten(-2)


def verified_block_ancestors(parents: torch.Tensor, cu_nodes: torch.Tensor, max_depth: int) -> torch.Tensor:
    """``[N + B, max_depth + 1]`` int32 ancestor table of the packed verified blocks, for ``tree_attention``.

    ``parents [N]``/``cu_nodes [B+1]``: the draft trees (local parents, -1 = child of the root); ``max_depth``: a
    Python int >= every tree's depth (``PackedTrees.max_depth``). Row ``cu_nodes[b] + b + k`` is block token k of
    request b; entry d is the block index of its d-th ancestor (d = 0: itself, the root is block index 0), -1
    beyond the root. Built once per step, shared by every full-attention layer. No host sync.
    """
    num_nodes = parents.numel()
    block_starts = verified_block_offsets(cu_nodes)
    # Block index of node i is 1 + i, so its parent's is 1 + parents[i] (0 = the root); roots keep -1.
    block_parents = torch.full((num_nodes + cu_nodes.numel() - 1,), -1, dtype=torch.int32, device=parents.device)
    node_rows = torch.arange(num_nodes, device=parents.device) + node_requests(cu_nodes, num_nodes) + 1
    block_parents[node_rows] = (parents.long() + 1).to(torch.int32)
    return ancestor_table_torch(block_parents, block_starts, max_depth + 1)


def tree_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    *,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    block_ancestors: torch.Tensor,
    max_query_len: int,
    max_seq_len: int,
    scale: float,
    isa: str,
    sliding_window: int = -1,
    logits_soft_cap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    output: torch.Tensor | None = None,
) -> torch.Tensor:
    """Full attention of the verified blocks of R tree requests, reading K/V from vLLM's CPU paged cache.

    ``query [T, num_heads, head_size]``: the requests' block tokens back to back, request r at rows
    ``query_start_loc[r] : query_start_loc[r+1]`` (``query_start_loc [R+1]``, starting at 0; rows past
    ``query_start_loc[R]`` are padding and left alone in ``output``). ``key_cache``/``value_cache``: the layer's
    ``split_kv_cache`` halves, already holding this step's K/V at the block tokens' slots (vLLM's
    ``do_kv_cache_update`` runs before ``forward``), packed for ``isa`` (``layer.isa``).
    ``seq_lens [R]``: committed length + block length (vLLM's ``seq_lens``); ``block_table [R, max_blocks]``;
    the block of request r sits at logical positions ``seq_lens[r] - query_len[r]`` onward.
    ``block_ancestors [T, D]``: per row, the block indices of its ancestors, column 0 itself, -1 padding
    (``verified_block_ancestors``; D must reach the deepest token's root, or the mask drops far ancestors).
    ``max_query_len``/``max_seq_len``: Python ints bounding every request's (vLLM's metadata fields of that name);
    they fix the padded shapes. GQA: query head h reads KV head ``h // (num_heads // num_kv_heads)``.
    ``sliding_window`` (-1 = none): a key is seen when (query position - key position) < sliding_window, with tree
    positions ``committed_len + depth``, vLLM's causal rule on a chain. Soft cap, ALiBi and sinks are refused.

    Returns ``output`` (``[T, num_heads, head_size]`` or ``[T, num_heads * head_size]``, allocated like ``query``
    when not given): computed in fp32, stored in output's dtype. No host sync. R = 0 returns ``output`` untouched.
    Memory: fp32 copies of every request's K/V up to ``max_seq_len`` and ``[R, num_heads, max_query_len,
    max_seq_len]`` scores; a reference-grade path, not a fast one.
    """
    if logits_soft_cap:
        raise NotImplementedError("tree_attention: logits soft cap is not supported")
    if alibi_slopes is not None or sinks is not None:
        raise NotImplementedError("tree_attention: ALiBi slopes and attention sinks are not supported")
    if key_cache.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise NotImplementedError(f"tree_attention: KV cache dtype {key_cache.dtype} (quantized KV is not supported)")
    num_tokens, num_heads, head_size = query.shape
    _, num_kv_heads, block_size, cache_head_size = key_cache.shape
    if cache_head_size != head_size or num_heads % num_kv_heads:
        raise ValueError(f"query heads {num_heads}x{head_size} do not fit KV heads {num_kv_heads}x{cache_head_size}")
    if block_ancestors.shape[0] != num_tokens:
        raise ValueError(f"block_ancestors has {block_ancestors.shape[0]} rows for {num_tokens} query rows")
    if output is None:
        output = torch.empty_like(query)
    output_rows = output.view(num_tokens, num_heads, head_size)
    device = query.device
    num_requests = seq_lens.numel()
    if num_requests == 0:
        return output
    group = num_heads // num_kv_heads
    padded_rows = num_requests * max_query_len

    # Each row's request and block index, and its place in a padded [R, max_query_len] grid. Padding rows are sent
    # to one extra grid row that nothing reads back.
    starts = query_start_loc.long()
    rows = torch.arange(num_tokens, device=device)
    request = torch.searchsorted(starts[1:], rows, right=True).clamp(max=num_requests - 1)
    block_index = rows - starts[request]
    is_tree_row = rows < starts[-1]
    grid_row = torch.where(is_tree_row, request * max_query_len + block_index, padded_rows)

    query_grid = query.new_zeros(padded_rows + 1, num_heads, head_size, dtype=torch.float32)
    query_grid[grid_row] = query.float()
    query_grid = query_grid[:padded_rows].view(num_requests, max_query_len, num_kv_heads, group, head_size)

    # Distance from each grid token to each of its ancestors' block indices (0 = itself); a dump column takes -1s.
    no_key = torch.iinfo(torch.int64).max
    # Padding rows' tables may hold anything (a replayed graph's leftovers): read them as empty.
    ancestors = torch.where(is_tree_row[:, None], block_ancestors.long(), -1)
    ancestor_distance = torch.arange(ancestors.shape[1], device=device).expand_as(ancestors)
    block_distance = torch.full((padded_rows + 1, max_query_len + 1), no_key, dtype=torch.long, device=device)
    block_distance[grid_row[:, None], torch.where(ancestors >= 0, ancestors, max_query_len)] = ancestor_distance
    block_distance = block_distance[:padded_rows, :max_query_len].view(num_requests, max_query_len, max_query_len)
    depth = torch.zeros(padded_rows + 1, dtype=torch.long, device=device)
    depth[grid_row] = (ancestors >= 0).sum(dim=1) - 1
    depth = depth[:padded_rows].view(num_requests, max_query_len)

    # Every key position of the request, as whole cache blocks: [R, num_positions, num_kv_heads, head_size].
    blocks_per_request = -(-max_seq_len // block_size)
    num_positions = blocks_per_request * block_size
    block_ids = block_table[:, :blocks_per_request].long()
    keys = _read_blocks(key_cache, block_ids, isa, is_key=True)
    values = _read_blocks(value_cache, block_ids, isa, is_key=False)

    # Key position p of request r: committed when p < committed_len (distance = query position - p), a block token
    # when committed_len <= p < seq_len (distance along the tree, infinite off the ancestor path), else nothing.
    query_len = starts[1:] - starts[:-1]
    committed_len = seq_lens.long() - query_len
    position = torch.arange(num_positions, device=device)
    in_block = position[None, :] - committed_len[:, None]  # [R, P]
    written = position[None, :] < seq_lens.long()[:, None]
    tree_distance = block_distance.gather(
        2, in_block.clamp(0, max_query_len - 1)[:, None, :].expand(-1, max_query_len, -1)
    )
    committed_distance = (committed_len[:, None] + depth)[:, :, None] - position[None, None, :]
    distance = torch.where(
        (in_block < 0)[:, None, :], committed_distance, torch.where(written[:, None, :], tree_distance, no_key)
    )
    limit = sliding_window if sliding_window > 0 else no_key
    visible = distance < limit  # [R, Q, P]

    scores = torch.einsum("rqkgd,rpkd->rkgqp", query_grid, keys) * scale
    scores = scores.masked_fill(~visible[:, None, None], float("-inf"))
    probabilities = torch.softmax(scores, dim=-1)
    # Unwritten positions may hold anything, NaN included; 0 * NaN would leak into every row.
    values = torch.where(written[:, :, None, None], values, 0.0)
    attended = torch.einsum("rkgqp,rpkd->rqkgd", probabilities, values).reshape(padded_rows, num_heads, head_size)

    result = attended[grid_row.clamp(max=padded_rows - 1)]
    output_rows.copy_(torch.where(is_tree_row[:, None, None], result.to(output.dtype), output_rows))
    return output


def _read_blocks(cache: torch.Tensor, block_ids: torch.Tensor, isa: str, is_key: bool) -> torch.Tensor:
    """``[R, num_blocks_per_request * block_size, num_kv_heads, head_size]`` fp32, token order, of whole blocks."""
    view = token_major_view(cache, isa, is_key)[block_ids]  # [R, nb, heads, to, ti, do, di]
    view = view.permute(0, 1, 3, 4, 2, 5, 6)
    num_requests, num_blocks, token_outer, token_inner, num_kv_heads, dim_outer, dim_inner = view.shape
    return view.reshape(
        num_requests, num_blocks * token_outer * token_inner, num_kv_heads, dim_outer * dim_inner
    ).float()


def compact_accepted_kv(
    key_cache: torch.Tensor | Sequence[torch.Tensor],
    value_cache: torch.Tensor | Sequence[torch.Tensor],
    block_table: torch.Tensor,
    accepted_nodes: torch.Tensor,
    root_positions: torch.Tensor,
    *,
    isa: str,
) -> KVMoves:
    """Move each request's accepted path's K/V behind its root, in every given layer's cache.

    ``key_cache``/``value_cache``: one layer's ``split_kv_cache`` halves, or equally long sequences of them (one per
    full-attention layer; all must share ``isa``, block size and ``block_table``). ``block_table [B, max_blocks]``
    maps request b's logical positions to slots; ``accepted_nodes [B, D]`` (``TreeAcceptance.accepted_nodes``)
    and ``root_positions [B]`` (committed length before the root) go to ``accepted_kv_moves``, whose position pairs
    are applied here: afterwards positions ``root .. root + num_accepted`` of request b hold the root and its
    accepted path in order, other slots are untouched. Returns the moves (positions, -1 = none). No host sync.
    """
    key_caches = [key_cache] if isinstance(key_cache, torch.Tensor) else list(key_cache)
    value_caches = [value_cache] if isinstance(value_cache, torch.Tensor) else list(value_cache)
    if len(key_caches) != len(value_caches):
        raise ValueError(f"{len(key_caches)} key caches but {len(value_caches)} value caches")
    moves = accepted_kv_moves(accepted_nodes, root_positions)
    if not key_caches:
        return moves
    block_size = key_caches[0].shape[2]
    # Padding moves copy the root onto itself: it is never a real source or destination, so the copies stay static
    # in shape and change nothing.
    root = root_positions.long()[:, None].expand_as(moves.sources)
    sources = torch.where(moves.sources >= 0, moves.sources, root)
    destinations = torch.where(moves.destinations >= 0, moves.destinations, root)
    table = block_table.long()

    def slots(positions: torch.Tensor) -> torch.Tensor:
        return (table.gather(1, positions // block_size) * block_size + positions % block_size).flatten()

    source_slots, destination_slots = slots(sources), slots(destinations)
    for cache, is_key in [(c, True) for c in key_caches] + [(c, False) for c in value_caches]:
        if cache.shape[2] != block_size:
            raise ValueError(f"caches of block sizes {block_size} and {cache.shape[2]} share one block table")
        view = token_major_view(cache, isa, is_key)
        # The gather copies every source before the scatter writes: an earlier move's source may be a later
        # move's destination (accepted_kv_moves' contract).
        block, outer, inner = _slot_coordinates(view, source_slots)
        moved = view[block, :, outer, inner]
        block, outer, inner = _slot_coordinates(view, destination_slots)
        view[block, :, outer, inner] = moved
    return moves
