import os

import torch

# Triton kernels run under the interpreter on machines without CUDA; the variable must be set before any
# `@triton.jit` kernel module is imported, hence here, ahead of every test module.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _interpreter_rounds_bf16_as_the_gpu(monkeypatch):
    """Every interpreted kernel's bf16 as on the GPU (the interpreter's own truncates): see the module."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        from tests.interpreter_bf16 import round_bf16_as_the_gpu

        round_bf16_as_the_gpu(monkeypatch)
