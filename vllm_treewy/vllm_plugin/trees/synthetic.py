"""Synthetic tree acceptance's rates in the engine (`spec_decode.synthetic_acceptance`: a benchmark tool, not for real
outputs): the engine's rates from the speculative config (`rejection_sample_method: "synthetic"` with
`draft_tree_widths`, keys `synthetic_tree_acceptance_rates` and `synthetic_tree_sibling_rates`), a request's own
through `SamplingParams.extra_args` under the same keys (either or both; what it leaves out is the engine's), read
once when the request is added into a per-slot device tensor, so one batch mixes acceptance classes and the step
reads its rows' rates by their request slots (graph-capturable).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from vllm_treewy.spec_decode.synthetic_acceptance import FIRST_CHILD, LATER_SIBLING

FIRST_CHILD_KEY = "synthetic_tree_acceptance_rates"
SIBLING_KEY = "synthetic_tree_sibling_rates"
RATE_KEYS = (FIRST_CHILD_KEY, SIBLING_KEY)


def checked_rates(name: str, rates, depth: int) -> list[float]:
    """`rates` as floats, one per draft depth, each in [0, 1]; a ValueError naming `name` otherwise."""
    if (not isinstance(rates, Sequence) or isinstance(rates, str) or len(rates) != depth
            or not all(isinstance(r, (int, float)) and not isinstance(r, bool) for r in rates)):
        raise ValueError(f"{name} must be a list of {depth} probabilities (one per draft depth, conditional on the "
                         f"parent being accepted), got {rates!r}")
    if not all(0.0 <= float(r) <= 1.0 for r in rates):
        raise ValueError(f"{name} entries must be in [0, 1], got {list(rates)}")
    return [float(r) for r in rates]


def request_rates(extra_args: dict | None, depth: int) -> dict[str, list[float]]:
    """The rates a request's `extra_args` sets (checked), by key; empty when it sets none."""
    extra_args = extra_args or {}
    return {key: checked_rates(f"extra_args[{key!r}]", extra_args[key], depth) for key in RATE_KEYS
            if key in extra_args}


def unconditional_chain_rates(first_child_rates: Sequence[float]) -> list[float]:
    """vLLM's per-position unconditional rates of the chain with these rank-0 conditional rates: p_i = c_1 .. c_i."""
    rates, product = [], 1.0
    for rate in first_child_rates:
        product *= rate
        rates.append(product)
    return rates


class SyntheticTreeRates:
    """Per request slot, the conditional rates `[2, D]` (row 0 first child, row 1 later siblings, by depth) on the
    device; a slot gets the engine's rates, or the request's own, when a request is added to it."""

    def __init__(self, first_child_rates: Sequence[float], sibling_rates: Sequence[float], max_num_reqs: int,
                 device):
        self.depth = len(first_child_rates)
        self.engine_rates = {FIRST_CHILD_KEY: list(first_child_rates), SIBLING_KEY: list(sibling_rates)}
        self.by_slot = torch.zeros(max_num_reqs, 2, self.depth, dtype=torch.float32, device=device)
        self.by_slot[:, FIRST_CHILD] = torch.tensor(first_child_rates, dtype=torch.float32, device=device)
        self.by_slot[:, LATER_SIBLING] = torch.tensor(sibling_rates, dtype=torch.float32, device=device)

    @classmethod
    def of(cls, speculative_config, max_num_reqs: int, device) -> SyntheticTreeRates | None:
        """The engine's rates when its config asks for synthetic tree acceptance (validated there), else None."""
        first = getattr(speculative_config, FIRST_CHILD_KEY, None)
        if getattr(speculative_config, "rejection_sample_method", None) != "synthetic" or first is None:
            return None
        return cls(first, getattr(speculative_config, SIBLING_KEY), max_num_reqs, device)

    def add_request(self, slot: int, extra_args: dict | None) -> None:
        """The slot's rates for a new request: its `extra_args`' rates over the engine's. One small host-to-device
        copy per request (from pinned memory where the device is CUDA: no sync)."""
        rates = {**self.engine_rates, **request_rates(extra_args, self.depth)}
        row = torch.tensor([rates[FIRST_CHILD_KEY], rates[SIBLING_KEY]], dtype=torch.float32)
        if self.by_slot.is_cuda:
            row = row.pin_memory()
        self.by_slot[slot].copy_(row, non_blocking=True)
