# Simulates a CPU without AMX and AVX-512-BF16 for vLLM's Python-level ISA probes (local experiment only).
import torch
torch.cpu._is_amx_tile_supported = lambda: False
torch.cpu._is_avx512_bf16_supported = lambda: False
