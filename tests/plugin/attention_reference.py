"""The fp64 reference both tree-attention test modules hold vLLM's kernels to."""

import torch


def masked_attention_fp64(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                          mask: torch.Tensor, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """One request: `query [Q, num_heads, D]`, `keys`/`values [L, num_kv_heads, D]` (grouped query heads),
    `mask [Q, L]` True where a query sees a key; softmax attention in fp64, scale D^-1/2. `[Q, num_heads, D]`.
    `sinks [num_heads]`: attention sinks, a per-head logit in every row's softmax that carries no value."""
    num_heads, head_size = query.shape[1:]
    group = num_heads // keys.shape[1]
    q = query.double()
    k = keys.double().repeat_interleave(group, dim=1)
    v = values.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * head_size**-0.5
    scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is not None:
        sink_column = sinks.double()[:, None, None].expand(-1, scores.shape[1], 1)
        probabilities = torch.softmax(torch.cat([scores, sink_column], dim=-1), dim=-1)[..., :-1]
    else:
        probabilities = torch.softmax(scores, dim=-1)
    return torch.einsum("hqk,khd->qhd", probabilities, v)
