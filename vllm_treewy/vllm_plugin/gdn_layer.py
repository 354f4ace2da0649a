"""The GDN layer under reconstruct-on-commit: one state block per request, factors kept for the commit.

`ReconstructGatedDeltaNetAttention` replaces vLLM's `QwenGatedDeltaNetAttention` (out-of-tree layer
registration); with `mamba_state_commit="store_all"` it behaves exactly like its parent.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from vllm.model_executor.custom_op import op_registry_oot
from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import QwenGatedDeltaNetAttention

from vllm_treewy.vllm_plugin.config import reconstructs_mamba_state


@dataclass
class PendingCommit:
    """What one GDN layer's verify pass leaves for the commit: per draft node, its factors; per request, its slot.

    Requests are the batch's speculative decodes, in the order of `batch_rows` (their rows in the runner's
    input batch, where the number of accepted tokens is read after rejection sampling).
    """

    batch_rows: torch.Tensor  # [B] int64
    slots: torch.Tensor  # [B] state slot of each request
    parents: torch.Tensor  # [N] local parent index, -1 = child of the committed state
    cu_nodes: torch.Tensor  # [B + 1]
    conv_inputs: torch.Tensor  # [N, conv_dim] pre-conv inputs (the conv history continues with them)
    keys: torch.Tensor  # [N, H, K] as the recurrence consumed them
    pseudo_values: torch.Tensor  # [N, HV, V] u = beta * (v - alpha * h_parent k)
    log_decays: torch.Tensor  # [N, HV] g


class ReconstructGatedDeltaNetAttention(QwenGatedDeltaNetAttention):
    """Qwen3.5 / Qwen3-Next GDN layer that can verify drafts without writing a state per draft position."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.reconstructs_state = reconstructs_mamba_state(self.speculative_config)
        self.pending_commit: PendingCommit | None = None

    def get_kv_cache_spec(self, vllm_config):
        spec = super().get_kv_cache_spec(vllm_config)
        if not self.reconstructs_state:
            return spec
        # One state block per request: drafts are verified from the committed state, which the commit updates
        # in place, so no block per draft position is needed.
        return dataclasses.replace(spec, num_speculative_blocks=0)


def install() -> None:
    if op_registry_oot.get(QwenGatedDeltaNetAttention.__name__) is not ReconstructGatedDeltaNetAttention:
        QwenGatedDeltaNetAttention.register_oot(ReconstructGatedDeltaNetAttention)
