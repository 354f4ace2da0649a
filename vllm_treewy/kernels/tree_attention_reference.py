"""Ground truth of tree attention over a paged prefix, in fp64: one dense masked softmax per token over the union of
its request's committed prefix and its ancestors-and-self among the verified block. Slow on purpose; the two-pass
path (`paged_prefix_attention_torch`, `tree_attention_ancestors_torch` / `_triton`, `attention_merge_torch`) is
tested against it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def tree_attention_reference(
    query: torch.Tensor,
    prefix_keys: Sequence[torch.Tensor],
    prefix_values: Sequence[torch.Tensor],
    block_keys: torch.Tensor,
    block_values: torch.Tensor,
    parents: Sequence[int],
    scale: float,
) -> torch.Tensor:
    """`[R, 1 + N, H, D]` fp64 outputs of R verified blocks of one tree.

    `query [R, 1 + N, H, D]`, `block_keys`/`block_values [R, 1 + N, H_kv, D]`: each request's verified block (root
    first, then the nodes); `prefix_keys[r]`/`prefix_values[r] [L_r, H_kv, D]`: request r's committed prefix (L_r may
    be 0); `parents [N]`: the tree's local parents (-1: child of the root). Block token i sees the whole prefix, and
    block token j when j is i or an ancestor of i."""
    num_requests, block_len, num_heads, _ = query.shape
    group = num_heads // block_keys.shape[2]
    visible = torch.eye(block_len, dtype=torch.bool)
    for node, parent in enumerate(parents):
        visible[1 + node] |= visible[1 + parent if parent >= 0 else 0]
    outputs = []
    for r in range(num_requests):
        keys = torch.cat([prefix_keys[r], block_keys[r]]).double().repeat_interleave(group, dim=1)
        values = torch.cat([prefix_values[r], block_values[r]]).double().repeat_interleave(group, dim=1)
        prefix_len = prefix_keys[r].shape[0]
        mask = torch.cat([torch.ones(block_len, prefix_len, dtype=torch.bool), visible], dim=1)  # [1 + N, L + 1 + N]
        scores = torch.einsum("ihd,jhd->hij", query[r].double(), keys) * scale
        scores = scores.masked_fill(~mask[None], float("-inf"))
        outputs.append(torch.einsum("hij,jhd->ihd", torch.softmax(scores, dim=-1), values))
    return torch.stack(outputs)
