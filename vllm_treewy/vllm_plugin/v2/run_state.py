"""The tree state that Model Runner V2's hooks carry across calls (`v2.runner`), owned by the MTP speculator
(`v2.speculator`)."""

from __future__ import annotations

from dataclasses import dataclass

from vllm_treewy.vllm_plugin.trees.run_state import TreeRunState
from vllm_treewy.vllm_plugin.trees.step import TreeStep
from vllm_treewy.vllm_plugin.trees.synthetic import SyntheticTreeRates
from vllm_treewy.vllm_plugin.v2.accept_graphs import TreeAcceptGraphs


@dataclass
class TreeRunStateV2(TreeRunState):
    """V1's tree state plus what V2's calls hand on: the step found in `prepare_attn`, kept for `sample`
    (`sampling_step`), and whether the drafter is capturing its first-pass graphs (no tree bias then)."""

    sampling_step: TreeStep | None = None
    capturing_drafter: bool = False
    profiling_capture: bool = False  # inside V2's graph-memory profiling: its captures are thrown away
    accept_graphs: TreeAcceptGraphs | None = None  # the post-sampler graphs (`v2.accept_graphs`), once captured
    synthetic: SyntheticTreeRates | None = None  # synthetic tree acceptance's rates by request slot (benchmarks only)
