"""Draft-tree speculative decoding pieces that need no vllm: greedy tree acceptance and the KV moves that compact
the accepted path (``acceptance``), the exact tree sampler (``tree_sampling``), the benchmark-only synthetic tree
acceptance (``synthetic_acceptance``), drafting a tree from an MTP head's logits level by level (``tree_drafting``),
and choosing each step between the tree and the chain of its depth from per-request acceptance estimates and measured
step costs (``acceptance_estimate``, ``shape_choice``: numpy only)."""

from .acceptance import (
    TreeAcceptance,
    KVMoves,
    accepted_kv_moves,
    accepted_kv_moves_reference,
    greedy_tree_acceptance,
    greedy_tree_acceptance_reference,
    verified_block_offsets,
)

__all__ = [
    "TreeAcceptance",
    "KVMoves",
    "accepted_kv_moves",
    "accepted_kv_moves_reference",
    "greedy_tree_acceptance",
    "greedy_tree_acceptance_reference",
    "verified_block_offsets",
]
