"""The device ops a reconstruct chain's decode step runs in its GDN layers' forwards on the CUDA path besides the GDN
step's own kernels, per engine step: what a FULL CUDA graph captures and then replays every step (its GPU time, and
each kernel node adds to the graph launch's host time). `bench.host.step_ops --whole-step` counts the step outside
the forwards; this counts inside them, where the CPU backend runs another path (`gdn.cpu`).

Each GDN group's metadata is made as vLLM's builder and the adapter's build hook make it for a decode batch staged
into the FULL-graph buffers (`gdn.step_metadata.with_commit_nodes`: `--batch` requests of 1 + `--k` tokens, V2's
accepted counts); then each group's layers run their forward's reconstruct part in order, the group's first layer
first: the count update (`update_counts`; its Triton kernel run by the interpreter, counted as one launch) and
`gdn.reconstruct.step_triton` with the step's two kernel functions stubbed (the conv, one launch, and the gated
step, two: counted, not run). Counted: every aten op a torch dispatch mode sees except views and allocations (no
data touched, no launch), by name, and the launches. Layers per group: the fixture's (3 GDN layers in 2 KV-cache
groups: 2 and 1).

    python -m bench.host.k1_graph_ops --batch 8 --k 1
"""

from __future__ import annotations

import argparse
import collections
import os
from types import SimpleNamespace

import torch
from torch.utils._python_dispatch import TorchDispatchMode

NO_LAUNCH = {"empty", "empty_like", "empty_strided", "new_empty", "lift_fresh", "set_", "detach"}


class Builder(SimpleNamespace):
    """vLLM's GDN metadata builder as `with_commit_nodes` sees it (weakly referenced, as vLLM's is)."""


class Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.counts = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if not func.is_view and name not in NO_LAUNCH:
            self.counts[name] += 1
        return func(*args, **(kwargs or {}))


def group_metadata(batch: int, k: int, group: int, slots_per_group: int):
    """A staged decode batch's metadata for one GDN group, through the adapter's build hook, and its counts layer."""
    from vllm.v1.attention.backends.gdn_attn import GDNAttentionMetadata, GDNAttentionMetadataBuilder

    from vllm_treewy.vllm_plugin.config import DraftShape
    from vllm_treewy.vllm_plugin.gdn.layer import ReconstructGatedDeltaNetAttention
    from vllm_treewy.vllm_plugin.gdn.step_metadata import GroupStepBuffers, with_commit_nodes

    name = f"gdn.{group}"
    counts = torch.zeros(slots_per_group, 3, dtype=torch.int32)[:, 2:]  # in the slots' KV pages: strided
    layer = SimpleNamespace(prefix=name, kv_cache=(None,) * 4 + (counts,), keeps_slot_counts=True,
                            step_buffers=GroupStepBuffers(DraftShape(None), runner_accepted_counts=True))
    layer.verified_node_counts = ReconstructGatedDeltaNetAttention.verified_node_counts.__get__(layer)
    max_rows = 4 * batch
    builder = Builder(layer_names=[name], use_full_cuda_graph=True, decode_cudagraph_max_bs=max_rows,
                      num_accepted_tokens=torch.ones(max_rows, dtype=torch.int32),
                      vllm_config=SimpleNamespace(compilation_config=SimpleNamespace(
                          static_forward_context={name: layer})))
    builder._stage_spec_decode = GDNAttentionMetadataBuilder._stage_spec_decode.__get__(builder)
    tokens = 1 + k
    persistent = torch.arange(max_rows, dtype=torch.int32)[:, None].expand(-1, tokens).contiguous()
    metadata = GDNAttentionMetadata(
        num_prefills=0, num_prefill_tokens=0, num_decodes=0, num_decode_tokens=0, num_spec_decodes=batch,
        num_spec_decode_tokens=batch * tokens, num_actual_tokens=batch * tokens,
        spec_query_start_loc=torch.arange(0, (batch + 1) * tokens, tokens, dtype=torch.int32),
        spec_state_indices_tensor=persistent[:batch] + 1, spec_sequence_masks=torch.ones(batch, dtype=torch.bool),
        num_accepted_tokens=torch.ones(batch, dtype=torch.int32))
    return with_commit_nodes(builder, metadata, False, layer), layer


