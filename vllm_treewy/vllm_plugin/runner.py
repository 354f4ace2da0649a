"""The commit step in vLLM's V1 model runner: after rejection sampling, before the next draft.

`GPUModelRunner._update_states_after_model_execute` (which the CPU runner inherits) is where vLLM learns how
many tokens each request accepted; right after it, every reconstruct GDN layer rebuilds its accepted states.
Requests that finish, abort or get preempted after this step need nothing: their slot is freed or refilled by
a prefill, and every commit runs in the step of its verify (the factors in a slot's pseudo-value buffer are read
only by the commit that follows their own verify).
"""

from __future__ import annotations

import functools

from vllm_treewy.vllm_plugin.gdn_layer import ReconstructGatedDeltaNetAttention
from vllm_treewy.vllm_plugin.patch_points import RUNNER_AFTER_SAMPLING
from vllm_treewy.vllm_plugin.reconstruct import accepted_nodes


def commit_accepted_states(runner) -> None:
    num_accepted = runner.num_accepted_tokens.gpu
    batch_rows = accepted = None
    for layer in runner.compilation_config.static_forward_context.values():
        if isinstance(layer, ReconstructGatedDeltaNetAttention) and layer.pending_step is not None:
            if layer.pending_step.batch_rows is not batch_rows:  # the layers of a step share their rows
                batch_rows = layer.pending_step.batch_rows
                accepted = accepted_nodes(num_accepted, batch_rows)
            layer.commit_pending(accepted)


def install() -> None:
    original = RUNNER_AFTER_SAMPLING.resolve()
    if getattr(original, "commits_reconstructed_states", False):
        return

    @functools.wraps(original)
    def update_states_after_model_execute(self, output_token_ids, scheduler_output):
        original(self, output_token_ids, scheduler_output)
        commit_accepted_states(self)

    update_states_after_model_execute.commits_reconstructed_states = True
    RUNNER_AFTER_SAMPLING.replace(update_states_after_model_execute)
