"""What the reconstruct GDN layers need per step, derived once per step by vLLM's GDN metadata builder.

Each step commits every speculative request's previous verify inside its own verify (one state read and write). The
slot's count state (in the group's first GDN layer's page, on the device) says which node: 0 when nothing
is pending, else 1 + the accepted node's index in the slot's last verified block, recorded right after that step's
sampling (`v1.accepted_counts` for chains, `v1.sampler` for draft trees). The step's count update turns it into each
row's commit node, then records this step's counts: the speculative rows' node counts (until their sampling records
the accepted ones), and 0 for every other row, so a slot that a finished, aborted or preempted request left behind
with a pending commit is never committed into by its next owner. A store_all draft tree keeps the same count: its
commit node is the block the next step starts from (`gdn.store_all_tree`).

Chains on Model Runner V2 without prefix caching of GDN states (`runner_accepted_counts`) record nothing after
sampling: V2 keeps each request's accepted count itself (`num_accepted_tokens`: 1 + the accepted drafts of its last
step, kept per request state for the request's life, written right after sampling like the count state was), and hands
it to this builder for every speculative row. There the slot's count only says whether a verify is pending (its node
count), and the count update commits `min(count, accepted) - 1` (`kernels.bookkeeping.slot_counts_torch`): the node
the recorded count would have named, without a launch after sampling.

The count update runs where it costs no host time: in a batch with speculative rows, the group's first GDN layer
launches it at the start of its forward (`update_counts`, which also reads its arguments there), before any layer of
the group reads the commit nodes, so a FULL CUDA graph captures it and replays it for free, and the build prepares
nothing of it; in a batch without any (prefills only), the builder runs it. One Triton launch on CUDA
(`kernels.bookkeeping.slot_counts_triton`), torch ops elsewhere; no host sync either way.

Both runners call the builder's `build` (Model Runner V2 for the first GDN group of a spec; for each further group it
re-gathers the state indices, which `v2.accepted_counts` follows with `with_commit_nodes` too: each group commits its
own slots).

Draft trees (a static shape, `draft_tree_widths`): a request's verified tokens are a prefix of the tree's verified
block (1 + N tokens, or the root alone for a decode that got no drafts), so their parents and ancestors are rows of
the tree's one ancestor table. With `draft_tree_max_batch_size` a step verifies trees or chains of the tree's depth
D (`trees.budget`: never both), and commits what each slot verified last, of either shape: the commit follows
`commit_ancestor_table`, the tree's verified block (rows 0 .. N) then the chain's (rows N + 1 .. N + 1 + D), and a
chain's count is recorded with the offset `DraftShape.chain_count_offset` (1 + N), so count c names tree node c - 1 for
c <= 1 + N and chain block index c - (2 + N) beyond. The step's own count update writes each speculative row's node
count without the offset: the step's sampling overwrites it for every speculative row (`v1.accepted_counts`,
`v1.sampler`, `v2.accepted_counts`) before any later step reads it, and a count of 1 (the root alone) means the same in
both shapes. In FULL-graph batches the state indices and commit nodes go to persistent buffers, like vLLM's own GDN
metadata.
What the builds keep across steps (those buffers, the tree's table, the config's `DraftShape`) is the group's
`GroupStepBuffers`, which the group's counts layer owns: nothing is added to vLLM's builders. """

from __future__ import annotations

import dataclasses
import functools
import weakref
from dataclasses import dataclass
from functools import cached_property

import torch
from vllm.model_executor.models.utils import extract_layer_index
from vllm.v1.attention.backends.gdn_attn import GDNAttentionMetadata
from vllm.v1.attention.backends.utils import NULL_BLOCK_ID

from vllm_treewy.kernels.ancestor_table_torch import ancestor_table_torch
from vllm_treewy.kernels.bookkeeping.dispatch import commit_nodes_and_counts
from vllm_treewy.tree import DraftTree, chain_parents, node_requests
from vllm_treewy.vllm_plugin.config import DraftShape, keeps_slot_counts
from vllm_treewy.vllm_plugin.gdn.prefix_caching import caches_gdn_prefixes
from vllm_treewy.vllm_plugin.patch_points import GDN_METADATA_BUILD


