"""Sampling of a step with draft-tree rows: greedy tree acceptance, then the accepted path made into what vLLM
expects of a chain.

The target's argmax at every verified token decides (`greedy_tree_acceptance`); each tree row's output becomes
`[accepted path tokens..., bonus, -1...]`, so vLLM's bookkeeping counts num_accepted_tokens = accepted + 1 and
advances num_computed_tokens past the root and the accepted path. For that to hold, right after acceptance:

- full-attention K/V of the accepted path move behind the root (`compact_accepted_kv`, every layer the step's
  forward recorded), where vLLM's next steps read positions num_computed .. ;
- each GDN slot's count state (in vLLM's KV cache, `pseudo_value_buffer`) records 1 + the verified-block index of
  the accepted leaf, which the next step's GDN metadata turns into the node its commit follows (`step_metadata`).

Greedy only: other sampling, logprobs or logit processors would need a tree rejection sampler (refused here).
"""

from __future__ import annotations

import torch

from vllm_treewy.spec_decode.acceptance import GreedyTreeAcceptance, greedy_tree_acceptance
from vllm_treewy.vllm_plugin.tree_attention_cpu import compact_accepted_kv
from vllm_treewy.vllm_plugin.tree_attention_triton import compact_accepted_kv_paged
from vllm_treewy.vllm_plugin.tree_step import PagedLayerCaches, TreeStep

PLACEHOLDER_TOKEN = -1  # vLLM's padding of sampled_token_ids


def check_greedy(sampling_metadata) -> None:
    if not sampling_metadata.all_greedy or sampling_metadata.max_num_logprobs is not None:
        raise ValueError("draft_tree_widths verifies draft trees greedily only: use temperature=0 and no logprobs "
                         "with tree drafting (a tree rejection sampler is future work)")


def tree_output_rows(step: TreeStep, draft_tokens: torch.Tensor, block_argmax: torch.Tensor
                     ) -> tuple[torch.Tensor, GreedyTreeAcceptance]:
    """`[R, depth + 1]` rows `[path tokens..., bonus, -1...]` of the tree rows, and the acceptance.

    `draft_tokens [R * N]`: the rows' drafts in node order; `block_argmax [R * (1 + N)]`: the target's argmax at
    every verified-block token."""
    num_requests, num_nodes = step.num_requests, step.tree.num_nodes
    acceptance = greedy_tree_acceptance(step.parents, step.cu_nodes, draft_tokens, block_argmax, step.depth)
    drafts = draft_tokens.long().view(num_requests, num_nodes)
    path = acceptance.accepted_nodes
    path_tokens = torch.where(path >= 0, drafts.gather(1, path.clamp(min=0)), PLACEHOLDER_TOKEN)
    rows = torch.cat([path_tokens, torch.full_like(path_tokens[:, :1], PLACEHOLDER_TOKEN)], dim=1)
    rows.scatter_(1, acceptance.num_accepted[:, None], acceptance.bonus_tokens[:, None])
    return rows, acceptance


def sample_with_trees(logits: torch.Tensor, spec_decode_metadata, step: TreeStep, num_reqs: int
                      ) -> tuple[torch.Tensor, GreedyTreeAcceptance]:
    """`sampled_token_ids [num_reqs, 1 + N]` of a greedy step with tree rows (other rows: one greedy token), after
    the accepted paths' K/V compaction; and the tree rows' acceptance."""
    argmax = logits.argmax(dim=-1)
    device = argmax.device
    sampled_end = spec_decode_metadata.cu_num_sampled_tokens.long()  # each row's drafts + 1, summed: on the device
    out = torch.full((num_reqs, step.block_len), PLACEHOLDER_TOKEN, dtype=torch.long, device=device)
    out[:, 0] = argmax[sampled_end - 1]  # a row without drafts samples one token, at its last logit
    block_rows = (sampled_end[step.request_indices] - step.block_len)[:, None] + torch.arange(step.block_len,
                                                                                               device=device)
    # Only tree rows have drafts (partial trees are refused), so the drafts are theirs, in row order.
    rows, acceptance = tree_output_rows(step, spec_decode_metadata.draft_token_ids, argmax[block_rows.flatten()])
    out[step.request_indices] = PLACEHOLDER_TOKEN
    out[step.request_indices, : rows.shape[1]] = rows
    commit_accepted_path(step, acceptance)
    return out, acceptance


def commit_accepted_path(step: TreeStep, acceptance: GreedyTreeAcceptance) -> None:
    """Compacts the recorded full-attention layers' K/V along each accepted path (CPU layout or TRITON_ATTN's)."""
    for layer in step.attention_layers:
        if isinstance(layer, PagedLayerCaches):
            compact_accepted_kv_paged(layer.kv_cache, layer.block_table, acceptance.accepted_nodes,
                                      step.root_positions)
        else:
            compact_accepted_kv(layer.key_cache, layer.value_cache, layer.block_table, acceptance.accepted_nodes,
                                step.root_positions, isa=layer.isa)


def record_accepted_leaves(counts: torch.Tensor, slots: torch.Tensor, acceptance: GreedyTreeAcceptance) -> None:
    """A GDN layer's slot counts after acceptance: 1 + the verified-block index of the accepted leaf (1 = the root:
    nothing accepted), still > 0, so the slot's next step commits that node (`step_metadata`)."""
    counts[slots] = (acceptance.last_accepted_node + 2).to(counts.dtype)
