"""Which path the runner's bookkeeping takes: the one-launch Triton kernels on CUDA (`slot_counts_triton`,
`boundary_states_triton`), their torch twins elsewhere (`slot_counts_torch`, `boundary_states_torch`: vLLM's CPU
backend, where no GPU kernel runs). The adapter asks `launches_triton` once per call site; tests and host-time
benchmarks replace it to run either path on any device."""

from __future__ import annotations

import torch

from .slot_counts_torch import commit_nodes_and_counts_torch
from .slot_counts_triton import commit_nodes_and_counts_triton


def launches_triton(counts: torch.Tensor) -> bool:
    """The one-launch kernels on CUDA; the torch twins elsewhere (vLLM's CPU backend, where no GPU kernel runs)."""
    return counts.is_cuda


def commit_nodes_and_counts(
    counts: torch.Tensor,
    *,
    batch_slots: torch.Tensor | None = None,
    spec_query_start_loc: torch.Tensor | None = None,
    slots: torch.Tensor | None = None,
    commit_nodes: torch.Tensor | None = None,
    non_spec_slots: torch.Tensor | None = None,
    null_block: int,
    accepted: torch.Tensor | None = None,
) -> None:
    """The step's count update at the start of the forward (`slot_counts_torch.commit_nodes_and_counts_torch`'s
    contract), on the path `launches_triton` picks for `counts`."""
    update = commit_nodes_and_counts_triton if launches_triton(counts) else commit_nodes_and_counts_torch
    update(counts, batch_slots, spec_query_start_loc, slots, commit_nodes, non_spec_slots, null_block, accepted)
