"""The post-sampler work of a V2 tree step as one CUDA graph replay per padded request count: the body is
`v2.sampler.accept_and_commit_tree_rows` (the walk over V2's draws, the output rows, the accepted paths' K/V
compaction, each tree row's accepted leaf into its GDN slots), unchanged; the graph only wraps it.

Which steps: those in which EVERY request of the batch is a tree row (`TreeStep.covers_batch` and R = num_reqs, all
logits rows the tree rows' blocks): the uniform decode steps that V2 replays its FULL decode graphs for. Their index
tensors depend on R only (request r's verified block at token and logits rows r (1 + N) .., as
`trees.step.uniform_tree_step` lays it out), so the body runs over persistent buffers (`AcceptGraphBuffers`) at a
padded request count P: the step's draws, token ids, roots, request states and the tree rows' TRITON_ATTN
block-table rows are copied in, the outputs read from the captured body's result. Every other step (a prefill or a
one-token decode in the batch, more requests than the largest graph, no FULL graphs, CPU) runs the same body
eagerly (`sample_tree_step`).

Padding: rows R .. P repeat row 0's inputs (draws, tokens, root, request state), so the count a padded row writes is
row 0's, into row 0's slot, with the same value; their block-table rows are vLLM's null block (block 0, which holds
no request's K/V), so their K/V moves stay inside it and never race row 0's (`kernels.paged_kv_compaction_triton`:
requests own disjoint blocks). The caches and counts end exactly as the R real rows leave them, and the padded output
rows are never read.

Captured in V2's capture phase (`GPUModelRunner.capture_model`, right after V2's own graphs: `v2.runner`), at the
padded request counts of V2's FULL first-pass graphs, into V2's pool; nothing inside V2's graph-memory profiling.
What the graph bakes in: the KV caches of the TRITON_ATTN and FLASH_ATTN layers grouped by KV-cache group
(`paged_cache_groups_of`; a step whose recorded layers group differently runs eagerly) and the GDN groups' count
states and V2 block tables (persistent).
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

import torch

from vllm_treewy.kernels.tree_acceptance_torch import PLACEHOLDER_TOKEN, TreeRows
from vllm_treewy.spec_decode.acceptance import TreeAcceptance
from vllm_treewy.tree import DraftTree
from vllm_treewy.vllm_plugin.trees.sampling import paged_cache_groups
from vllm_treewy.vllm_plugin.trees.step import PagedLayerCaches, TreeConstants, TreeStep, uniform_tree_step
from vllm_treewy.vllm_plugin.trees.synthetic import SyntheticTreeRates
from vllm_treewy.vllm_plugin.v2.acceptance import accept_and_commit_tree_rows
from vllm_treewy.vllm_plugin.v2.accepted_counts import CountedGroups, leaf_counts_of

PAGED_TREE_BACKENDS = ("TRITON_ATTN", "FLASH_ATTN")  # one paged KV layout: `trees.attention_flash`
logger = logging.getLogger(f"vllm.{__name__}")  # under vLLM's logger: printed with its lines, as it configures them


@dataclass
class AcceptGraphBuffers:
    """The graphed body's per-step inputs on the device, for up to `max_reqs` requests (int64: the body casts what
    it reads to int64 anyway). Allocated once; the graphs keep their addresses."""

    draws: torch.Tensor  # [max_reqs * (1 + N)] V2's draw at every logits row
    input_ids: torch.Tensor  # [max_reqs * (1 + N)] the step's token ids (a row's drafts at block tokens 1 .. N)
    root_positions: torch.Tensor  # [max_reqs] each root's position
    idx_mapping: torch.Tensor  # [max_reqs] batch row -> V2 request state
    block_tables: list[torch.Tensor]  # per TRITON_ATTN cache group: [max_reqs, max_blocks] int32 the rows' tables

    @classmethod
    def allocate(cls, max_reqs: int, block_len: int, table_widths: list[int], device) -> AcceptGraphBuffers:
        def zeros(*shape, dtype=torch.long):
            return torch.zeros(*shape, dtype=dtype, device=device)

        return cls(zeros(max_reqs * block_len), zeros(max_reqs * block_len), zeros(max_reqs), zeros(max_reqs),
                   [zeros(max_reqs, width, dtype=torch.int32) for width in table_widths])


def paged_cache_groups_of(runner) -> list[list[torch.Tensor]]:
    """The KV caches of the runner's TRITON_ATTN and FLASH_ATTN layers per KV-cache group (V2 builds one block table per
    group, which its layers' metadata share), each cache once (KV sharing: its first layer's group), in V2's group and
    layer order: the grouping `trees.attention.hand_tree_to_attention_layers` records a step's layers with."""
    layers = runner.compilation_config.static_forward_context
    groups: dict[int, list[torch.Tensor]] = {}
    seen = set()
    for attn_groups in runner.attn_groups:
        for attn_group in attn_groups:
            if attn_group.backend.get_name() not in PAGED_TREE_BACKENDS:
                continue
            for name in attn_group.layer_names:
                cache = layers[name].kv_cache
                if cache.data_ptr() not in seen:
                    seen.add(cache.data_ptr())
                    groups.setdefault(attn_group.kv_cache_group_id, []).append(cache)
    return list(groups.values())


