"""Start-up on CUDA: return cached memory before the real KV cache's metadata builders allocate (hybrid models).

On the H200 (Qwen3.5-27B shape, gpu_memory_utilization 0.9, no allocator settings; bench/results/gpu_vllm_e2e): when
`initialize_kv_cache` builds the attention metadata builders, a freed 27-30 GiB block is still cached (most likely the
profiling KV cache of vLLM's CUDA-graph memory profile, one block per sequence), and their first small buffers
(TRITON_ATTN's 12 MiB) are carved out of it. That pins the whole segment past every later `empty_cache()`, so the KV
cache, sized from memory vLLM counted as free, fails to allocate in one piece: "Tried to allocate 70.25 GiB ...
29.20 GiB is reserved by PyTorch but unallocated", for store_all and reconstruct alike (the pinning blocks' stacks:
bench/e2e/memory_pins.py). Emptying the cache first gives the builders fresh small segments; with it both start.
"""

from __future__ import annotations

import functools
import logging

import torch

from vllm_treewy.vllm_plugin.patch_points import RUNNER_INITIALIZE_METADATA_BUILDERS

logger = logging.getLogger(f"vllm.{__name__}")  # under vLLM's logger: printed with its lines, as it configures them
GIB = 1 << 30


def _emptying_the_cache_first(original):
    @functools.wraps(original)
    def initialize_metadata_builders(self, *args, **kwargs):
        if self.model_config.is_hybrid:
            reserved = torch.cuda.memory_reserved()
            torch.cuda.empty_cache()
            released = reserved - torch.cuda.memory_reserved()
            if released:
                logger.info("vllm-treewy: returned %.2f GiB of cached blocks before the KV cache's metadata "
                            "builders allocate", released / GIB)
        return original(self, *args, **kwargs)

    return initialize_metadata_builders


def install() -> None:
    RUNNER_INITIALIZE_METADATA_BUILDERS.wrap(_emptying_the_cache_first)
