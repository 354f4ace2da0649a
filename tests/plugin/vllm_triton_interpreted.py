"""vLLM's own Triton attention kernel, runnable on this CPU machine under the Triton interpreter (tests only).

vLLM's CPU build turns Triton off (`vllm.triton_utils` hands out placeholders when Triton has no CPU backend), so
its `triton_unified_attention` module imports with placeholder decorators. `interpreted_unified_attention()` loads a
private copy of that module (and its helpers) with the real `triton`/`triton.language` in place, so that
`TRITON_INTERPRET=1` runs vLLM's kernel as it is, without touching the modules vLLM itself uses.

One difference between the interpreter and Triton's compiler matters here: vLLM's `load_qq_bias_tile` masks its
load with `key_rel_pos >= 0 and key_rel_pos < qq_bias_stride_0`. The compiler lowers Python's `and` on block
tensors to an elementwise logical and (with a deprecation warning); the interpreter evaluates Python's `and`, whose
block-tensor operand is always truthy, so it keeps only the second comparison and reads the bias at negative
offsets for the committed keys. The copy therefore gets `_load_qq_bias_tile`, the same load with the compiled
meaning (`&`), in place of vLLM's helper; everything else is vLLM's code.
"""

from __future__ import annotations

import functools
import importlib
import os
import sys

import triton
import triton.language as tl

_OPS_PREFIX = "vllm.v1.attention.ops.triton_"


@functools.cache
def interpreted_unified_attention():
    if os.environ.get("TRITON_INTERPRET") != "1":  # on a GPU machine: tests/gpu runs vLLM's compiled kernel
        import pytest

        pytest.skip("vLLM's kernel under the Triton interpreter: TRITON_INTERPRET=1 only (tests/gpu covers CUDA)")
    import vllm.triton_utils as triton_utils

    saved_modules = {name: sys.modules.pop(name) for name in list(sys.modules) if name.startswith(_OPS_PREFIX)}
    saved_names = triton_utils.triton, triton_utils.tl
    triton_utils.triton, triton_utils.tl = triton, tl
    try:
        module = importlib.import_module(_OPS_PREFIX + "unified_attention")
    finally:
        triton_utils.triton, triton_utils.tl = saved_names
        for name in [name for name in sys.modules if name.startswith(_OPS_PREFIX)]:
            del sys.modules[name]
        sys.modules.update(saved_modules)
    module.load_qq_bias_tile = _load_qq_bias_tile
    return module.unified_attention


@triton.jit
def _load_qq_bias_tile(qq_bias_row_ptrs, seq_offset, context_len, qq_bias_stride_0):
    key_rel_pos = seq_offset - context_len
    inside = (key_rel_pos >= 0) & (key_rel_pos < qq_bias_stride_0)
    return tl.load(qq_bias_row_ptrs + key_rel_pos[None, :], mask=inside[None, :], other=0.0)