@dataclass
class ReconstructGDNAttentionMetadata(GDNAttentionMetadata):
    # [rows of spec_state_indices_tensor] int32, contiguous (the kernels index it flat, as their `state_indices`):
    # each speculative row's state slot, the values of vLLM's column 0 `spec_state_indices_tensor[:, 0]`. vLLM's
    # column is strided: its FULL-graph buffer has 1 + k columns, which it fills by broadcasting reconstruct's one
    # block per request. (`node_slots` is another thing: per packed node, its request's slot.)
    state_indices: torch.Tensor | None = None
    # [rows] int32: the local node of the slot's previous verify to commit before this step's verify (-1: nothing to
    # commit: a new request, or a padding row).
    commit_nodes: torch.Tensor | None = None
    # [1 + num_nodes, D] int32 ancestor table of the static tree's verified block (root, then the nodes), which this
    # step's tree verify follows; None for chains and for a chain step of a tree config (`draft_tree_max_batch_size`).
    # One per GDN group (`GroupStepBuffers`): a FULL CUDA graph keeps its address.
    tree_ancestors: torch.Tensor | None = None
    # [T, D] int32: row a the path of commit node a in the slot's rows, which every slot's pending commit follows
    # (`commit_ancestor_table`); None for chains. One per GDN group, like tree_ancestors.
    commit_ancestors: torch.Tensor | None = None
    # The most tokens a speculative row verifies this step where that is below the pseudo-value buffer's rows: 1 + D
    # in a chain step of `draft_tree_max_batch_size`, so the verify launches as a chain config's would; None: the
    # buffer's rows (1 + num_speculative_tokens).
    verify_block_len: int | None = None
    # The name of the layer that runs the step's count update (`commit_nodes_and_counts` on this metadata's tensors)
    # at the start of its forward: the group's first GDN layer, which holds the count state; None where the builder
    # ran it (a batch without speculative rows).
    counts_layer: str | None = None

    def update_counts(self, layer) -> None:
        """At the start of each reconstruct GDN layer's speculative step (`layer`: the layer itself): the group's
        first layer (`counts_layer`) runs the step's count update, the commit nodes every layer of the group reads;
        the others find it done. Its arguments are read here, in the forward, from this metadata and the layer's count
        state: a FULL CUDA graph captures the update, and a step that replays the graph prepares nothing for it on
        the host. Before vLLM binds the KV cache (no count state: its profile run) each row's slot, and no commit."""
        if layer.prefix != self.counts_layer:
            return
        batch_slots = self.spec_state_indices_tensor[:, 0]  # vLLM's column 0, strided: the kernel's source
        counts = layer.verified_node_counts()
        if counts is None:
            self.state_indices.copy_(batch_slots)
            self.commit_nodes.fill_(-1)
            return
        commit_nodes_and_counts(
            counts, batch_slots=batch_slots, spec_query_start_loc=self.spec_query_start_loc, slots=self.state_indices,
            commit_nodes=self.commit_nodes, non_spec_slots=self.non_spec_state_indices_tensor,
            null_block=NULL_BLOCK_ID,
            accepted=self.num_accepted_tokens if layer.step_buffers.runner_accepted_counts else None)

    # The per-node tensors below are derived on first use, in the GDN layer's forward: inside a CUDA graph's capture
    # they are captured ops on the builder's persistent spec_query_start_loc, so a replay recomputes them for its own
    # batch. (Built here in the builder, outside the graph, a replay would read the capture's freed tensors.)

    @cached_property
    def ancestors(self) -> torch.Tensor | None:
        """`[N, D]` int32 ancestor table of the packed verified tokens (local indices, as
        `vllm_treewy.kernels.ancestor_table_triton.ancestor_table` builds it): rows of the static tree's table. None
        for chains."""
        if self.tree_ancestors is None:
            return None
        return self.tree_ancestors[self._tree_rows].contiguous()

    @cached_property
    def _tree_rows(self) -> torch.Tensor:
        """`[N]` each packed token's row of the static tree's table. A FULL graph's padding tokens (past the last
        request's, counted as its nodes) may index past the block: clamped, their rows are never used."""
        return self.node_indices.clamp(max=self.tree_ancestors.shape[0] - 1)

    @cached_property
    def parents(self) -> torch.Tensor:
        """`[N]` local parents of the packed draft chains or trees."""
        if self.tree_ancestors is not None:
            return self.tree_ancestors[self._tree_rows, 1].contiguous()
        return chain_parents(self.spec_query_start_loc, self.num_spec_decode_tokens)

    @cached_property
    def _node_requests(self) -> torch.Tensor:
        return node_requests(self.spec_query_start_loc, self.num_spec_decode_tokens)

    @cached_property
    def node_slots(self) -> torch.Tensor:
        """`[N]` int64 state slot of each packed draft node (its request's)."""
        return self.state_indices.long()[self._node_requests]

    @cached_property
    def node_blocks(self) -> torch.Tensor:
        """`[N]` int64 each packed draft node's own state block (store_all: column `node_indices` of its request's
        row of `spec_state_indices_tensor`)."""
        return self.spec_state_indices_tensor.long()[self._node_requests, self.node_indices]

    @cached_property
    def node_indices(self) -> torch.Tensor:
        """`[N]` int64 index of each packed draft node within its request (0 = the last sampled token)."""
        nodes = torch.arange(self.num_spec_decode_tokens, device=self.spec_query_start_loc.device)
        return nodes - self.spec_query_start_loc.long()[self._node_requests]

    @cached_property
    def rest_metadata(self) -> GDNAttentionMetadata:
        """The batch's prefills, as vLLM's own GDN path sees a batch without speculation."""
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(GDNAttentionMetadata)}
        fields.update(
            spec_sequence_masks=None, num_spec_decodes=0, num_spec_decode_tokens=0, spec_sequence_masks_cpu=None,
            spec_token_indx=None, non_spec_token_indx=None, spec_state_indices_tensor=None,
            spec_query_start_loc=None, num_accepted_tokens=None, num_actual_tokens=self.non_spec_token_indx.shape[0],
        )
        return GDNAttentionMetadata(**fields)


