"""Draft-tree speculative decoding pieces that need no vllm: greedy tree acceptance and the KV moves that compact
the accepted path (``acceptance``). Tree drafting from MTP logits and the verification budget are not written yet."""

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
