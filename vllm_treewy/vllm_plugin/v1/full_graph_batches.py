"""Which batches vLLM may replay in a FULL CUDA graph under reconstruct (chains and draft trees).

vLLM's runner counts a batch as a uniform decode when every request has the tokens of one speculative decode
(1 + drafts) - also when one of them is a prompt chunk of exactly that length (`GPUModelRunner._is_uniform_decode`)
- and replays its FULL decode graph. The GDN metadata builder stages a step's speculative slots (and ours, its commit
nodes) into the graph's buffers only for batches without prefills (`_stage_spec_decode`), so that replay would verify
and commit into the slots of the previous step's requests; a tree's attention would also mask the chunk as a tree.
Such a batch runs PIECEWISE instead (`force_uniform_decode=False`). vLLM's own store_all path has the same hazard;
it is left as vLLM has it.
"""

from __future__ import annotations

import functools

from vllm_treewy.vllm_plugin.config import reconstructs_mamba_state
from vllm_treewy.vllm_plugin.patch_points import RUNNER_DETERMINE_BATCH_EXECUTION


def holds_prompt_chunk_of_decode_length(runner, num_tokens: int, num_reqs: int, max_num_scheduled_tokens: int) -> bool:
    """A batch vLLM takes for a uniform decode, of which a row verifies no drafts (after `_prepare_inputs`,
    `num_decode_draft_tokens` is the step's drafts per row, -1 for a prompt chunk)."""
    looks_uniform = (max_num_scheduled_tokens == runner.uniform_decode_query_len
                     and num_tokens == max_num_scheduled_tokens * num_reqs)
    return looks_uniform and bool((runner.num_decode_draft_tokens.np[:num_reqs] < 0).any())


def _keeping_prompt_chunks_out_of_full_graphs(original):
    @functools.wraps(original)
    def determine_batch_execution_and_padding(self, num_tokens, num_reqs, num_scheduled_tokens_np,
                                              max_num_scheduled_tokens, *args, **kwargs):
        # force_uniform_decode is set by vLLM's dummy runs (profile, capture) only: a real step leaves it None
        if (kwargs.get("force_uniform_decode") is None and reconstructs_mamba_state(self.speculative_config)
                and holds_prompt_chunk_of_decode_length(self, num_tokens, num_reqs, max_num_scheduled_tokens)):
            kwargs["force_uniform_decode"] = False
        return original(self, num_tokens, num_reqs, num_scheduled_tokens_np, max_num_scheduled_tokens, *args,
                        **kwargs)

    return determine_batch_execution_and_padding


def install() -> None:
    RUNNER_DETERMINE_BATCH_EXECUTION.wrap(_keeping_prompt_chunks_out_of_full_graphs)