# what `ReconstructGDNAttentionMetadata` adds: its fields' defaults, and the per-node tensors derived on first use
_RECONSTRUCT_DEFAULTS = {f.name: f.default for f in dataclasses.fields(ReconstructGDNAttentionMetadata)
                         if f.name not in {g.name for g in dataclasses.fields(GDNAttentionMetadata)}}
_DERIVED = tuple(name for name, value in vars(ReconstructGDNAttentionMetadata).items()
                 if isinstance(value, cached_property))


def reconstruct_metadata(metadata: GDNAttentionMetadata) -> ReconstructGDNAttentionMetadata:
    """A new `ReconstructGDNAttentionMetadata` with `metadata`'s fields (the same objects) and its own at their
    defaults. Built without the dataclass `__init__` (vLLM's metadata has no `__post_init__`): a copy of `metadata`'s
    attributes, less what an instance of ours derived on first use (V2's re-gathered metadata is a copy of the first
    group's: `update_block_table`)."""
    result = object.__new__(ReconstructGDNAttentionMetadata)
    attributes = {**metadata.__dict__, **_RECONSTRUCT_DEFAULTS}
    if type(metadata) is not GDNAttentionMetadata:
        for name in _DERIVED:
            attributes.pop(name, None)
    result.__dict__ = attributes
    return result


def uses_runner_accepted_counts(vllm_config, shape: DraftShape) -> bool:
    """Whether a GDN group's count update commits from the runner's accepted counts (the module docstring): chains
    on Model Runner V2 without prefix caching of GDN states, where V2 keeps each request's accepted count and no
    after-sampling hook of ours records it."""
    return (shape.tree is None and vllm_config.use_v2_model_runner
            and not caches_gdn_prefixes(vllm_config.cache_config))


