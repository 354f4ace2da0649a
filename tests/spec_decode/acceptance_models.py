"""Helpers shared by the acceptance-estimate and shape-choice tests: an fp64 numpy simulation of the synthetic
acceptance model, node by node, and the two workload classes the README's tree figures use."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

CODE_LIKE_UNCONDITIONAL = [0.917, 0.837, 0.648]  # per-position (vLLM's meaning): the README's code-like class
CODE_LIKE_RANK0 = [CODE_LIKE_UNCONDITIONAL[0]] + [  # conditional: 0.917, 0.913, 0.774
    later / earlier for earlier, later in zip(CODE_LIKE_UNCONDITIONAL, CODE_LIKE_UNCONDITIONAL[1:])]
PROSE_LIKE_RANK0 = [0.55, 0.55, 0.55]
SIBLING = 0.4  # the README's synthetic sibling rate


def rates_of(rank0: Sequence[float], sibling: float | Sequence[float]) -> np.ndarray:
    """``[2, D]`` synthetic rates (rank 0, later sibling)."""
    sibling = [sibling] * len(rank0) if np.isscalar(sibling) else list(sibling)
    return np.array([list(rank0), sibling], dtype=np.float64)


def simulate_accepted(rng: np.random.Generator, widths: Sequence[int], rates: np.ndarray, tree: bool,
                      num_drafts: np.ndarray | None = None) -> np.ndarray:
    """``[R]`` drafts accepted under the synthetic model for per-row ``rates [R, 2, D]``: the walk looks at the
    children of its current node (w_d of them in the tree, one in a chain), each carrying the target's token with
    its rank's rate (rank 0: ``rates[:, 0, d]``, later: ``rates[:, 1, d]``), and moves to the first that carries,
    stopping where none does. A chain of ``num_drafts [R]`` (default D) stops after its last draft."""
    num_rows, depth = rates.shape[0], rates.shape[-1]
    going = np.ones(num_rows, dtype=bool)
    accepted = np.zeros(num_rows, dtype=np.int64)
    limit = np.full(num_rows, depth) if num_drafts is None else np.asarray(num_drafts)
    for d in range(depth):
        width = widths[d] if tree else 1
        child_rates = np.concatenate([rates[:, :1, d], np.repeat(rates[:, 1:, d], width - 1, axis=1)], axis=1)
        carries = (rng.random((num_rows, width)) < child_rates).any(axis=1)
        going &= carries & (d < limit)
        accepted += going
    return accepted
