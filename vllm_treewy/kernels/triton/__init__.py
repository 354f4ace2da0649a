"""Triton kernels (CUDA; CPU through TRITON_INTERPRET=1) for packed draft chains and trees: fused verify, commit
in place (one layer or all layers in one launch), the speculative step of the tree causal conv1d (the previous
step's commit, then this step's conv), the fused GDN step, and the per-node serial baseline. Every kernel has a
torch twin in `vllm_treewy.kernels.closed_form` / `vllm_treewy.kernels.conv` / `vllm_treewy.kernels.gated` /
`vllm_treewy.kernels.serial_tree`. The per-step updates of the slots' verified-node counts, with their torch twins:
`slot_counts`."""

from ._tree import ancestor_table, ancestor_table_torch, ancestor_table_triton
from .commit import commit_layers_triton, commit_packed_triton, state_pool_table
from .conv import conv_step_triton
from .gated import gdn_commit_triton, gdn_step_triton, slot_factor_width, split_slot_factors
from .serial import serial_tree_triton
from .verify import PendingCommit, verify_packed_triton

__all__ = [
    "PendingCommit",
    "ancestor_table",
    "ancestor_table_torch",
    "ancestor_table_triton",
    "commit_layers_triton",
    "commit_packed_triton",
    "conv_step_triton",
    "gdn_commit_triton",
    "gdn_step_triton",
    "serial_tree_triton",
    "slot_factor_width",
    "split_slot_factors",
    "state_pool_table",
    "verify_packed_triton",
]
