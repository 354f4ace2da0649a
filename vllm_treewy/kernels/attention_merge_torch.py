"""Two partial attentions over disjoint key sets merged into the attention over their union, by log-sum-exp.

With o_p = softmax over keys P, o_s over keys S (P and S disjoint) and l_p, l_s their log-sum-exps,
softmax over P u S gives o = (e^{l_p} o_p + e^{l_s} o_s) / (e^{l_p} + e^{l_s}): each partial softmax is the union's
restricted to its keys and rescaled by its share of the union's normaliser. Computed as weights
e^{l - max(l_p, l_s)} (no overflow). A log-sum-exp of +inf or -inf means "no keys" (FlashAttention 3 writes +inf for
an empty row), weight 0, and that side's output row is not read (it may hold anything, NaN included). The same
contract as vLLM's `merge_attn_states` (`vllm/v1/attention/ops/merge_attn_states.py`) on rows with keys; it is the
merge step of `tree_attention_ancestors_torch`, whose Triton twin folds the merge into its online softmax.
"""

from __future__ import annotations

import torch


def merge_attention_states_torch(
    output: torch.Tensor,
    prefix_output: torch.Tensor,
    prefix_lse: torch.Tensor,
    suffix_output: torch.Tensor,
    suffix_lse: torch.Tensor,
) -> torch.Tensor:
    """Writes the merged `[T, H, D]` into `output` (its dtype) and returns it. `*_output [T, H, D]`, `*_lse [H, T]`.
    At least one side of every row must have keys (the ancestor pass always holds the token itself); a row with none
    on both sides gets 0."""
    def weights_of(lse):
        lse = lse.float().transpose(0, 1)
        return torch.where(torch.isinf(lse), float("-inf"), lse)

    prefix, suffix = weights_of(prefix_lse), weights_of(suffix_lse)
    top = torch.maximum(prefix, suffix)
    top = torch.where(torch.isinf(top), 0.0, top)
    prefix_weight, suffix_weight = torch.exp(prefix - top), torch.exp(suffix - top)
    total = (prefix_weight + suffix_weight).clamp(min=torch.finfo(torch.float32).tiny)

    def share(side_output, weight):  # a side without keys (weight 0) adds 0, not 0 * its row (NaN * 0 = NaN)
        return torch.where(weight[..., None] > 0, side_output.float() * (weight / total)[..., None], 0.0)

    merged = share(prefix_output, prefix_weight) + share(suffix_output, suffix_weight)
    output.copy_(merged.to(output.dtype))
    return output
