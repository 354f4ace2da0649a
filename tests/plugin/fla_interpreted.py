"""vLLM's Triton kernels (its copy of flash-linear-attention) runnable on CPU in Triton's interpreter, and the
interpreter's float32 -> bfloat16 cast made to round as the GPU does.

vLLM's CPU wheel swaps Triton for a placeholder (`vllm.triton_utils`: no CPU backend), so its kernel modules import
but hold no kernels. `load_fla` imports fresh copies of the named modules of
`vllm/third_party/flash_linear_attention/ops` under a private package while `vllm.triton_utils` is pointed at the
real Triton; vLLM's own modules are left as they are.
"""

from __future__ import annotations

import importlib
import sys
import types
from pathlib import Path

import numpy as np
import torch
import triton
import triton.language as tl

PACKAGE = "_treewy_fla_interpreted"


@triton.jit
def _exp(x):
    return tl.exp(x)


@triton.jit
def _log(x):
    return tl.log(x)


def load_fla(*names: str) -> list[types.ModuleType]:
    import triton.language.extra.libdevice as tldevice
    import vllm.third_party.flash_linear_attention.ops as ops
    import vllm.triton_utils as triton_utils

    if PACKAGE not in sys.modules:
        package = types.ModuleType(PACKAGE)
        package.__path__ = [str(Path(ops.__file__).parent)]
        sys.modules[PACKAGE] = package
    saved = {name: getattr(triton_utils, name) for name in ("triton", "tl", "tldevice")}
    triton_utils.triton, triton_utils.tl, triton_utils.tldevice = triton, tl, tldevice
    try:
        modules = [importlib.import_module(f"{PACKAGE}.{name}") for name in names]
    finally:
        for name, value in saved.items():
            setattr(triton_utils, name, value)
    for module in modules:
        # the interpreter swaps tl's builtins for its own, not names bound to them (fla's `from .op import exp`)
        for name, wrapper in (("exp", _exp), ("log", _log)):
            if getattr(module, name, None) is getattr(tl, name):
                setattr(module, name, wrapper)
    return modules


def round_bf16_to_nearest_even(monkeypatch) -> None:
    """Triton 3.6's interpreter casts float32 to bfloat16 by truncation; the GPU (`cvt.rn.bf16.f32`) and torch round
    to nearest even. Patched for one test, so that both sides round as on the H200."""
    from triton.runtime import interpreter

    cast = interpreter.InterpreterBuilder.cast_impl

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            values = torch.from_numpy(np.ascontiguousarray(src.data, dtype=np.float32))
            return interpreter.TensorHandle(values.bfloat16().view(torch.int16).numpy().view(np.uint16),
                                            dst_type.scalar)
        return cast(self, src, dst_type)

    monkeypatch.setattr(interpreter.InterpreterBuilder, "cast_impl", cast_impl)
