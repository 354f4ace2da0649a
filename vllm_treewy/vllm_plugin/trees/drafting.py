"""What both runners' MTP tree drafters share (V1's `v1.proposer`, Model Runner V2's `v2.speculator`): a level's
children (the top tokens of each node's logits), the KV slots of a drafting level's block and the first pass's inputs
with each tree row's accepted path laid out as a chain. Device ops; no host sync.
"""

from __future__ import annotations

import torch

from vllm_treewy.kernels.accepted_chains_torch import accepted_chains_torch
from vllm_treewy.kernels.top_children_torch import top_children_torch
from vllm_treewy.spec_decode.acceptance import TreeAcceptance
from vllm_treewy.vllm_plugin.trees.step import TreeStep


PADDING_SLOT = -1  # vLLM's PADDING_SLOT_ID: the cache write skips the token


def top_children(logits: torch.Tensor, width: int) -> torch.Tensor:
    """`[M * width]` int64: the `width` most likely tokens after each of M nodes (`logits [M, vocab]`, fp32, bf16 or
    fp16), most likely first: the children of the nodes in breadth-first order. Distinct per node, so sampled
    acceptance can tell them apart; among equal logits the lowest token id first, NaN above every number
    (`kernels.top_children_torch` states the order). The split-vocab Triton kernel on CUDA (`top_children_triton`:
    two launches, capturable, inside the V2 drafting levels' graphs), the torch twin elsewhere (CPU engines)."""
    if logits.is_cuda:
        from vllm_treewy.kernels.top_children_triton import top_children_triton  # imports Triton: where used

        return top_children_triton(logits, width)
    return top_children_torch(logits, width)


def kv_slots(block_table: torch.Tensor, positions: torch.Tensor, block_size: int, max_model_len: int) -> torch.Tensor:
    """KV slots of `positions [R, n]` (request r's row of the block table); padding past max_model_len."""
    valid = positions < max_model_len
    clamped = positions.clamp(max=max_model_len - 1)
    blocks = block_table.gather(1, clamped // block_size)
    return torch.where(valid, blocks * block_size + clamped % block_size, PADDING_SLOT)


def accepted_paths_as_chains(step: TreeStep, acceptance: TreeAcceptance, token_ids, positions, hidden_states):
    """The first pass's inputs with every tree row's verified block laid out as its accepted path's chain
    (`kernels.accepted_chains_torch`): token ids and hidden states gathered, positions root + row. New tensors (Model
    Runner V2's drafter writes them into persistent buffers instead, with the one-launch kernel on CUDA)."""
    chains = torch.empty_like(token_ids), torch.empty_like(positions), torch.empty_like(hidden_states)
    accepted_chains_torch(step.token_indices.view(step.num_requests, step.block_len), acceptance.accepted_nodes,
                          step.root_positions, token_ids, positions, hidden_states, *chains)
    return chains
