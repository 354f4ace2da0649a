"""A read-only look at the GDN slots' count state through a running server, for soak tests and operators.

`SlotCountProbe` is a vLLM worker extension (`--worker-extension-cls
vllm_treewy.vllm_plugin.gdn.slot_count_probe.SlotCountProbe`): vLLM mixes it into its worker class, so
`collective_rpc("treewy_slot_counts")` (in `vllm serve`: POST /collective_rpc {"method": "treewy_slot_counts"} with
`VLLM_SERVER_DEV_MODE=1`, vLLM's development endpoints; `LLM.collective_rpc` in Python) returns, per worker, a summary
of each counted GDN group's count state (`gdn.pseudo_value_buffer`: 0, nothing pending, or 1 + the node a slot
accepted last). It reads the counts (one device-to-host copy, when called) and changes nothing.

What the summary means at an idle server: a slot whose last owner finished, was aborted or preempted right after a
speculative step keeps that step's count (its commit is pending, never run); the next owner's first step writes 0
there before any layer reads it (`gdn.step_metadata`), so a stale count is not a leak. What must hold at any time is
that every count names a node of the verified block: 0 <= count <= `max_count` (1 + the tree's nodes, or the chain's
drafts, plus the chain rows of `draft_tree_max_batch_size`).
"""

from __future__ import annotations

from vllm_treewy.vllm_plugin.config import draft_shape_of
from vllm_treewy.vllm_plugin.gdn.groups import counted_gdn_groups

PROBE_METHOD = "treewy_slot_counts"


def max_count(speculative_config) -> int:
    """The largest count a slot can hold: the last row of the commit table (tree rows then chain rows)."""
    shape = draft_shape_of(speculative_config)
    if shape.tree is None:
        return 1 + speculative_config.num_speculative_tokens
    if shape.has_chain_steps:
        return shape.chain_count_offset + 1 + shape.tree.max_depth
    return 1 + shape.tree.num_nodes


def summarize_counts(counts, limit: int) -> dict:
    """{slots, nonzero, out_of_range, max} of one group's `[S]` count state (slot 0 is vLLM's null block)."""
    host = counts.detach().to("cpu").long()
    return {"slots": int(host.numel()), "nonzero": int((host != 0).sum()),
            "out_of_range": int(((host < 0) | (host > limit)).sum()), "max": int(host.max()) if host.numel() else 0,
            "max_count": limit}


class SlotCountProbe:
    """Worker extension: `treewy_slot_counts()` -> {"groups": [summary per counted GDN group]} for this worker."""

    def treewy_slot_counts(self) -> dict:
        runner = self.model_runner
        limit = max_count(runner.vllm_config.speculative_config)
        return {"groups": [{"group": group_id, **summarize_counts(counts, limit)}
                           for group_id, counts in counted_gdn_groups(runner)]}
