"""The address tables that the runner's after-sampling hooks launch with, kept by the model's GDN layer rather than
on vLLM's runner.

Right after sampling, one launch covers every GDN group (`v1.accepted_counts` on V1, `v2.accepted_counts` on Model
Runner V2: the count table of `kernels.bookkeeping.slot_counts_triton`) or every reconstruct GDN layer
(`gdn.prefix_caching` on V1: the boundary table of `kernels.bookkeeping.boundary_states_triton`). Each table holds the
addresses of the layers' states in vLLM's KV cache and of the runner's device block tables; building one is an
allocation and a host-to-device copy, so it is built once and rebuilt only where one of those addresses changed (a KV
cache bound anew). """

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch

from vllm_treewy.kernels.bookkeeping import slot_counts_triton
from vllm_treewy.vllm_plugin.gdn.groups import first_gdn_layer

T = TypeVar("T")


class SamplingTables:
    """The runner's after-sampling tables by name (`"count"`: `count_table_of`; `"boundary"`: `gdn.prefix_caching`'s
    boundary layers and table), each with the addresses it was built from. Owned by the first layer of the model's first
    GDN group (`of_runner`; every GDN layer that keeps slot counts has one as `gdn.sampling_tables`, the others'
    unused), so nothing is added to vLLM's runner; it lives as long as that layer (the model's life, one runner's)."""

    def __init__(self):
        self._tables: dict[str, tuple[tuple, Any]] = {}

    def get(self, name: str, addresses: tuple, build: Callable[[], T]) -> T:
        """The table `name`; `build()` makes it anew where `addresses` differ from the ones it was built from."""
        kept = self._tables.get(name)
        if kept is None or kept[0] != addresses:
            self._tables[name] = kept = (addresses, build())
        return kept[1]


def of_runner(runner) -> SamplingTables | None:
    """The runner's tables (V1 or V2 runner): those of the first layer of its first GDN group, where that layer keeps
    slot counts; None otherwise."""
    return getattr(first_gdn_layer(runner), "sampling_tables", None)


def count_table_of(runner, groups) -> torch.Tensor:
    """The groups' `count_table` (`(count state, block table)` per GDN group), one of the runner's tables (V1 or V2
    runner): built again only where a count state or block table moved."""
    addresses = tuple((counts.data_ptr(), block_table.data_ptr()) for counts, block_table in groups)
    return of_runner(runner).get("count", addresses, lambda: slot_counts_triton.count_table(groups))
