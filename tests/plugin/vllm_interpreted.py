"""vLLM's Triton kernels runnable on CPU in Triton's interpreter (whose bf16 rounds as the GPU's does in every test:
`tests/interpreter_bf16.py`).

vLLM's CPU wheel swaps Triton for a placeholder (`vllm.triton_utils`: no CPU backend), so its kernel modules import
but hold no kernels. `load_fla` (modules of `vllm/third_party/flash_linear_attention/ops`, under a private package)
and `load_vllm_module` import fresh copies while `vllm.triton_utils` points at the real Triton; vLLM's own modules
are left as they are. `interpreted_unified_attention` does the same for vLLM's Triton attention kernel and the
helper modules it imports.

One difference between the interpreter and Triton's compiler matters here: vLLM's `load_qq_bias_tile` masks its
load with `key_rel_pos >= 0 and key_rel_pos < qq_bias_stride_0`. The compiler lowers Python's `and` on block
tensors to an elementwise logical and (with a deprecation warning); the interpreter evaluates Python's `and`, whose
block-tensor operand is always truthy, so it keeps only the second comparison and reads the bias at negative
offsets for the committed keys. The copy therefore gets `_load_qq_bias_tile`, the same load with the compiled
meaning (`&`), in place of vLLM's helper; everything else is vLLM's code.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
import os
import sys
import types
from pathlib import Path

import triton
import triton.language as tl

PACKAGE = "_treewy_fla_interpreted"


@triton.jit
def _exp(x):
    return tl.exp(x)


@triton.jit
def _log(x):
    return tl.log(x)


@contextlib.contextmanager
def _real_triton():
    import triton.language.extra.libdevice as tldevice
    import vllm.triton_utils as triton_utils

    saved = {name: getattr(triton_utils, name) for name in ("triton", "tl", "tldevice")}
    triton_utils.triton, triton_utils.tl, triton_utils.tldevice = triton, tl, tldevice
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(triton_utils, name, value)


def _interpretable(module: types.ModuleType) -> types.ModuleType:
    # the interpreter swaps tl's builtins for its own, not names bound to them (fla's `from .op import exp`)
    for name, wrapper in (("exp", _exp), ("log", _log)):
        if getattr(module, name, None) is getattr(tl, name):
            setattr(module, name, wrapper)
    return module


def load_fla(*names: str) -> list[types.ModuleType]:
    import vllm.third_party.flash_linear_attention.ops as ops

    if PACKAGE not in sys.modules:
        package = types.ModuleType(PACKAGE)
        package.__path__ = [str(Path(ops.__file__).parent)]
        sys.modules[PACKAGE] = package
    with _real_triton():
        modules = [importlib.import_module(f"{PACKAGE}.{name}") for name in names]
    return [_interpretable(module) for module in modules]


def load_vllm_module(name: str) -> types.ModuleType:
    """A fresh copy of vLLM's module `name` (absolute imports only), loaded as on a CUDA machine: e.g. its causal
    conv module, which on CPU rebinds `causal_conv1d_update` to the CPU op at import."""
    from vllm.platforms import current_platform

    private = f"{PACKAGE}_{name.replace('.', '_')}"
    if private not in sys.modules:
        spec = importlib.util.spec_from_file_location(private, importlib.util.find_spec(name).origin)
        module = importlib.util.module_from_spec(spec)
        current_platform.is_cpu = lambda: False  # an instance attribute over the class's method, for the import
        sys.modules[private] = module  # registered first: its dataclasses resolve their module while it runs
        try:
            with _real_triton():
                spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[private]
            raise
        finally:
            del current_platform.is_cpu
        sys.modules[private] = _interpretable(module)
    return sys.modules[private]


_OPS_PREFIX = "vllm.v1.attention.ops.triton_"


@functools.cache
def interpreted_unified_attention():
    if os.environ.get("TRITON_INTERPRET") != "1":  # on a GPU machine: tests/gpu runs vLLM's compiled kernel
        import pytest

        pytest.skip("vLLM's kernel under the Triton interpreter: TRITON_INTERPRET=1 only (tests/gpu covers CUDA)")
    saved_modules = {name: sys.modules.pop(name) for name in list(sys.modules) if name.startswith(_OPS_PREFIX)}
    try:
        with _real_triton():
            module = importlib.import_module(_OPS_PREFIX + "unified_attention")
    finally:
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
