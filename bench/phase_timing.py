"""Host time per engine step, by phase, without a profiler: named functions wrapped with `time.perf_counter`
(no device syncs, so nothing changes how the host queues work; on a host-bound step the host's time is the step's).

`install()` wraps, in this process only, vLLM's runner step and sampling, vLLM's MTP proposer, and the tree
path's drafting levels, head forwards and sampling; `PhaseTimes.report(steps)` gives each phase's mean host
microseconds per engine step (an engine step: one `execute_model`) and, for the drafting levels' head forwards,
the CUDA-graph runtime modes vLLM dispatched them to. Nested phases overlap (a level's time includes its head's).
"""

from __future__ import annotations

import functools
import time
from collections import Counter, defaultdict


class PhaseTimes:
    def __init__(self):
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: Counter = Counter()
        self.head_modes: Counter = Counter()

    def wrap(self, owner, name: str, label: str) -> None:
        original = getattr(owner, name)

        @functools.wraps(original)
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.seconds[label] += time.perf_counter() - start
                self.calls[label] += 1

        setattr(owner, name, timed)

    def reset(self) -> None:
        self.seconds.clear()
        self.calls.clear()
        self.head_modes.clear()

    def report(self) -> dict:
        steps = max(self.calls["engine step (execute_model)"], 1)
        return {"steps": steps,
                "us_per_step": {k: 1e6 * v / steps for k, v in sorted(self.seconds.items(), key=lambda kv: -kv[1])},
                "calls_per_step": {k: v / steps for k, v in self.calls.items()},
                "head_cudagraph_modes": dict(self.head_modes)}


def install() -> PhaseTimes:
    from vllm.forward_context import get_forward_context
    from vllm.v1.spec_decode.eagle import EagleProposer
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from vllm_treewy.vllm_plugin import tree_runner
    from vllm_treewy.vllm_plugin.mtp_tree_proposer import TreeMtpProposer

    times = PhaseTimes()
    times.wrap(GPUModelRunner, "execute_model", "engine step (execute_model)")
    times.wrap(GPUModelRunner, "sample_tokens", "sample_tokens (sampling + drafting)")
    times.wrap(GPUModelRunner, "_sample", "sampling (runner _sample)")
    times.wrap(EagleProposer, "propose", "vLLM MTP propose (chain, or the tree's first pass)")
    times.wrap(TreeMtpProposer, "_draft_levels", "tree levels")
    times.wrap(TreeMtpProposer, "_forward_level", "tree level forward")
    original_head = TreeMtpProposer._run_head

    def run_head(self, kwargs):
        times.head_modes[str(get_forward_context().cudagraph_runtime_mode)] += 1
        return original_head(self, kwargs)

    TreeMtpProposer._run_head = run_head
    times.wrap(TreeMtpProposer, "_run_head", "tree level head forward")
    times.wrap(tree_runner, "sample_with_trees", "tree sampling (sample_with_trees)")
    return times
