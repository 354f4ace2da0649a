"""Triton kernels (CUDA; CPU through TRITON_INTERPRET=1) for packed draft chains and trees: the GDN layer's
speculative step after the conv (`gdn_step`: the previous step's commit, then the verify, in two launches), the
speculative step of the tree causal conv1d (`conv_step`), the ancestor table (`_tree`) and the per-step updates of
the slots' verified-node counts (`slot_counts`). Torch twins: `vllm_treewy.kernels.gdn_step_torch`,
`vllm_treewy.kernels.conv_torch`, `_tree.ancestor_table_torch` and the `*_torch` functions of `slot_counts`."""

from ._tree import ancestor_table, ancestor_table_torch, ancestor_table_triton
from .conv_step import conv_step_triton
from .gdn_step import StepLaunch, gdn_commit_triton, gdn_step_triton, step_launch

__all__ = [
    "StepLaunch",
    "ancestor_table",
    "ancestor_table_torch",
    "ancestor_table_triton",
    "conv_step_triton",
    "gdn_commit_triton",
    "gdn_step_triton",
    "step_launch",
]
