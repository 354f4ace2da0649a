"""What the draft-tree path carries from one of vLLM's runner calls to the next: one object, owned by the runner's
tree drafter (`TreeMtpProposer`, or a custom_class drafter such as the test drafter), so that nothing is added to
vLLM's runner, layers or metadata and nothing lives in module globals.

Per step, in the order vLLM calls the runner: `_prepare_inputs` finds the step's tree rows (`pending_step`, and
`prepared`: the metadata about to be built is a real step's, not a dummy run's); `_build_attention_metadata`
takes them onto the step's attention metadata (`trees.metadata.with_tree`) and clears both; `_sample` accepts
and leaves `accepted` for the MTP proposer's `propose` of the same step, which consumes it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from vllm_treewy.spec_decode.acceptance import TreeAcceptance
from vllm_treewy.tree import DraftTree
from vllm_treewy.vllm_plugin.trees.attention_flash import prefix_lengths, tree_block_ancestors
from vllm_treewy.vllm_plugin.trees.attention_triton import tree_qq_bias
from vllm_treewy.vllm_plugin.trees.step import TreeStep


@dataclass
class TreeRunState:
    tree: DraftTree
    pending_step: TreeStep | None = None
    prepared: bool = False
    accepted: tuple[TreeStep, TreeAcceptance] | None = None
    backends_checked: bool = False  # the layers' attention backends and settings, checked once
    # draft_tree_max_batch_size: the depth of the chains that larger batches verify (0: every step verifies the tree)
    chain_depth: int = 0
    # Tree biases (TRITON_ATTN) by node count: built once; CUDA graphs keep their addresses.
    qq_biases: dict[int, torch.Tensor] = field(default_factory=dict)
    # Ancestor tables (FLASH_ATTN) by node count: built once; CUDA graphs keep their addresses.
    block_ancestor_tables: dict[int, torch.Tensor] = field(default_factory=dict)
    # FLASH_ATTN prefix lengths, one int32 buffer per vLLM sequence-length buffer (by its storage's address and
    # size): made at first use, never replaced while that buffer lives; CUDA graphs keep their addresses.
    prefix_lens_buffers: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)

    def qq_bias(self, tree: DraftTree, device) -> torch.Tensor:
        if tree.num_nodes not in self.qq_biases:
            self.qq_biases[tree.num_nodes] = tree_qq_bias(tree, device)
        return self.qq_biases[tree.num_nodes]

    def block_ancestors(self, tree: DraftTree, device) -> torch.Tensor:
        if tree.num_nodes not in self.block_ancestor_tables:
            self.block_ancestor_tables[tree.num_nodes] = tree_block_ancestors(tree, device)
        return self.block_ancestor_tables[tree.num_nodes]

    def prefix_lens(self, seq_lens: torch.Tensor, query_start_loc: torch.Tensor) -> torch.Tensor:
        """`[R]` int32 `prefix_lengths(seq_lens, query_start_loc)` of a step's FLASH_ATTN metadata, written into a
        persistent buffer: a FULL CUDA graph captured over this metadata reads them at the buffer's address, and each
        step's hand-over (outside the graph, before its replay) rewrites them. vLLM's `seq_lens` (int32) is a view
        of its own persistent buffer (`[:num_reqs_padded]`, or a micro-batch's slice), so the buffer mirrors that
        one: the same size, the lengths at the same offset; views of one vLLM buffer share one mirror and micro-batches
        keep apart."""
        storage = seq_lens.untyped_storage()
        size = storage.nbytes() // seq_lens.element_size()
        key = (storage.data_ptr(), size)
        if key not in self.prefix_lens_buffers:
            self.prefix_lens_buffers[key] = torch.zeros(size, dtype=torch.int32, device=seq_lens.device)
        offset = seq_lens.storage_offset()
        out = self.prefix_lens_buffers[key][offset : offset + seq_lens.numel()]
        return prefix_lengths(seq_lens, query_start_loc, out=out)


def tree_state_of(runner) -> TreeRunState | None:
    """The runner's tree state: its drafter's (None for chains). A tree configured with a drafter that keeps none
    is refused: it would not propose trees in node order."""
    drafter = getattr(runner, "drafter", None)
    state = getattr(drafter, "tree_state", None)
    if state is None and getattr(runner.speculative_config, "is_draft_tree", False):
        raise ValueError(f"draft_tree_widths: the drafter {type(drafter).__name__} does not draft trees (a tree "
                         "drafter keeps a vllm_treewy.vllm_plugin.trees.run_state.TreeRunState as `tree_state`)")
    return state