class GroupStepBuffers:
    """What a GDN KV-cache group's step metadata keeps from one build to the next outside vLLM's KV cache. Owned by
    the group's counts layer (`counts_layer`: our GDN layer, as its `step_buffers`), so nothing is added to vLLM's
    metadata builders; it lives as long as the layer (the model). It holds:

    - per metadata builder of the group (vLLM makes one per group, or one per microbatch), the FULL-graph buffers
      of the state indices and commit nodes (`staged`): made at the builder's first staged batch, the size of the
      builder's own persistent `num_accepted_tokens`, never replaced, since captured graphs read them at their
      address; they go with the builder (found by its id, checked through a weak reference), and so do their views
      of each batch size (FULL graphs replay a few padded sizes);
    - the config's draft shape (`shape`, the layer's `DraftShape`: the tree, None for chains, and its chain count
      offset);
    - the static tree's ancestor table (`tree_ancestors`, draft trees) and the commit table (`commit_ancestors`):
      made at the first speculative batch, read at the same address by every step's forward;
    - whether the counts layer was checked to run first of the group's layers (`order_checked`, once);
    - whether the count update commits from the runner's accepted counts (`runner_accepted_counts`, read from the
      config once: `uses_runner_accepted_counts`).
    """

    def __init__(self, shape: DraftShape, runner_accepted_counts: bool = False):
        self.shape = shape
        self.runner_accepted_counts = runner_accepted_counts
        # id(builder) -> (weak reference to the builder, (state indices, commit nodes) each [builder's max rows]
        # int32, {rows: their first rows})
        self._staged: dict[int, tuple] = {}
        self._tree_ancestors: torch.Tensor | None = None
        self._commit_ancestors: torch.Tensor | None = None
        self.order_checked = False

    def staged(self, builder, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The first `rows` of `builder`'s persistent state indices and commit nodes (made at first use, filled
        with -1)."""
        key = id(builder)
        kept = self._staged.get(key)
        if kept is None or kept[0]() is not builder:
            forget = functools.partial(self._staged.pop, key, None)  # when the builder goes
            kept = (weakref.ref(builder, lambda _: forget()),
                    tuple(torch.full_like(builder.num_accepted_tokens, -1) for _ in range(2)), {})
            self._staged[key] = kept
        _, buffers, views = kept
        if rows not in views:
            views[rows] = buffers[0][:rows], buffers[1][:rows]
        return views[rows]

    def tree_ancestors(self, device) -> torch.Tensor:
        """The static tree's verified-block ancestor table (`verified_tree_ancestors`), built once (trees only)."""
        if self._tree_ancestors is None:
            self._tree_ancestors = verified_tree_ancestors(self.shape.tree, device)
        return self._tree_ancestors

    def commit_ancestors(self, device) -> torch.Tensor:
        """The group's `commit_ancestor_table`, built once (the tree's own table where no chain step runs; trees
        only)."""
        if self._commit_ancestors is None:
            self._commit_ancestors = (commit_ancestor_table(self.shape.tree, device) if self.shape.has_chain_steps
                                      else self.tree_ancestors(device))
        return self._commit_ancestors


def counts_layer(builder):
    """The builder's first GDN layer (our `ReconstructGatedDeltaNetAttention`): it holds the group's count state and
    `GroupStepBuffers`, and runs the step's count update."""
    return builder.vllm_config.compilation_config.static_forward_context[builder.layer_names[0]]


def _checked_counts_layer_name(builder, buffers: GroupStepBuffers) -> str:
    """The counts layer's name. vLLM assigns a group the model's layers `i, i + n, i + 2n, ...` in order, so it runs
    first of the group's layers: checked once per group, since a layer that ran before it would read the previous
    step's commit nodes."""
    name = builder.layer_names[0]
    if not buffers.order_checked:
        first = min(builder.layer_names, key=extract_layer_index)
        if first != name:
            raise RuntimeError(f"reconstruct: the GDN group's count state is in {name}, but {first} runs first")
        buffers.order_checked = True
    return name


def verified_tree_ancestors(tree: DraftTree, device) -> torch.Tensor:
    """`[1 + N, depth + 1]` int32 local ancestor table of the tree's verified block (root = row 0)."""
    block = tree.with_root()
    parents = torch.tensor(block.parents, dtype=torch.int32, device=device)
    cu = torch.tensor([0, block.num_nodes], dtype=torch.int32, device=device)
    return ancestor_table_torch(parents, cu, block.max_depth)


def verified_chain_ancestors(depth: int, width: int, device) -> torch.Tensor:
    """`[1 + depth, width]` int32 local ancestor table of a chain's verified block (row j: j, j - 1, .., 0, then -1)."""
    rows = torch.arange(1 + depth, dtype=torch.int32, device=device)[:, None]
    path = rows - torch.arange(width, dtype=torch.int32, device=device)
    return torch.where(path >= 0, path, -1)


def commit_ancestor_table(tree: DraftTree, device) -> torch.Tensor:
    """`[(1 + N) + (1 + D), D + 1]` int32: the tree's verified block (rows 0 .. N, `verified_tree_ancestors`), then
    the verified block of the chain of the tree's depth D (rows N + 1 .. N + 1 + D, block-local indices). Row a is
    the path of commit node a = count - 1 in the slot's rows (counts: `DraftShape.chain_count_offset`)."""
    tree_block = verified_tree_ancestors(tree, device)
    return torch.cat([tree_block, verified_chain_ancestors(tree.max_depth, tree_block.shape[1], device)])