def stand_in_layer(prefix: str, k: int):
    """What `step_triton` reads of the layer and its caches (the stubbed kernels read nothing)."""
    layout = SimpleNamespace(num_nodes=1 + k, num_k_heads=2, head_k_dim=64)
    buffer = SimpleNamespace(layout=layout, conv_inputs=None, factors=None)
    layer = SimpleNamespace(prefix=prefix, activation="silu", conv1d=SimpleNamespace(bias=None), A_log=None,
                            dt_bias=None, norm=SimpleNamespace(weight=None, activation="silu"),
                            layer_norm_epsilon=1e-6)
    return layer, dict(conv_weight=None, conv_history=None, ssm_state=None, buffer=buffer)


def count(batch: int, k: int, layers_per_group) -> tuple[collections.Counter, set]:
    """(device ops per engine step by name, whether the conv was handed parents), the stubs undone after."""
    from triton.runtime.interpreter import GridExecutor

    from vllm_treewy.kernels.bookkeeping import dispatch
    from vllm_treewy.vllm_plugin.gdn import reconstruct

    ops, parents_given = Ops(), set()

    def conv_step(*a, **kw):
        ops.counts["TRITON LAUNCH conv step"] += 1
        parents_given.add(a[5] is not None)
        return a[0]

    def gdn_step(*a, **kw):
        ops.counts["TRITON LAUNCH gated step (state pass + epilogue)"] += 2

    def counted_launch(executor, *a, **kw):
        ops.counts["TRITON LAUNCH " + executor.fn.__name__] += 1
        with torch.utils._python_dispatch._disable_current_modes():
            return launch(executor, *a, **kw)

    saved = (dispatch.launches_triton, reconstruct.conv_step_triton, reconstruct.gdn_step_triton)
    launch = GridExecutor.__call__
    dispatch.launches_triton = lambda counts: True  # the CUDA path's one-launch count update
    reconstruct.conv_step_triton, reconstruct.gdn_step_triton = conv_step, gdn_step
    GridExecutor.__call__ = counted_launch
    try:
        groups = [group_metadata(batch, k, g, 4 * batch + 2) for g in range(len(layers_per_group))]
        with ops:
            for (metadata, counts_layer), layers in zip(groups, layers_per_group):
                for i in range(layers):
                    prefix = counts_layer.prefix if i == 0 else f"{counts_layer.prefix}.{i}"
                    layer, caches = stand_in_layer(prefix, k)
                    # the layer's `_caches` (the count update where it is the group's first), then its step
                    metadata.update_counts(counts_layer if i == 0 else layer)
                    x = torch.empty(metadata.num_actual_tokens, 4)
                    reconstruct.step_triton(layer, metadata, x, x, x, x, x, **caches)
    finally:
        dispatch.launches_triton, reconstruct.conv_step_triton, reconstruct.gdn_step_triton = saved
        GridExecutor.__call__ = launch
    return ops.counts, parents_given


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--k", type=int, default=1)
    parser.add_argument("--layers-per-group", type=int, nargs="+", default=[2, 1])
    args = parser.parse_args(argv)
    os.environ.setdefault("TRITON_INTERPRET", "1")  # the count update's kernel, run on CPU tensors
    counts, parents_given = count(args.batch, args.k, args.layers_per_group)
    print(f"per engine step, batch {args.batch}, k {args.k}, {sum(args.layers_per_group)} GDN layers in "
          f"{len(args.layers_per_group)} groups: {sum(counts.values())} device ops in the GDN forwards "
          f"(parents handed to the conv: {sorted(parents_given)})")
    for name, n in sorted(counts.items(), key=lambda item: (-item[1], item[0])):
        print(f"    {n:4d}  {name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
