"""The fp64 reference both tree-attention test modules hold vLLM's kernels to."""

import torch


def masked_attention_fp64(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                          mask: torch.Tensor) -> torch.Tensor:
    """One request: `query [Q, num_heads, D]`, `keys`/`values [L, num_kv_heads, D]` (grouped query heads),
    `mask [Q, L]` True where a query sees a key; softmax attention in fp64, scale D^-1/2. `[Q, num_heads, D]`."""
    num_heads, head_size = query.shape[1:]
    group = num_heads // keys.shape[1]
    q = query.double()
    k = keys.double().repeat_interleave(group, dim=1)
    v = values.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * head_size**-0.5
    probabilities = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
    return torch.einsum("hqk,khd->qhd", probabilities, v)
