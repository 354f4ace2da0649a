"""The accepted path's K/V compaction in a paged KV cache, in plain torch: the twin of `paged_kv_compaction_triton`
(the CPU path and the specification).

The cache is vLLM's logical ``[num_blocks, num_kv_heads, block_size, C]`` (TRITON_ATTN's and FLASH_ATTN's: keys then
values in the last axis, C = 2 * head_size; any physical stride order), a token's row being ``kv_cache.transpose(1,
2)[block, offset]``: every head's keys and values at once. The moves are `spec_decode.acceptance.accepted_kv_moves`'.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..spec_decode.acceptance import KVMoves, accepted_kv_moves


def compact_paged_kv_torch(
    kv_caches: torch.Tensor | Sequence[torch.Tensor],
    block_table: torch.Tensor,
    accepted_nodes: torch.Tensor,
    root_positions: torch.Tensor,
) -> KVMoves:
    """Moves each request's accepted path's K/V behind its root, in every given layer's cache.

    `kv_caches`: one layer's cache or a sequence of them (module docstring), all sharing `block_table [B,
    max_blocks]` (request b's logical positions to blocks). `accepted_nodes [B, D]` (`TreeAcceptance.accepted_nodes`)
    and `root_positions [B]` (committed length before the root) give `accepted_kv_moves`, applied here: afterwards
    positions root .. root + num_accepted of request b hold the root and its accepted path in order; no other slot
    changes. Returns the moves. Device ops of fixed shapes only (no host sync): capturable.
    """
    caches = [kv_caches] if isinstance(kv_caches, torch.Tensor) else list(kv_caches)
    moves = accepted_kv_moves(accepted_nodes, root_positions)
    # Padding moves copy the root onto itself (the root is never a real source or destination): static shapes.
    root = root_positions.long()[:, None].expand_as(moves.sources)
    sources = torch.where(moves.sources >= 0, moves.sources, root).flatten()
    destinations = torch.where(moves.destinations >= 0, moves.destinations, root).flatten()
    table = block_table.long()
    request = torch.arange(table.shape[0], device=table.device)[:, None].expand_as(moves.sources).flatten()
    for cache in caches:
        block_size = cache.shape[2]
        tokens = cache.transpose(1, 2)  # [num_blocks, block_size, num_kv_heads, C], a view
        # All sources are read before any write: an earlier move's source may be a later move's destination.
        moved = tokens[table[request, sources // block_size], sources % block_size]
        tokens[table[request, destinations // block_size], destinations % block_size] = moved
    return moves
