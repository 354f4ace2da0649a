"""Every place where the adapter reaches into vLLM 0.32 internals, in one list.

A plugin cannot reach these through a public API, so the adapter rebinds or wraps them at import (`replace`) or
calls them (`resolve`). Each point names the parameters the adapter relies on; `tests/plugin/test_patch_points.py`
fails if vLLM moves, renames or re-signs one of them, which is the signal to revisit the adapter.
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass


@dataclass(frozen=True)
class PatchPoint:
    module: str
    attribute: str  # dotted path below the module, e.g. "GPUModelRunner._update_states_after_model_execute"
    how: str  # what the adapter does there: "rebinds", "wraps", "overrides", "calls"
    why: str
    parameters: tuple[str, ...] | None = None  # leading parameter names the adapter relies on (None: a class)

    def _owner_and_name(self):
        owner = importlib.import_module(self.module)
        *path, name = self.attribute.split(".")
        for part in path:
            owner = getattr(owner, part)
        return owner, name

    def resolve(self):
        owner, name = self._owner_and_name()
        return getattr(owner, name)

    def replace(self, new) -> None:
        owner, name = self._owner_and_name()
        setattr(owner, name, new)

    def original(self):
        """What vLLM defines there, under any wrapper of ours (wrappers set `__wrapped__`)."""
        target = self.resolve()
        while True:
            target = getattr(target, "__func__", target)  # a bound or class method: its function
            if not hasattr(target, "__wrapped__"):
                return target
            target = target.__wrapped__

    def check(self) -> None:
        """Raises if vLLM no longer has this attribute with the parameters the adapter relies on."""
        target = self.original()
        if self.parameters is None:
            if not inspect.isclass(target):
                raise TypeError(f"{self}: expected a class, found {target!r}")
            return
        found = tuple(inspect.signature(target).parameters)[: len(self.parameters)]
        if found != self.parameters:
            raise TypeError(f"{self}: expected parameters {self.parameters}, vLLM has {found}")

    def __str__(self) -> str:
        return f"{self.module}.{self.attribute}"


_SPEC = "vllm.config.speculative"
_CPU_GDN = "vllm.model_executor.layers.mamba.ops.cpu.gdn_attention"
_GDN_LAYER = "vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn"

SPECULATIVE_CONFIG = tuple(
    PatchPoint(module, "SpeculativeConfig", "rebinds", "every builder of the speculative config builds ours")
    for module in ("vllm.config", _SPEC, "vllm.engine.arg_utils")
)
V2_UNSUPPORTED_FEATURES = PatchPoint(
    "vllm.config.vllm", "VllmConfig._get_v2_model_runner_unsupported_features", "wraps",
    "reconstruct hooks the V1 runner: list it so vLLM falls back to V1 and says why", ("self",),
)
GDN_CUDAGRAPH_SUPPORT = PatchPoint(
    "vllm.v1.attention.backends.gdn_attn", "GDNAttentionMetadataBuilder.get_cudagraph_support", "wraps",
    "decline FULL CUDA graphs for GDN under reconstruct", ("cls", "vllm_config", "kv_cache_spec"),
)
GDN_FORWARD_CORE = PatchPoint(
    _GDN_LAYER, "QwenGatedDeltaNetAttention._forward_core", "overrides",
    "vLLM's GDN custom op calls it on CUDA: the speculative tokens go to reconstruct there",
    ("self", "mixed_qkv", "b", "a", "core_attn_out"),
)
RUNNER_AFTER_SAMPLING = PatchPoint(
    "vllm.v1.worker.gpu_model_runner", "GPUModelRunner._update_states_after_model_execute", "wraps",
    "where the V1 runner (the CPU runner inherits it) learns the accepted counts: commit right after",
    ("self", "output_token_ids", "scheduler_output"),
)
CPU_GDN_SPEC_AWARE = PatchPoint(
    _CPU_GDN, "_cpu_gdn_attention_spec_aware", "wraps",
    "the CPU GDN op's entry for batches with speculative tokens: drop factors of unsampled passes",
    ("layer", "attn_metadata_i", "mixed_qkv", "b", "a", "core_attn_out"),
)
CPU_GDN_SPEC_FORWARD = PatchPoint(
    _CPU_GDN, "_spec_forward", "wraps", "the CPU GDN op's speculative half, looked up at call time",
    ("layer", "attn_metadata_i", "mixed_qkv_spec", "b_spec", "a_spec"),
)
CPU_SSM_STATE_VIEW = PatchPoint(
    _CPU_GDN, "_ssm_state_view", "calls", "the CPU SSM cache as vLLM's CPU kernel lays it out", ("layer",),
)
CPU_UNPACKED_CONV_WEIGHT = PatchPoint(
    _CPU_GDN, "_unpacked_conv_weight", "calls", "vLLM packs the CPU conv weight for AMX in place", ("layer",),
)

# The models whose GDN layers are `QwenGatedDeltaNetAttention`: vLLM sizes a hybrid's pages from these classmethods.
_GDN_MODELS = (
    ("vllm.model_executor.models.qwen3_5", "Qwen3_5ForCausalLMBase"),
    ("vllm.model_executor.models.qwen3_5", "Qwen3_5ForConditionalGeneration"),
    ("vllm.model_executor.models.qwen3_next", "Qwen3NextForCausalLM"),
)
MODEL_STATE_SHAPES = tuple(
    PatchPoint(module, f"{model}.get_mamba_state_shape_from_config", "wraps",
               "the pseudo-value buffer is part of the GDN page vLLM sizes and allocates", ("cls", "vllm_config"))
    for module, model in _GDN_MODELS
)
MODEL_STATE_DTYPES = tuple(
    PatchPoint(module, f"{model}.get_mamba_state_dtype_from_config", "wraps",
               "the pseudo-value buffer's dtypes beside the conv and SSM states", ("cls", "vllm_config"))
    for module, model in _GDN_MODELS
)

PATCH_POINTS: tuple[PatchPoint, ...] = (
    *SPECULATIVE_CONFIG,
    V2_UNSUPPORTED_FEATURES,
    GDN_CUDAGRAPH_SUPPORT,
    GDN_FORWARD_CORE,
    RUNNER_AFTER_SAMPLING,
    CPU_GDN_SPEC_AWARE,
    CPU_GDN_SPEC_FORWARD,
    CPU_SSM_STATE_VIEW,
    CPU_UNPACKED_CONV_WEIGHT,
    *MODEL_STATE_SHAPES,
    *MODEL_STATE_DTYPES,
)
