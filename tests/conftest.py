import os

import torch

# Triton kernels run under the interpreter on machines without CUDA; the variable must be set before any
# `@triton.jit` kernel module is imported, hence here, ahead of every test module.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
