"""Pearson's chi-square upper tail for the statistical tests (no scipy: torch's regularized incomplete gamma)."""

import torch


def chi2_sf(stat: float, dof: int) -> float:
    """P(X >= stat) for X chi-square distributed with `dof` degrees of freedom; 1 for dof <= 0."""
    if dof <= 0:
        return 1.0
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))