def with_commit_nodes(builder, metadata: GDNAttentionMetadata, tree_verify: bool,
                      layer=None) -> ReconstructGDNAttentionMetadata:
    """vLLM's GDN metadata with each speculative row's slot and commit node (their tensors; the step's count update
    fills them) and the layer that runs the count update; `tree_verify`: the step verifies the config's tree
    (`DraftShape.verifies_tree`), else chains; `layer`: the builder's `counts_layer`, where the caller has it.

    The count update (one launch on CUDA, `commit_nodes_and_counts`): the state indices, contiguous (vLLM's column 0
    is strided); each row's commit node from the count recorded after its slot's last sampling (`v1.accepted_counts`:
    1 + the accepted node's block index; 0, nothing pending, gives -1), or from the runner's accepted count where the
    slot's says a verify is pending; then the step's counts. The null block (CUDA-graph capture and padding rows point
    there) never holds a verify to commit: else every row of a capture would commit into it at once; nor is a count
    ever recorded for it. Every row outside the speculative path (prefills, and a first step that vLLM counts as a
    decode) starts or continues from the state vLLM's own kernels find in the slot: a slot's new owner commits
    nothing. In a batch with speculative rows the group's first GDN layer runs it in its forward
    (`ReconstructGDNAttentionMetadata.update_counts`), so nothing of it is prepared here; in a batch without any, it
    runs here."""
    result = reconstruct_metadata(metadata)
    layer = counts_layer(builder) if layer is None else layer
    buffers = layer.step_buffers
    if metadata.num_spec_decodes == 0:
        counts = layer.verified_node_counts()
        if counts is not None:  # no speculative step runs in this batch's forward
            commit_nodes_and_counts(counts, non_spec_slots=metadata.non_spec_state_indices_tensor,
                                    null_block=NULL_BLOCK_ID)
        return result
    # Every row of the batch (a FULL graph's padding rows too: in the null slot, with no nodes), so that a staged
    # batch is computed straight into the builder's persistent buffers.
    spec_state_indices = metadata.spec_state_indices_tensor  # [rows, 1 + k]: column 0 each row's state slot
    rows = spec_state_indices.shape[0]
    # The builder's own `_stage_spec_decode` (GDN_STAGES_SPEC_DECODE), so a subclass's override counts.
    if builder._stage_spec_decode(metadata.num_prefills, metadata.num_decodes, metadata.num_spec_decodes,
                                  metadata.num_spec_decode_tokens):
        state_indices, commit_nodes = buffers.staged(builder, rows)
    else:
        state_indices = torch.empty(rows, dtype=spec_state_indices.dtype, device=spec_state_indices.device)
        commit_nodes = torch.empty_like(state_indices)
    tree = buffers.shape.tree
    if tree is not None:  # `ancestors` and `parents` follow in the forward
        result.commit_ancestors = buffers.commit_ancestors(state_indices.device)
        if tree_verify:
            result.tree_ancestors = buffers.tree_ancestors(state_indices.device)
        else:
            result.verify_block_len = 1 + tree.max_depth
    result.state_indices, result.commit_nodes = state_indices, commit_nodes
    result.counts_layer = _checked_counts_layer_name(builder, buffers)
    return result


def _building_commit_nodes(original):
    @functools.wraps(original)
    def build(self, *args, **kwargs):
        metadata = original(self, *args, **kwargs)
        if not keeps_slot_counts(self.vllm_config.speculative_config):
            return metadata
        # build(common_prefix_len, common_attn_metadata, num_accepted_tokens, num_decode_draft_tokens_cpu, ...)
        draft_counts = kwargs.get("num_decode_draft_tokens_cpu", args[3] if len(args) > 3 else None)
        layer = counts_layer(self)
        tree_verify = layer.step_buffers.shape.verifies_tree(draft_counts, metadata.num_spec_decodes,
                                                             metadata.num_spec_decode_tokens)
        return with_commit_nodes(self, metadata, tree_verify, layer)

    return build


def install() -> None:
    GDN_METADATA_BUILD.wrap(_building_commit_nodes)
