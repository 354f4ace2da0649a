"""What the reconstruct GDN layers derive from one step's GDN metadata, computed once per step.

vLLM hands every layer of a KV-cache group the same metadata object, so the first layer to ask builds the chains'
parents, the requests' batch rows (a host-mask lookup and a copy to the device) and the metadata of the batch's
non-speculative half; the other layers of the step reuse them.
"""

from __future__ import annotations

import dataclasses
from functools import cached_property

import torch
from vllm.v1.attention.backends.gdn_attn import GDNAttentionMetadata

from vllm_treewy.tree import chain_parents, node_requests


class SpecStep:
    def __init__(self, metadata: GDNAttentionMetadata, device: torch.device):
        self.metadata, self.device = metadata, device
        num_spec = metadata.num_spec_decodes
        self.slots = metadata.spec_state_indices_tensor[:num_spec, 0]
        self.cu_nodes = metadata.spec_query_start_loc[: num_spec + 1]

    @cached_property
    def parents(self) -> torch.Tensor:
        """`[N]` local parents of the packed draft chains."""
        return chain_parents(self.cu_nodes, self.metadata.num_spec_decode_tokens)

    @cached_property
    def node_slots(self) -> torch.Tensor:
        """`[N]` int64 state slot of each packed draft node (its request's)."""
        return self.slots.long()[self._node_requests]

    @cached_property
    def node_indices(self) -> torch.Tensor:
        """`[N]` int64 index of each packed draft node within its request (0 = the first speculative token)."""
        num_nodes = self.metadata.num_spec_decode_tokens
        return torch.arange(num_nodes, device=self.device) - self.cu_nodes.long()[self._node_requests]

    @cached_property
    def _node_requests(self) -> torch.Tensor:
        return node_requests(self.cu_nodes, self.metadata.num_spec_decode_tokens)

    @cached_property
    def batch_rows(self) -> torch.Tensor:
        """Rows of the runner's input batch (where the accepted counts land) of the speculative requests."""
        metadata, num_spec = self.metadata, self.metadata.num_spec_decodes
        masks = metadata.spec_sequence_masks_cpu
        if masks is None or metadata.num_prefills + metadata.num_decodes == 0:
            return torch.arange(num_spec, device=self.device)  # speculative decodes lead the batch
        return masks.nonzero().squeeze(1)[:num_spec].to(self.device, non_blocking=True)

    @cached_property
    def rest_metadata(self) -> GDNAttentionMetadata:
        """The batch's prefills and plain decodes, as vLLM's own GDN path sees a batch without speculation."""
        return dataclasses.replace(
            self.metadata, spec_sequence_masks=None, num_spec_decodes=0, num_spec_decode_tokens=0,
            spec_sequence_masks_cpu=None, spec_token_indx=None, non_spec_token_indx=None,
            spec_state_indices_tensor=None, spec_query_start_loc=None, num_accepted_tokens=None,
            num_actual_tokens=self.metadata.non_spec_token_indx.shape[0],
        )


_last: SpecStep | None = None


def spec_step(metadata: GDNAttentionMetadata, device: torch.device) -> SpecStep:
    """This step's `SpecStep`: built for a metadata object the first time a layer asks, then reused."""
    global _last
    if _last is None or _last.metadata is not metadata:
        _last = SpecStep(metadata, device)
    return _last
