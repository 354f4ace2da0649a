"""Tree acceptance on Model Runner V2's logits layout: the sampling path of `v2.runner`'s hook 3 (its module
docstring, 3., says why it is exact): one draw per logits row from V2's sampler, the one-call walk over them, V2's
output rows, and the compaction, GDN slots' accepted leaves and acceptance for the drafter. Everything after V2's
draws that has static shapes is one function, `accept_and_commit_tree_rows`: run eagerly, or replayed as a CUDA graph
for steps whose requests are all tree rows (`v2.accept_graphs`).
"""

from __future__ import annotations

import torch
from vllm.config.model import PROCESSED_LOGPROBS_MODES

from vllm_treewy.vllm_plugin.trees.step import TreeStep
from vllm_treewy.vllm_plugin.v2.acceptance import accept_and_commit_tree_rows
from vllm_treewy.vllm_plugin.v2.accepted_counts import leaf_counts_of
from vllm_treewy.vllm_plugin.v2.run_state import TreeRunStateV2


def sample_tree_step(runner, hidden_states: torch.Tensor, input_batch, step: TreeStep, state: TreeRunStateV2):
    """V2's `sample` for a step with tree rows: `(SamplerOutput, num_sampled, num_rejected)` as V2's rejection
    sampler gives them; then the compaction, the GDN slots' accepted leaves, and the acceptance for the drafter.
    A step whose requests are all tree rows replays the captured graph of `accept_and_commit_tree_rows` where one
    holds the batch (`TreeAcceptGraphs.replay`); any other runs it eagerly."""
    # Model Runner V2's modules looked up at call time, where V2 samples (CUDA; tests stand them in)
    from vllm.v1.worker.gpu.input_batch import get_num_sampled_and_rejected
    from vllm.v1.worker.gpu.sample.output import SamplerOutput
    from vllm.v1.worker.gpu.sample.states import NO_LOGPROBS

    sampler = runner.sampler
    logits = runner.model.compute_logits(hidden_states[input_batch.logits_indices])
    rows = input_batch.logits_indices
    upper_bound = input_batch.seq_lens_cpu_upper_bound.numpy()
    draws, processed = sampler.sample(
        logits, input_batch.expanded_idx_mapping, input_batch.idx_mapping, input_batch.idx_mapping_np,
        input_batch.positions[rows], input_batch.input_ids[rows], input_batch.expanded_local_pos, upper_bound)
    graphs = state.accept_graphs
    result = None if graphs is None else graphs.replay(step, draws, input_batch)
    if result is None:
        result = accept_and_commit_tree_rows(step, draws, input_batch.cu_num_logits, input_batch.input_ids,
                                             runner.num_speculative_steps, input_batch.idx_mapping,
                                             leaf_counts_of(runner), state.synthetic)
    num_sampled, num_rejected = get_num_sampled_and_rejected(
        result.num_sampled, input_batch.seq_lens, input_batch.cu_num_logits, input_batch.idx_mapping,
        sampler.req_states.prefill_len.gpu)
    logprobs = None
    max_num_logprobs = sampler.sampling_states.max_num_logprobs(input_batch.idx_mapping_np)
    if max_num_logprobs != NO_LOGPROBS:
        source = processed if sampler.logprobs_mode in PROCESSED_LOGPROBS_MODES else logits
        logprobs = runner.rejection_sampler._get_logprobs_tensors(
            result.sampled, num_sampled, source[result.chain_rows], input_batch.cu_num_logits,
            input_batch.cu_num_logits_np, max_num_logprobs)
    state.accepted = (step, result.acceptance)
    output = SamplerOutput(sampled_token_ids=result.sampled, logprobs_tensors=logprobs, num_nans=None,
                           num_sampled=num_sampled, num_rejected=num_rejected)
    return output, num_sampled, num_rejected
