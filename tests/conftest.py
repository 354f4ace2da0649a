import os

import torch

# Triton kernels run under the interpreter on machines without CUDA; the variable must be set before any
# `@triton.jit` kernel module is imported, hence here, ahead of every test module.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


import pytest  # noqa: E402
from hypothesis import settings  # noqa: E402

# CI (`CI=true`, as .ci/run is run) draws the same examples every run, so that its verdict is the code's, not the
# draw's; a developer's run explores new ones (a random failing example once reached CI that way).
settings.register_profile("ci", derandomize=True, print_blob=True)
if os.environ.get("CI"):
    settings.load_profile("ci")


@pytest.fixture(autouse=True, scope="session")
def _interpreter_patches_language_once():
    """Interpreted kernels without the interpreter's repeated language patching: see the module."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        from tests.interpreter_patch_once import patch_language_once

        patch_language_once()


@pytest.fixture(autouse=True)
def _interpreter_rounds_bf16_as_the_gpu(monkeypatch):
    """Every interpreted kernel's bf16 as on the GPU (the interpreter's own truncates): see the module."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        from tests.interpreter_bf16 import round_bf16_as_the_gpu

        round_bf16_as_the_gpu(monkeypatch)


def pytest_collection_modifyitems(config, items):
    """On pytest-xdist workers (the unit stage), the tests marked e2e (a vLLM flow in subprocesses: minutes each,
    where most tests take seconds) go first, the rest in collection order: started last, one of them would leave
    the other worker idle at the end. Every worker collects the same order, as xdist requires."""
    if hasattr(config, "workerinput"):
        items.sort(key=lambda item: item.get_closest_marker("e2e") is None)