def _cache_key(caches) -> frozenset:
    return frozenset(cache.data_ptr() for cache in caches)


class TreeAcceptGraphs:
    """The captured graphs of `accept_and_commit_tree_rows` by padded request count, with their buffers.

    `cache_groups`: `paged_cache_groups_of`; `leaf_counts`: `v2.accepted_counts.leaf_counts_of`; `max_model_len` bounds
    the positions a move touches, so a group's table buffer holds cdiv(max_model_len, block size) + 1 columns (a step's
    table rows are copied up to that width: no position past it is ever read). `constants`: the tree's on the device
    (the speculator's `tree_constants`, whose uniform steps the runner's all-tree steps share)."""

    def __init__(self, tree: DraftTree, num_speculative_steps: int, cache_groups: list[list[torch.Tensor]],
                 leaf_counts: CountedGroups, max_reqs: int, max_model_len: int,
                 constants: TreeConstants, synthetic: SyntheticTreeRates | None = None):
        self.tree, self.num_speculative_steps = tree, num_speculative_steps
        self.cache_groups, self.leaf_counts, self.max_reqs = cache_groups, leaf_counts, max_reqs
        self.group_keys = [_cache_key(caches) for caches in cache_groups]
        widths = [-(-max_model_len // caches[0].shape[2]) + 1 for caches in cache_groups]
        self.buffers = AcceptGraphBuffers.allocate(max_reqs, 1 + tree.num_nodes, widths, constants.parents.device)
        self.constants = constants
        self.synthetic = synthetic  # its rate tensor read in place by request state (persistent)
        self.graphs: dict[int, object] = {}  # padded request count -> its graph (anything with `replay()`)
        self.outputs: dict[int, TreeRows] = {}  # padded request count -> the body's result, read after replay

    # -- the body over the buffers -------------------------------------------------------------------------------
    def run_body(self, size: int, record_counts: bool = True) -> TreeRows:
        """`accept_and_commit_tree_rows` over the buffers' first `size` requests (every request a tree row); the
        result kept as `outputs[size]`. What a graph of `size` captures (`record_counts=False`: the capture's warm-up,
        which records no count)."""
        bufs, block_len = self.buffers, 1 + self.tree.num_nodes
        step = uniform_tree_step(self.tree, bufs.root_positions[:size], self.constants)  # covers the batch
        tables = [table[:size] for table in bufs.block_tables]  # one view per group: its layers compacted at once
        step.attention_layers = [PagedLayerCaches(cache, table)
                                 for caches, table in zip(self.cache_groups, tables) for cache in caches]
        result = accept_and_commit_tree_rows(
            step, bufs.draws[: size * block_len], step.query_start_loc, bufs.input_ids[: size * block_len],
            self.num_speculative_steps, bufs.idx_mapping[:size], self.leaf_counts if record_counts else None,
            self.synthetic)
        self.outputs[size] = result
        return result

    @torch.inference_mode()
    def capture(self, sizes, pool, vllm_config, device) -> None:
        """One graph of the body per padded request count in `sizes`, recorded as V2's CudaGraphManager records its
        own (its pool, vLLM's graph-capture context and stream), after an eager warm-up. Buffers inert while
        capturing: draws no draft carries (nothing accepted: every move copies a root onto itself), and the warm-up
        records no count. (Synthetic acceptance accepts whatever the tokens: its warm-up may move K/V within the
        zeroed table rows' block 0, vLLM's null block, which holds no request's K/V.)"""
        # vLLM's graph-capture context looked up at capture time, where V2 runs (CUDA; tests stand it in)
        from vllm.distributed.parallel_state import graph_capture

        self.graphs.clear()
        self.outputs.clear()
        bufs = self.buffers
        bufs.draws.fill_(PLACEHOLDER_TOKEN)
        with graph_capture(device=device):
            for size in sorted(sizes, reverse=True):
                self.run_body(size, record_counts=False)  # warm-up
                self.graphs[size] = capture_graph(functools.partial(self.run_body, size), pool, vllm_config)

    # -- a step ------------------------------------------------------------------------------------------------------
    def graph_size(self, num_reqs: int) -> int | None:
        """The captured padded request count that serves `num_reqs` (None: run the body eagerly)."""
        return smallest_graph_size(self.graphs, num_reqs)

    def _group_tables(self, step: TreeStep) -> list[torch.Tensor] | None:
        """The step's tree-row block table of each captured cache group, in capture order (None: the step's layers
        are not grouped as captured, or not all TRITON_ATTN / FLASH_ATTN)."""
        if any(not isinstance(layer, PagedLayerCaches) for layer in step.attention_layers):
            return None
        tables = {_cache_key(caches): table for table, caches in paged_cache_groups(step.attention_layers)}
        if set(tables) != set(self.group_keys):
            return None
        return [tables[key] for key in self.group_keys]

    def replay(self, step: TreeStep, draws: torch.Tensor, input_batch) -> TreeRows | None:
        """The step's `accept_and_commit_tree_rows` by a graph replay: inputs copied into the buffers (rows past the
        batch repeat row 0), the result's real rows read back; None when the step has another request than tree rows
        or no graph holds it (the caller runs the body eagerly). The emitted rows and counts are copies (V2 keeps them
        past the next step's replay); the acceptance and logits rows are views of the graph's outputs, valid until
        the next replay (the drafter reads them in this step)."""
        num_reqs, block_len = input_batch.num_reqs, step.block_len
        num_logits = num_reqs * block_len
        if not step.covers_batch or step.num_requests != num_reqs or draws.numel() != num_logits:
            return None
        size = self.graph_size(num_reqs)
        tables = None if size is None else self._group_tables(step)
        if tables is None:
            return None
        bufs = self.buffers
        _copy_rows(bufs.draws[: size * block_len].view(size, block_len), draws.view(num_reqs, block_len))
        _copy_rows(bufs.input_ids[: size * block_len].view(size, block_len),
                   input_batch.input_ids[:num_logits].view(num_reqs, block_len))
        _copy_rows(bufs.root_positions[:size, None], step.root_positions[:, None])
        _copy_rows(bufs.idx_mapping[:size, None], input_batch.idx_mapping[:num_reqs, None])
        for buffer, table in zip(bufs.block_tables, tables):
            width = min(buffer.shape[1], table.shape[1])
            buffer[:num_reqs, :width].copy_(table[:, :width])
            buffer[num_reqs:size].zero_()  # padding: vLLM's null block (the module docstring)
        self.graphs[size].replay()
        out = self.outputs[size]
        acceptance = TreeAcceptance(*(field[:num_reqs] for field in out.acceptance))
        return TreeRows(out.sampled[:num_reqs].clone(), out.num_sampled[:num_reqs].clone(),
                        out.leaf_counts[:num_reqs], out.chain_rows[:num_logits], acceptance)


def _copy_rows(buffer: torch.Tensor, rows: torch.Tensor) -> None:
    """`buffer[:R] = rows` (`rows [R, ...]`), and every row after R of `buffer` a copy of row 0 (graph padding)."""
    num_rows = rows.shape[0]
    buffer[:num_rows].copy_(rows)
    if buffer.shape[0] > num_rows:
        buffer[num_rows:].copy_(buffer[:1].expand_as(buffer[num_rows:]))


def capture_graph(body, pool, vllm_config):
    """A CUDA graph of `body()`, recorded as V2's CudaGraphManager records its own graphs: into V2's pool, on the
    current stream, inside vLLM's `graph_capture` context (which the caller holds around all its captures)."""
    # vLLM's graph-capture helpers looked up at capture time, where V2 runs (CUDA; tests stand them in)
    from vllm.compilation.cudagraph_pool import capture_pool
    from vllm.utils.torch_utils import current_stream

    graph = torch.cuda.CUDAGraph()
    with capture_pool(pool, vllm_config) as graph_pool, torch.cuda.graph(graph, graph_pool, stream=current_stream()):
        body()
    return graph


def smallest_graph_size(sizes, num_reqs: int) -> int | None:
    """The smallest of the captured padded request counts `sizes` that holds `num_reqs` (None: none does, run eagerly):
    how every graph family here (the acceptance graphs, the drafting levels' graphs) picks its replay."""
    fits = [size for size in sizes if size >= num_reqs]
    return min(fits) if fits else None


def full_graph_sizes(manager) -> list[int]:
    """The request counts of V2's FULL first-pass graphs (the speculator's prefill graph manager; none without FULL
    decode graphs): the uniform decode batches V2 replays FULL graphs for, padded."""
    # vLLM's graph mode enum looked up at call time, where V2 runs (CUDA; tests stand it in)
    from vllm.config.compilation import CUDAGraphMode

    if manager is None or manager.cudagraph_mode.decode_mode() != CUDAGraphMode.FULL:
        return []
    return sorted({desc.num_reqs for desc in manager._capture_descs.get(CUDAGraphMode.FULL, ()) if desc.num_reqs})


def capture_accept_graphs(runner, state) -> None:
    """After V2's capture phase (`capture_model`): the post-sampler graphs at the padded request counts of V2's FULL
    first-pass graphs (`full_graph_sizes`), into V2's pool; none without FULL graphs. Nothing inside V2's
    graph-memory profiling (its captures are thrown away)."""
    if state.profiling_capture:
        return
    speculator = runner.speculator
    manager = getattr(speculator, "prefill_cudagraph_manager", None)
    sizes = full_graph_sizes(manager)
    state.accept_graphs = None
    if not sizes:
        return
    graphs = TreeAcceptGraphs(state.tree, runner.num_speculative_steps, paged_cache_groups_of(runner),
                              leaf_counts_of(runner), max(sizes), speculator.max_model_len,
                              speculator.tree_constants(state.tree), state.synthetic)
    graphs.capture(sizes, manager.pool, speculator.vllm_config, speculator.device)
    state.accept_graphs = graphs
    logger.info("vllm-treewy: captured the draft tree's acceptance as CUDA graphs for %d batch sizes (up to %d "
                "requests)", len(sizes), max(sizes))
