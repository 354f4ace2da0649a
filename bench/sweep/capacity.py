"""vLLM's KV-cache capacity on a CUDA GPU for a Qwen3.5 shape, computed on the CPU from vLLM's own formulas: the
GDN page (conv and SSM states, and under reconstruct the pseudo-value buffer the plugin adds), the attention block
size that makes an attention page at least a GDN page (TRITON_ATTN's kernel blocks, `Platform.
_align_hybrid_block_size`), the KV-cache groups (`get_kv_cache_groups`), the blocks a KV-cache budget holds and the
max concurrency vLLM reports at start-up (`get_kv_cache_config_from_groups`, `get_max_concurrency_for_kv_cache_config`).
Nothing is allocated and no model is built: a grid's budgets can be chosen where store_all's concurrency binds
before device time is spent.

    python3 -m bench.sweep.capacity qwen35-35b-a3b --kv-gib 8 12 16 24 --max-model-len 4096

The budget is vLLM's `kv_cache_memory_bytes` (what `--kv-cache-memory-bytes` sets, or the "Available KV cache memory"
vLLM logs at a gpu_memory_utilization). Needs vLLM (the CPU build does) and the plugin, which it registers.
"""

from __future__ import annotations

import argparse
import functools
import json
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from bench.sweep.models import SHAPES, write_shape_config

STRATEGIES = ("no_spec", "store_all", "reconstruct")
GiB = 1 << 30


@dataclass(frozen=True)
class Capacity:
    shape: str
    strategy: str
    kv_cache_bytes: int
    max_model_len: int
    attention_block_size: int  # tokens per attention block (a page equals a GDN page)
    page_bytes: int  # one layer's page in one block
    gdn_state_bytes: int  # of a GDN page: what the states take before vLLM pads it to the attention page
    num_blocks: int  # the shared pool
    blocks_per_request: int  # at max_model_len, over all KV-cache groups
    gdn_blocks_per_request: int  # per GDN layer
    max_concurrency: float  # vLLM's "Maximum concurrency for max_model_len tokens per request"
    max_gdn_requests: int  # requests whose GDN blocks the pool holds when attention takes none: the FULL-graph bound


@functools.lru_cache(maxsize=None)
def _vllm_config(shape: str, strategy: str, max_model_len: int, k: int):
    """vLLM's config for the shape as `vllm serve` builds it (bf16, fp32 SSM state, prefix caching off), config only."""
    import vllm_treewy.vllm_plugin as plugin
    from vllm.engine.arg_utils import EngineArgs

    plugin.register()
    model = write_shape_config(Path(tempfile.mkdtemp(prefix=f"treewy-capacity-{shape}-")), shape)
    speculative = None if strategy == "no_spec" else {"method": "mtp", "num_speculative_tokens": k,
                                                      "mamba_state_commit": strategy}  # fmt: skip
    return EngineArgs(model=str(model), load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16",
                      max_model_len=max_model_len, enable_prefix_caching=False, mamba_ssm_cache_dtype="float32",
                      speculative_config=speculative).create_engine_config()  # fmt: skip


def _align_for_triton_attention(vllm_config) -> None:
    """vLLM's hybrid block-size alignment as on CUDA with TRITON_ATTN (the gpu-vllm site's backend), from CUDA's
    default block size of 16: the platform's own classmethod, told which attention backend the layers use; the KV
    layout the H200 logs."""
    from vllm.platforms.interface import Platform
    from vllm.v1.attention.backends.triton_attn import TritonAttentionBackend

    class TritonAttentionLayers(Platform):
        @classmethod
        def _find_non_ssm_backends(cls, vllm_config):
            return [TritonAttentionBackend]

    cache_config = vllm_config.cache_config
    cache_config.block_size = 16
    cache_config.mamba_page_size_padded = None
    cache_config.kv_cache_layout = "LBNHC"  # what the H200 runs resolve ("Using LBNHC KV cache layout")
    TritonAttentionLayers._align_hybrid_block_size(vllm_config, TritonAttentionBackend)


