"""Host time per engine step, by phase, of the draft-tree path (no profiler, no device syncs): `step_timers.StepTimers`
(as `gpu_host_audit` uses them) over vLLM's runner step and sampling, vLLM's MTP proposer, and the tree path's drafting
levels, head forwards and sampling, plus the CUDA-graph mode vLLM dispatched each level's head forward to.

`install()` wraps them in this process; `report(timers)` gives each phase's host microseconds and calls per engine
step (an engine step: one `execute_model`). Nested phases overlap (a level's time includes its head's).
"""

from __future__ import annotations

from bench.host.step_timers import StepTimers

STEP = "engine step (execute_model)"


def install() -> StepTimers:
    from vllm.forward_context import get_forward_context
    from vllm.v1.spec_decode.eagle import EagleProposer
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from vllm_treewy.vllm_plugin.v1 import runner as tree_runner
    from vllm_treewy.vllm_plugin.v1.proposer import TreeMtpProposer

    timers = StepTimers()
    original_head = TreeMtpProposer._run_head

    def run_head(self, kwargs):
        timers.cudagraph_modes[f"tree level head: {get_forward_context().cudagraph_runtime_mode}"] += 1
        return original_head(self, kwargs)

    TreeMtpProposer._run_head = run_head
    for owner, name, label in (
            (GPUModelRunner, "execute_model", STEP),
            (GPUModelRunner, "sample_tokens", "sample_tokens (sampling + drafting)"),
            (GPUModelRunner, "_sample", "sampling (runner _sample)"),
            (EagleProposer, "propose", "vLLM MTP propose (chain, or the tree's first pass)"),
            (TreeMtpProposer, "_draft_levels", "tree levels"),
            (TreeMtpProposer, "_forward_level", "tree level forward"),
            (TreeMtpProposer, "_run_head", "tree level head forward"),
            (tree_runner, "sample_with_trees", "tree sampling (sample_with_trees)")):
        timers.wrap(owner, name, label)
    return timers


def report(timers: StepTimers) -> dict:
    steps = max(timers.calls[STEP], 1)
    return {"steps": steps, "phases": timers.per_step(steps), "cudagraph_modes": dict(timers.cudagraph_modes)}