def kv_cache_specs(vllm_config, strategy: str) -> dict:
    """Per layer, the KVCacheSpec the CUDA runner collects: the target's GDN and attention layers, the MTP layer's
    attention."""
    import torch
    from vllm.model_executor.models import ModelRegistry
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec

    hf = vllm_config.model_config.hf_text_config
    cache_config = vllm_config.cache_config
    model_cls, _ = ModelRegistry.resolve_model_cls(vllm_config.model_config.architecture,
                                                   model_config=vllm_config.model_config)  # fmt: skip
    gdn = MambaSpec(
        shapes=tuple(model_cls.get_mamba_state_shape_from_config(vllm_config)),
        dtypes=tuple(model_cls.get_mamba_state_dtype_from_config(vllm_config)),
        block_size=cache_config.mamba_block_size, page_size_padded=cache_config.mamba_page_size_padded,
        mamba_type="gdn_attention", mamba_cache_mode=cache_config.mamba_cache_mode,
        # vLLM's block per draft position; the plugin's GDN layer asks for none under reconstruct
        num_speculative_blocks=vllm_config.num_speculative_tokens if strategy == "store_all" else 0,
    )  # fmt: skip
    attention = FullAttentionSpec(block_size=cache_config.block_size,
                                  num_kv_heads=vllm_config.model_config.get_num_kv_heads(vllm_config.parallel_config),
                                  head_size=vllm_config.model_config.get_head_size(), dtype=torch.bfloat16)  # fmt: skip
    specs = {}
    for i, kind in enumerate(hf.layer_types):
        if kind == "linear_attention":
            specs[f"model.layers.{i}.linear_attn"] = gdn
        else:
            specs[f"model.layers.{i}.self_attn.attn"] = attention
    if strategy != "no_spec":
        for j in range(getattr(hf, "mtp_num_hidden_layers", 1)):
            specs[f"mtp.layers.{len(hf.layer_types) + j}.self_attn.attn"] = attention
    return specs


def capacity(shape: str, strategy: str, kv_cache_bytes: int, *, max_model_len: int = 4096, k: int = 3) -> Capacity:
    """vLLM's KV-cache report for `kv_cache_bytes` of KV cache (see the module docstring)."""
    from vllm.utils.math_utils import cdiv
    from vllm.v1.core.kv_cache_utils import (
        get_kv_cache_config_from_groups,
        get_kv_cache_groups,
        get_max_concurrency_for_kv_cache_config,
    )
    from vllm.v1.kv_cache_interface import MambaSpec

    if strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}; known: {', '.join(STRATEGIES)}")
    vllm_config = _vllm_config(shape, strategy, max_model_len, k)
    _align_for_triton_attention(vllm_config)
    specs = kv_cache_specs(vllm_config, strategy)
    groups = get_kv_cache_groups(vllm_config, dict(specs))
    config = get_kv_cache_config_from_groups(vllm_config, groups, kv_cache_bytes)
    gdn_groups = [g for g in config.kv_cache_groups if isinstance(g.kv_cache_spec, MambaSpec)]
    gdn_spec = gdn_groups[0].kv_cache_spec
    per_request = {id(g): cdiv(g.kv_cache_spec.max_memory_usage_bytes(vllm_config), g.kv_cache_spec.page_size_bytes)
                   for g in config.kv_cache_groups}  # fmt: skip
    gdn_blocks = per_request[id(gdn_groups[0])]
    return Capacity(
        shape=shape, strategy=strategy, kv_cache_bytes=kv_cache_bytes, max_model_len=max_model_len,
        attention_block_size=vllm_config.cache_config.block_size, page_bytes=gdn_spec.page_size_bytes,
        gdn_state_bytes=gdn_spec.real_page_size_bytes, num_blocks=config.num_blocks,
        blocks_per_request=sum(per_request.values()), gdn_blocks_per_request=gdn_blocks,
        max_concurrency=get_max_concurrency_for_kv_cache_config(vllm_config, config),
        max_gdn_requests=config.num_blocks // (gdn_blocks * len(gdn_groups)),
    )  # fmt: skip


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("shape", choices=sorted(SHAPES))
    parser.add_argument("--kv-gib", type=float, nargs="+", required=True, help="KV-cache budgets (GiB)")
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--k", type=int, default=3, help="MTP draft tokens")
    parser.add_argument("--strategies", nargs="+", default=list(STRATEGIES), choices=STRATEGIES)
    parser.add_argument("--json", action="store_true", help="one JSON object a line instead of the table")
    args = parser.parse_args(argv)
    rows = [capacity(args.shape, s, int(gib * GiB), max_model_len=args.max_model_len, k=args.k)
            for gib in args.kv_gib for s in args.strategies]  # fmt: skip
    if args.json:
        for row in rows:
            print(json.dumps(asdict(row)))
        return 0
    print("| KV cache GiB | strategy | attention block | page bytes | blocks | blocks / request | max concurrency |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r.kv_cache_bytes / GiB:g} | {r.strategy} | {r.attention_block_size} | {r.page_bytes:,} | "
              f"{r.num_blocks:,} | {r.blocks_per_request} | {r.max_concurrency:.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
