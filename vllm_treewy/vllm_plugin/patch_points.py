"""Every place where the adapter reaches into vLLM 0.32 internals, in one list.

A plugin cannot reach these through a public API, so the adapter rebinds, wraps or overrides functions and methods
(`PATCH_POINTS`: at import, `replace`, or called, `resolve`), and reads or sets attributes of vLLM's objects
(`INTERNAL_ATTRIBUTES`). Each point names the parameters (and, where the adapter unpacks it, the return type) it
relies on, each attribute entry the names; `tests/plugin/test_patch_points.py` fails if vLLM moves, renames or
re-signs one of them, which is the signal to revisit the adapter.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import re
from dataclasses import dataclass


@dataclass(frozen=True)
class PatchPoint:
    module: str
    attribute: str  # dotted path below the module, e.g. "GPUModelRunner._update_states_after_model_execute"
    how: str  # what the adapter does there: "rebinds", "wraps", "overrides", "calls"
    why: str
    parameters: tuple[str, ...] | None = None  # leading parameter names the adapter relies on (None: a class)
    only_on: str | None = None  # "cpu" or "cuda": the adapter touches it on that platform only (None: everywhere)
    returns: str | None = None  # how the annotated return type starts, module paths left out (the adapter unpacks it)
    # vLLM binds the attribute only where its CUDA extensions load (the module imports everywhere): elsewhere the
    # check finds the module and the name in its source, and the parameters are checked on CUDA
    bound_on_cuda_only: bool = False

    def _owner_and_name(self):
        owner = importlib.import_module(self.module)
        *path, name = self.attribute.split(".")
        for part in path:
            owner = getattr(owner, part)
        return owner, name

    def resolve(self):
        owner, name = self._owner_and_name()
        if self.bound_on_cuda_only:
            return getattr(owner, name, None)  # None where vLLM did not bind it (no CUDA extensions)
        return getattr(owner, name)

    def replace(self, new) -> None:
        owner, name = self._owner_and_name()
        setattr(owner, name, new)

    def wrap(self, make_wrapper, *args) -> None:
        """Replaces the attribute by `make_wrapper(current, *args)`, once per process: vLLM calls the plugin's
        `register()` in every process, possibly more than once, and a second wrapper would run the hook twice.
        The wrapper is marked with its maker's name; `functools.wraps` copies the mark into any later wrapper."""
        mark = f"_treewy_{make_wrapper.__name__}"
        if getattr(self.resolve(), mark, False):
            return
        wrapper = make_wrapper(self.resolve(), *args)
        setattr(getattr(wrapper, "__func__", wrapper), mark, True)  # a classmethod: its function (what resolves)
        self.replace(wrapper)

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
        if self.bound_on_cuda_only and not _cuda_extensions_loaded():
            module = importlib.import_module(self.module)
            if not re.search(rf"\b{re.escape(self.attribute)}\b", inspect.getsource(module)):
                raise TypeError(f"{self}: vLLM's module no longer names {self.attribute}")
            return
        target = self.original()
        if self.parameters is None:
            if not inspect.isclass(target):
                raise TypeError(f"{self}: expected a class, found {target!r}")
            return
        signature = inspect.signature(target)
        found = tuple(signature.parameters)[: len(self.parameters)]
        if found != self.parameters:
            raise TypeError(f"{self}: expected parameters {self.parameters}, vLLM has {found}")
        if self.returns is not None:
            annotation = signature.return_annotation
            text = _unqualified(annotation if isinstance(annotation, str) else inspect.formatannotation(annotation))
            if not text.startswith(self.returns):
                raise TypeError(f"{self}: expected a return type starting {self.returns!r}, vLLM has {text!r}")

    def __str__(self) -> str:
        return f"{self.module}.{self.attribute}"


def _cuda_extensions_loaded() -> bool:
    import torch

    return torch.cuda.is_available()


def _unqualified(annotation: str) -> str:
    return re.sub(r"\b(?:[A-Za-z_]\w*\.)+(?=[A-Za-z_])", "", annotation)


@dataclass(frozen=True)
class InternalAttributes:
    """Attributes of one kind of vLLM object that the adapter reads or sets: fields of a dataclass, class attributes
    (methods, properties), or attributes vLLM assigns (`.name =`, or a buffer registered as "name") in the owner's
    module, its vLLM base classes or the module `assigned_in`."""

    module: str
    owner: str  # a class below the module ("": the module's globals)
    names: tuple[str, ...]
    how: str  # "reads", "sets", "reads and sets"
    why: str
    assigned_in: str | None = None  # a module that sets them on the owner's objects (e.g. a backend on a layer)

    def _owner(self):
        owner = importlib.import_module(self.module)
        for part in filter(None, self.owner.split(".")):
            owner = getattr(owner, part)
        return owner

    def missing(self) -> list[str]:
        owner = self._owner()
        fields = {f.name for f in dataclasses.fields(owner)} if dataclasses.is_dataclass(owner) else set()
        bases = owner.__mro__ if inspect.isclass(owner) else ()
        sources = [inspect.getsource(c) for c in bases[1:] if c.__module__.startswith("vllm")]
        for module in (self.module, self.assigned_in):
            if module is not None:
                sources.append(inspect.getsource(importlib.import_module(module)))
        source = "\n".join(sources)

        def assigned(name):
            # `.name =`, `.name: T =`, or one target of a tuple assignment (`self.name, self.other = ...`)
            return re.search(rf"\.{name}\b\s*(:[^=\n]+)?(,\s*[\w.]+)*\s*=(?!=)|[\"']{name}[\"']", source) is not None

        return [n for n in self.names if not (n in fields or hasattr(owner, n) or assigned(n))]

    def check(self) -> None:
        missing = self.missing()
        if missing:
            raise AttributeError(f"{self}: vLLM 0.32's {self.owner} no longer has {missing}")

    def __str__(self) -> str:
        return f"{self.module}.{self.owner}" if self.owner else self.module


_SPEC = "vllm.config.speculative"
_CPU_GDN = "vllm.model_executor.layers.mamba.ops.cpu.gdn_attention"
_GDN_LAYER = "vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn"

SPECULATIVE_CONFIG = tuple(
    PatchPoint(module, "SpeculativeConfig", "rebinds", "every builder of the speculative config builds ours")
    for module in ("vllm.config", _SPEC, "vllm.engine.arg_utils")
)
V2_UNSUPPORTED_FEATURES = PatchPoint(
    "vllm.config.vllm", "VllmConfig._get_v2_model_runner_unsupported_features", "wraps",
    "reconstruct with prefix caching and pipeline parallelism keeps to the V1 runner: list it so vLLM falls back to V1 "
    "and says why (chains and draft trees otherwise run on V2)",
    ("self",),
)
_GDN_BUILDER = "vllm.v1.attention.backends.gdn_attn"
GDN_METADATA_BUILD = PatchPoint(
    _GDN_BUILDER, "GDNAttentionMetadataBuilder.build", "wraps",
    "per step and KV-cache group (and per CUDA-graph capture), outside the graphs: which node each slot commits, "
    "and the slots' counts",
    ("self", "common_prefix_len", "common_attn_metadata", "num_accepted_tokens", "num_decode_draft_tokens_cpu"),
)
GDN_METADATA_UPDATE_BLOCK_TABLE = PatchPoint(
    _GDN_BUILDER, "GDNAttentionMetadataBuilder.update_block_table", "wraps",
    "Model Runner V2 builds the first GDN group's metadata and re-gathers each further group's state indices from it "
    "(per step and per FULL-graph capture): each group's own commit nodes and counts, as build gives them",
    ("self", "metadata", "blk_table", "slot_mapping"), only_on="cuda",
)
GDN_STAGES_SPEC_DECODE = PatchPoint(
    _GDN_BUILDER, "GDNAttentionMetadataBuilder._stage_spec_decode", "calls",
    "whether this batch's spec metadata goes to the FULL-graph buffers (then so do the commit nodes)",
    ("self", "num_prefills", "num_decodes", "num_spec_decodes", "num_spec_decode_tokens"),
)
GDN_FORWARD_CORE_FUSED_NORM = PatchPoint(
    _GDN_LAYER, "QwenGatedDeltaNetAttention._forward_core_fused_norm", "overrides",
    "vLLM's fused-norm GDN op calls it on CUDA (forward_cuda takes that path when the layer's "
    "enable_fused_gdn_spec_decode is set, which the layer does): the speculative tokens go to reconstruct there",
    ("self", "mixed_qkv", "b", "a", "output_gate", "core_attn_out"),
)
GDN_FORWARD_CUDA = PatchPoint(
    _GDN_LAYER, "QwenGatedDeltaNetAttention.forward_cuda", "overrides",
    "vLLM takes the fused-norm path for bf16 activations only: under reconstruct an fp16 model takes it too",
    ("self", "hidden_states"),
)
GDN_FORWARD_CORE_FUSED_NORM_PACKED = PatchPoint(
    _GDN_LAYER, "QwenGatedDeltaNetAttention._forward_core_fused_norm_packed", "overrides",
    "vLLM's fused-norm GDN op calls it with the projections as they come: it splits Qwen3.5's flat layout, so "
    "Qwen3-Next's interleaved one is unpacked here first (CUDA)",
    ("self", "mixed_qkvz", "ba", "core_attn_out"), only_on="cuda",
)
GDN_FIX_QKVZ_ORDERING = PatchPoint(
    _GDN_LAYER, "QwenGatedDeltaNetAttention.fix_query_key_value_ordering", "calls",
    "vLLM's unpacking of Qwen3-Next's interleaved projections into query, key, value, z, b, a",
    ("self", "mixed_qkvz", "mixed_ba"), only_on="cuda",
)
GDN_FUSED_NORM_OP = PatchPoint(
    _GDN_LAYER, "qwen_gdn_attention_core_fused_norm_packed", "calls",
    "the fused-norm GDN op forward_cuda calls for bf16 (registered as torch.ops.vllm.*, a CUDA graph split point)",
    ("mixed_qkvz", "ba", "core_attn_out", "layer_name"),
)
ENCODE_LAYER_NAME = PatchPoint(
    "vllm.utils.torch_utils", "_encode_layer_name", "calls", "the layer name as vLLM's GDN ops take it",
    ("layer_name",),
)
GDN_RMS_NORM_GATED = PatchPoint(
    _GDN_LAYER, "QwenGatedDeltaNetAttention._rms_norm_gated_cuda", "calls",
    "the gated RMSNorm of a mixed batch's prefill tokens, as vLLM's fused-norm path applies it",
    ("self", "x", "output_gate", "out"),
)
_MAMBA_BASE = "vllm.model_executor.layers.mamba.abstract"
MAMBA_KV_CACHE_SPEC = PatchPoint(
    _MAMBA_BASE, "MambaBase.get_kv_cache_spec", "overrides",
    "the GDN layer's page grows by the pseudo-value buffer (reconstruct: no block per draft position)",
    ("self", "vllm_config"),
)
MAMBA_BIND_KV_CACHE = PatchPoint(
    _MAMBA_BASE, "MambaBase.bind_kv_cache", "overrides",
    "views of the page's extra states after vLLM's conv and SSM states, from the raw [B, 1, 1, C] page",
    ("self", "kv_cache"),
)
GDN_FORWARD_CORE = PatchPoint(
    _GDN_LAYER, "QwenGatedDeltaNetAttention._forward_core", "overrides",
    "vLLM's unfused GDN op calls it: refuse speculative tokens there under reconstruct; the prefills of a mixed "
    "batch run through it", ("self", "mixed_qkv", "b", "a", "core_attn_out"),
)
CPU_GDN_SPEC_FORWARD = PatchPoint(
    _CPU_GDN, "_spec_forward", "wraps", "the CPU GDN op's speculative half, looked up at call time",
    ("layer", "attn_metadata_i", "mixed_qkv_spec", "b_spec", "a_spec"), only_on="cpu",
)
CPU_SSM_STATE_VIEW = PatchPoint(
    _CPU_GDN, "_ssm_state_view", "calls", "the CPU SSM cache as vLLM's CPU kernel lays it out", ("layer",),
)
CPU_UNPACKED_CONV_WEIGHT = PatchPoint(
    _CPU_GDN, "_unpacked_conv_weight", "calls", "vLLM packs the CPU conv weight for AMX in place", ("layer",),
)

CPU_REJECTION_EXPAND = PatchPoint(
    "vllm.utils.cpu_triton_utils", "_expand_kernel_impl", "rebinds",
    "vLLM's CPU stand-in for the rejection sampler's per-token expansion of temperature, top-k and top-p writes a "
    "converted copy and leaves the real output uninitialized (cpu_rejection_expand)",
    ("output", "input_val", "cu_num_tokens", "replace_from", "replace_to"), only_on="cpu",
)

_RUNNER = "vllm.v1.worker.gpu_model_runner"
RUNNER_PREPARE_INPUTS = PatchPoint(
    _RUNNER, "GPUModelRunner._prepare_inputs", "wraps",
    "draft trees: find the tree rows from the step's draft counts (num_decode_draft_tokens, query_start_loc, "
    "num_computed_tokens) and give their tokens depth-based positions after vLLM's slot mapping",
    ("self", "scheduler_output", "num_scheduled_tokens"), returns="tuple[Tensor, SpecDecodeMetadata | None",
)
RUNNER_BUILD_ATTENTION_METADATA = PatchPoint(
    _RUNNER, "GPUModelRunner._build_attention_metadata", "wraps",
    "draft trees: the step's tree rows ride on its CPU or TRITON_ATTN attention metadata (and the TRITON_ATTN "
    "layers' caches are recorded for the compaction)", ("self", "num_tokens", "num_reqs"),
    returns="tuple[list[dict[str, AttentionMetadata]] | dict[str, AttentionMetadata], CommonAttentionMetadata | None]",
)
RUNNER_AFTER_SAMPLING = PatchPoint(
    _RUNNER, "GPUModelRunner._update_states_after_model_execute", "wraps",
    "where the V1 runner (the CPU runner inherits it) counts each row's accepted tokens: record them in the "
    "requests' GDN slots (vLLM resets a row's count when a step leaves the request out)",
    ("self", "output_token_ids", "scheduler_output"),
)
RUNNER_EAGLE_PROPOSER = PatchPoint(
    _RUNNER, "EagleProposer", "rebinds",
    "MTP draft trees: the runner builds its MTP/EAGLE drafter from this name; the subclass proposes trees level by "
    "level (vLLM's proposer unchanged for chains; isinstance checks on EagleProposer still hold)",
)
EAGLE_PROPOSE = PatchPoint(
    "vllm.v1.spec_decode.llm_base_proposer", "SpecDecodeBaseProposer.propose", "overrides",
    "MTP draft trees (TreeMtpProposer): the first pass with one draft, then the levels; under "
    "draft_tree_max_batch_size vLLM's chain of the depth the runner asks for (num_speculative_tokens, vLLM's "
    "dynamic speculative decoding)",
    ("self", "num_speculative_tokens", "target_token_ids", "target_positions", "target_hidden_states",
     "next_token_ids", "token_indices_to_sample", "common_attn_metadata", "sampling_metadata"),
)
RUNNER_SAMPLE = PatchPoint(
    _RUNNER, "GPUModelRunner._sample", "wraps",
    "draft trees: tree acceptance with vLLM's sampler level by level instead of the chain rejection sampler; the "
    "output rows it returns keep vLLM's accepted-token bookkeeping right", ("self", "logits", "spec_decode_metadata"),
)
RUNNER_SAMPLE_TOKENS = PatchPoint(
    _RUNNER, "GPUModelRunner.sample_tokens", "wraps",
    "draft trees on V1: a grammar bitmask (structured outputs, refused at admission on trees) raises before vLLM's "
    "apply_grammar_bitmask would mask tree rows as a chain", ("self", "grammar_output"),
)
MIN_TOKENS_MASK = PatchPoint(
    "vllm.v1.sample.logits_processor.builtin", "MinTokensLogitsProcessor._mask_stop_token_logits", "calls",
    "draft trees (min_tokens_at_depth): a tree node's stop tokens masked at its depth's output length, "
    "with vLLM's restore for structured-output rows",
    ("self", "logits", "logits_slice", "restore_logits_slice"),
)
CPU_ATTENTION_FORWARD = PatchPoint(
    "vllm.v1.attention.backends.cpu_attn", "CPUAttentionBackendImpl.forward", "wraps",
    "draft trees: tree-masked attention overwrites the tree rows' output of vLLM's causal CPU kernel",
    ("self", "layer", "query", "key", "value", "kv_cache", "attn_metadata", "output"), only_on="cpu",
)
RUNNER_DETERMINE_BATCH_EXECUTION = PatchPoint(
    _RUNNER, "GPUModelRunner._determine_batch_execution_and_padding", "wraps",
    "reconstruct: a batch that looks like a uniform decode (every request 1 + drafts tokens) but holds a prompt chunk "
    "is not replayed in a FULL CUDA graph (force_uniform_decode=False), whose GDN buffers hold the previous step's "
    "slots (and whose attention took a tree's bias at capture)",
    ("self", "num_tokens", "num_reqs", "num_scheduled_tokens_np", "max_num_scheduled_tokens", "use_cascade_attn",
     "allow_microbatching", "force_eager", "force_uniform_decode"), only_on="cuda",
)
RUNNER_INITIALIZE_METADATA_BUILDERS = PatchPoint(
    _RUNNER, "GPUModelRunner.initialize_metadata_builders", "wraps",
    "start-up of hybrid models: empty the CUDA cache first, so that the builders' buffers do not pin the freed "
    "profiling KV cache's segment and the KV cache fits", ("self", "kv_cache_config", "kernel_block_sizes"),
    only_on="cuda",
)
_TRITON_ATTN = "vllm.v1.attention.backends.triton_attn"
TRITON_ATTENTION_FORWARD = PatchPoint(
    _TRITON_ATTN, "TritonAttentionImpl.forward", "wraps",
    "draft trees on CUDA: the tree bias into vLLM's launch (batches of tree rows and one-token decodes), or the tree "
    "rows recomputed after it (mixed batches)",
    ("self", "layer", "query", "key", "value", "kv_cache", "attn_metadata", "output"), only_on="cuda",
)
TRITON_UNIFIED_ATTENTION = PatchPoint(
    _TRITON_ATTN, "unified_attention", "wraps",
    "the name TritonAttentionImpl.forward launches (a module global): passes the tree's qq_bias while the forward "
    "wrapper holds one; the tree rows' own launch calls it too",
    ("q", "k", "v", "out", "cu_seqlens_q", "max_seqlen_q", "seqused_k", "max_seqlen_k", "softmax_scale", "causal",
     "window_size", "block_table", "softcap", "q_descale", "k_descale", "v_descale"), only_on="cuda",
)
_FLASH_ATTN = "vllm.v1.attention.backends.flash_attn"
FLASH_ATTENTION_FORWARD = PatchPoint(
    _FLASH_ATTN, "FlashAttentionImpl.forward", "wraps",
    "draft trees on CUDA: the two passes merged by log-sum-exp instead of vLLM's launch (batches of tree rows and "
    "one-token decodes), or the tree rows recomputed after it (mixed batches)",
    ("self", "layer", "query", "key", "value", "kv_cache", "attn_metadata", "output"), only_on="cuda",
)
FLASH_ATTN_VARLEN_FUNC = PatchPoint(
    _FLASH_ATTN, "flash_attn_varlen_func", "calls",
    "draft trees on FLASH_ATTN: the prefix pass, the FlashAttention call FlashAttentionImpl makes (a module global "
    "that vLLM binds on CUDA installs only), non-causal with return_softmax_lse=True as its context pass does",
    ("q", "k", "v", "max_seqlen_q", "cu_seqlens_q", "max_seqlen_k", "cu_seqlens_k", "seqused_k"), only_on="cuda",
    bound_on_cuda_only=True,
)

_RUNNER_V2 = "vllm.v1.worker.gpu.model_runner"
V2_RUNNER_POSTPROCESS_SAMPLED = PatchPoint(
    _RUNNER_V2, "GPUModelRunner.postprocess_sampled", "wraps",
    "where Model Runner V2 hands on each batch row's sampled-token count (a device tensor) right after sampling: "
    "a tree config's chain step records its rows' counts in their GDN slots, and with prefix caching every config its "
    "counts and boundary states (v2.accepted_counts; chains without prefix caching commit from V2's own counts)",
    ("self", "idx_mapping", "sampled_tokens", "num_sampled", "num_rejected"), only_on="cuda",
)

# Draft trees on Model Runner V2 (`v2.runner`, CUDA).
V2_RUNNER_PREPARE_ATTN = PatchPoint(
    _RUNNER_V2, "GPUModelRunner.prepare_attn", "wraps",
    "draft trees on V2: after V2's slot mappings (from its device positions), find the step's tree rows from the input "
    "batch's host arrays and give their tokens depth positions in V2's persistent positions buffer",
    ("self", "input_batch"), only_on="cuda",
)
V2_MAMBA_PREPARE_ATTN = PatchPoint(
    "vllm.v1.worker.gpu.model_states.mamba_hybrid", "MambaHybridModelState.prepare_attn", "wraps",
    "draft trees on V2: the tree bias (or, with prefills, the tree step) onto the step's TRITON_ATTN metadata, the "
    "layers' caches recorded for the compaction; uniform 1 + N decode captures get the bias (FULL decode graphs)",
    ("self", "input_batch", "cudagraph_mode", "block_tables", "slot_mappings", "attn_groups", "kv_cache_config",
     "for_capture"), only_on="cuda",
)
V2_RUNNER_SAMPLE = PatchPoint(
    _RUNNER_V2, "GPUModelRunner.sample", "wraps",
    "draft trees on V2: one draw per verified token from V2's sampler and the tree walk over them, instead of V2's "
    "rejection sampler; returns (SamplerOutput, num_sampled, num_rejected) as V2's sample does",
    ("self", "hidden_states", "input_batch", "grammar_output"), only_on="cuda",
    returns="tuple[SamplerOutput, Tensor, Tensor]",
)
V2_RUNNER_ADD_REQUESTS = PatchPoint(
    _RUNNER_V2, "GPUModelRunner.add_requests", "wraps",
    "synthetic tree acceptance on V2 (benchmarks): each new request's rates (its SamplingParams.extra_args, else the "
    "engine's) into its request slot's row of the tree state's rate tensor (trees.synthetic)",
    ("self", "scheduler_output"), only_on="cuda",
)
V2_SAMPLER_SAMPLE = PatchPoint(
    "vllm.v1.worker.gpu.sample.sampler", "Sampler.sample", "calls",
    "draft trees on V2: every logits row's draw with the request's sampling parameters, Gumbel noise keyed by "
    "(seed, position): the tree walk's draws",
    ("self", "logits", "expanded_idx_mapping", "idx_mapping", "idx_mapping_np", "pos", "input_ids",
     "expanded_local_pos", "seq_lens_upper_bound_np"), only_on="cuda", returns="tuple[Tensor, Tensor]",
)
V2_NUM_SAMPLED_AND_REJECTED = PatchPoint(
    "vllm.v1.worker.gpu.input_batch", "get_num_sampled_and_rejected", "calls",
    "draft trees on V2: the rows' emitted and rejected counts as V2's rejection sampler reports them",
    ("num_sampled", "seq_lens", "cu_num_logits", "idx_mapping", "prefill_len"), only_on="cuda",
)
V2_REJECTION_LOGPROBS = PatchPoint(
    "vllm.v1.worker.gpu.spec_decode.rejection_sampler", "RejectionSampler._get_logprobs_tensors", "calls",
    "draft trees on V2: logprobs of the emitted tokens, on the logits rows laid out as each accepted path's chain",
    ("self", "sampled", "num_sampled", "logits", "cu_num_logits", "cu_num_logits_np", "max_num_logprobs"),
    only_on="cuda",
)
V2_RUNNER_EXECUTE_MODEL = PatchPoint(
    _RUNNER_V2, "GPUModelRunner.execute_model", "wraps",
    "draft trees on V2: the runner's tree state (its speculator's) bound for the call, so that the model state's "
    "prepare_attn reaches it without module state that outlives the call (dummy runs go through here too)",
    ("self",), only_on="cuda",
)
V2_RUNNER_CAPTURE_MODEL = PatchPoint(
    _RUNNER_V2, "GPUModelRunner.capture_model", "wraps",
    "draft trees on V2: the runner's tree state bound while V2 captures its graphs (the target's FULL decode graphs "
    "get the tree bias through the model state's prepare_attn); after it, the post-sampler graphs of tree steps "
    "(v2.accept_graphs)", ("self",), only_on="cuda",
)
V2_RUNNER_PROFILE_CUDAGRAPH_MEMORY = PatchPoint(
    _RUNNER_V2, "GPUModelRunner.profile_cudagraph_memory", "wraps",
    "draft trees on V2: the runner's tree state bound while V2 profiles its graphs' memory (captures as above)",
    ("self",), only_on="cuda",
)
INPUT_PROCESSOR_VALIDATE_PARAMS = PatchPoint(
    "vllm.v1.engine.input_processor", "InputProcessor._validate_params", "wraps",
    "draft trees: requests with the sampling parameters a runner's tree path does not make exact refused at "
    "admission (trees.admission: V1's thinking budget and structured outputs; V2's also penalties and bad words)",
    ("self", "params", "supported_tasks"),
)
V2_CAPTURE_POOL = PatchPoint(
    "vllm.compilation.cudagraph_pool", "capture_pool", "calls",
    "draft trees on V2: the level graphs and the post-sampler graphs recorded into V2's graph pool as its "
    "CudaGraphManager records its own",
    ("pool", "vllm_config"), only_on="cuda",
)
V2_GRAPH_CAPTURE = PatchPoint(
    "vllm.distributed.parallel_state", "graph_capture", "calls",
    "draft trees on V2: the level graphs and the post-sampler graphs captured inside vLLM's graph-capture "
    "context, as V2's own",
    ("device",), only_on="cuda",
)
V2_MTP_SPECULATOR = PatchPoint(
    "vllm.v1.worker.gpu.spec_decode.mtp.speculator", "MTPSpeculator", "rebinds",
    "draft trees on V2: init_speculator imports the MTP speculator from here at call time; the subclass drafts trees "
    "(vLLM's class unchanged for chains)", only_on="cuda",
)
V2_SPECULATOR_PROPOSE = PatchPoint(
    "vllm.v1.worker.gpu.spec_decode.target_dependent_ar.speculator", "TargetDependentARSpeculator.propose",
    "overrides", "draft trees on V2: the first pass (vLLM's propose with one draft) over the accepted paths as chains, "
    "then the tree levels; under draft_tree_max_batch_size vLLM's chain of the depth asked for (its keyword "
    "num_speculative_tokens, V2_PROPOSE_KEYWORDS)",
    ("self", "input_batch", "attn_metadata", "slot_mappings", "last_hidden_states", "aux_hidden_states",
     "num_sampled", "num_rejected", "last_sampled", "next_prefill_tokens", "temperature", "seeds"), only_on="cuda",
)
V2_SPECULATOR_RUN_MODEL = PatchPoint(
    "vllm.v1.worker.gpu.spec_decode.target_dependent_ar.speculator", "TargetDependentARSpeculator._run_model",
    "calls", "draft trees on V2: one head forward per tree level, on the drafter's input buffers (eagerly or inside "
    "the level graphs)",
    ("self", "num_tokens", "attn_metadata", "slot_mappings", "num_tokens_across_dp"), only_on="cuda",
)
V2_SPECULATOR_BUILD_ATTN_METADATA = PatchPoint(
    "vllm.v1.worker.gpu.spec_decode.speculator", "DraftModelSpeculator._build_attn_metadata", "calls",
    "draft trees on V2: the head's attention metadata for a level's blocks (query layout, lengths, slots)",
    ("self", "num_reqs", "batch_desc", "query_start_loc_np", "seq_lens_cpu_upper_bound", "step", "causal",
     "dcp_local_seq_lens", "slot_mappings"), only_on="cuda",
)
V2_SPECULATOR_SET_ATTN = PatchPoint(
    "vllm.v1.worker.gpu.spec_decode.speculator", "DraftModelSpeculator.set_attn", "overrides",
    "draft trees on V2: the runner hands the speculator its model state here (the tree state is found by it)",
    ("self", "model_state"), only_on="cuda",
)
V2_SPECULATOR_CAPTURE = PatchPoint(
    "vllm.v1.worker.gpu.spec_decode.target_dependent_ar.speculator", "TargetDependentARSpeculator.capture",
    "overrides", "draft trees on V2: the drafter's first-pass graphs are captured without the tree bias", ("self",),
    only_on="cuda",
)
V2_SLOT_MAPPINGS_BY_LAYER = PatchPoint(
    "vllm.v1.worker.gpu.attn_utils", "build_slot_mappings_by_layer", "calls",
    "draft trees on V2: a level's per-group slots as the forward context takes them", ("slot_mappings",
                                                                                        "kv_cache_config"),
    only_on="cuda",
)
V2_BATCH_EXECUTION_DESCRIPTOR = PatchPoint(
    "vllm.v1.worker.gpu.cudagraph_utils", "BatchExecutionDescriptor", "calls",
    "draft trees on V2: an eager level's batch description (cg_mode, num_tokens, num_reqs)", only_on="cuda",
)

RUNNER_MAMBA_STATE_COPY_FUNCS = PatchPoint(
    _RUNNER, "GPUModelRunner._get_mamba_state_copy_funcs", "wraps",
    "prefix caching (align mode) under reconstruct: vLLM's copy of a request's GDN page into its next running block "
    "takes the pseudo-value buffer's three states too (the pending commit moves with the slot)", ("self",),
)
RUNNER_MAMBA_BUFFERS = PatchPoint(
    _RUNNER, "GPUModelRunner._get_mamba_bufs", "wraps",
    "prefix caching under reconstruct: the runner's align buffers without vLLM's speculative post-processing "
    "context, so that its per-request migration copy runs (the context's fused Triton copies do not exist on CPU)",
    ("self",),
)
_MAMBA_WORKER_UTILS = "vllm.v1.worker.mamba_utils"
MAMBA_ALIGN_POSTPROCESS = PatchPoint(
    _MAMBA_WORKER_UTILS, "postprocess_mamba_align_gpu", "wraps",
    "prefix caching under reconstruct: vLLM's post-sampling copy of store_all's boundary state is skipped (the "
    "runner looks the module attribute up at call time; v1.prefix_caching writes the boundary states) and the host's "
    "accepted counts stay 1, so the next migration copies at offset 0",
    ("bufs", "num_reqs", "num_accepted_tokens_gpu", "num_accepted_tokens_cpu_tensor"),
)
MAMBA_GROUPS = PatchPoint(
    _MAMBA_WORKER_UTILS, "get_mamba_groups", "calls",
    "prefix caching under reconstruct on V2: the GDN groups' specs, whose mamba types the model's copy functions "
    "are asked for (as V2's own initialize_kv_cache asks)", ("kv_cache_config",),
)
MAMBA_VALIDATE_STATE_COPY_FUNCS = PatchPoint(
    _MAMBA_WORKER_UTILS, "validate_mamba_state_copy_funcs", "calls",
    "prefix caching under reconstruct on V2: vLLM's check of the copy functions (with the buffer's) against the pages",
    ("mamba_groups", "copy_funcs"),
)
_MAMBA_HYBRID_STATE = "vllm.v1.worker.gpu.model_states.mamba_hybrid"
V2_MAMBA_INITIALIZE_KV_CACHE = PatchPoint(
    _MAMBA_HYBRID_STATE, "MambaHybridModelState.initialize_kv_cache", "wraps",
    "prefix caching under reconstruct on V2: its fused pre-copy's state table is built here from the model's copy "
    "functions, which get the pseudo-value buffer's three states first (the pending commit moves with the slot)",
    ("self", "kv_cache_config", "block_tables"), only_on="cuda",
)
V2_MAMBA_POSTPROCESS_STATE = PatchPoint(
    _MAMBA_HYBRID_STATE, "MambaHybridModelState.postprocess_state", "wraps",
    "prefix caching under reconstruct on V2: V2's accepted counts stay 1 (its pre-copy migrates at offset 0) and "
    "its store_all boundary copy is skipped; v2.accepted_counts' postprocess_sampled hook writes the boundary states",
    ("self", "idx_mapping", "num_sampled", "num_computed_tokens"), only_on="cuda",
)
MAMBA_TEMPORAL_COPY_SPEC = PatchPoint(
    "vllm.model_executor.layers.mamba.mamba_utils", "get_temporal_copy_spec", "calls",
    "the whole-block copy function of vLLM's align-mode migration, for the pseudo-value buffer's states",
    ("state", "block_ids", "cur_block_idx", "num_accepted_tokens"),
)

SCHEDULER_UPDATE_AFTER_SCHEDULE = PatchPoint(
    "vllm.v1.core.sched.scheduler", "Scheduler._update_after_schedule", "wraps",
    "draft trees: before the step is committed, a request whose whole tree does not fit keeps no drafts",
    ("self", "scheduler_output"),
)
SCHEDULER_UPDATE_FROM_OUTPUT = PatchPoint(
    "vllm.v1.core.sched.scheduler", "Scheduler.update_from_output", "wraps",
    "draft_tree_max_batch_size 'auto': each finished step's accepted drafts per request (sampled_token_ids, "
    "req_id_to_index) teach the shape choice (trees.adaptive_shape)",
    ("self", "scheduler_output", "model_runner_output"),
)
SCHEDULER_MAKE_STATS = PatchPoint(
    "vllm.v1.core.sched.scheduler", "Scheduler.make_stats", "wraps",
    "draft trees: the step's SchedulerStats, which vLLM sends to the front end, carry the tree fallbacks counted "
    "since the last stats (trees.fallbacks)", ("self",), returns="SchedulerStats | None",
)
SCHEDULER_STATS = PatchPoint(
    "vllm.v1.metrics.stats", "SchedulerStats", "calls",
    "trees.fallbacks reads its fields: whether the installed vLLM has plugin_counters (patches/)",
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
    GDN_METADATA_BUILD,
    GDN_METADATA_UPDATE_BLOCK_TABLE,
    GDN_STAGES_SPEC_DECODE,
    GDN_FORWARD_CORE_FUSED_NORM,
    GDN_FORWARD_CUDA,
    GDN_FORWARD_CORE_FUSED_NORM_PACKED,
    GDN_FIX_QKVZ_ORDERING,
    GDN_FUSED_NORM_OP,
    ENCODE_LAYER_NAME,
    GDN_RMS_NORM_GATED,
    GDN_FORWARD_CORE,
    MAMBA_KV_CACHE_SPEC,
    MAMBA_BIND_KV_CACHE,
    CPU_GDN_SPEC_FORWARD,
    CPU_SSM_STATE_VIEW,
    CPU_UNPACKED_CONV_WEIGHT,
    CPU_REJECTION_EXPAND,
    RUNNER_PREPARE_INPUTS,
    RUNNER_BUILD_ATTENTION_METADATA,
    RUNNER_EAGLE_PROPOSER,
    EAGLE_PROPOSE,
    RUNNER_SAMPLE,
    RUNNER_SAMPLE_TOKENS,
    MIN_TOKENS_MASK,
    RUNNER_AFTER_SAMPLING,
    CPU_ATTENTION_FORWARD,
    RUNNER_DETERMINE_BATCH_EXECUTION,
    RUNNER_INITIALIZE_METADATA_BUILDERS,
    TRITON_ATTENTION_FORWARD,
    TRITON_UNIFIED_ATTENTION,
    FLASH_ATTENTION_FORWARD,
    FLASH_ATTN_VARLEN_FUNC,
    V2_RUNNER_POSTPROCESS_SAMPLED,
    V2_RUNNER_PREPARE_ATTN,
    V2_MAMBA_PREPARE_ATTN,
    V2_RUNNER_SAMPLE,
    V2_RUNNER_ADD_REQUESTS,
    V2_SAMPLER_SAMPLE,
    V2_NUM_SAMPLED_AND_REJECTED,
    V2_REJECTION_LOGPROBS,
    V2_RUNNER_EXECUTE_MODEL,
    V2_RUNNER_CAPTURE_MODEL,
    V2_RUNNER_PROFILE_CUDAGRAPH_MEMORY,
    INPUT_PROCESSOR_VALIDATE_PARAMS,
    V2_CAPTURE_POOL,
    V2_GRAPH_CAPTURE,
    V2_MTP_SPECULATOR,
    V2_SPECULATOR_PROPOSE,
    V2_SPECULATOR_RUN_MODEL,
    V2_SPECULATOR_BUILD_ATTN_METADATA,
    V2_SPECULATOR_SET_ATTN,
    V2_SPECULATOR_CAPTURE,
    V2_SLOT_MAPPINGS_BY_LAYER,
    V2_BATCH_EXECUTION_DESCRIPTOR,
    RUNNER_MAMBA_STATE_COPY_FUNCS,
    RUNNER_MAMBA_BUFFERS,
    MAMBA_ALIGN_POSTPROCESS,
    MAMBA_GROUPS,
    MAMBA_VALIDATE_STATE_COPY_FUNCS,
    V2_MAMBA_INITIALIZE_KV_CACHE,
    V2_MAMBA_POSTPROCESS_STATE,
    MAMBA_TEMPORAL_COPY_SPEC,
    SCHEDULER_UPDATE_AFTER_SCHEDULE,
    SCHEDULER_UPDATE_FROM_OUTPUT,
    SCHEDULER_MAKE_STATS,
    SCHEDULER_STATS,
    *MODEL_STATE_SHAPES,
    *MODEL_STATE_DTYPES,
)

_ATTN_LAYER = "vllm.model_executor.layers.attention.attention"
# Keyword parameters of V2_SPECULATOR_PROPOSE the tree speculator passes on by name (checked with it).
V2_PROPOSE_KEYWORDS = ("dummy_run", "num_speculative_tokens")

INTERNAL_ATTRIBUTES: tuple[InternalAttributes, ...] = (
    InternalAttributes(
        "vllm.v1.engine.input_processor", "InputProcessor", ("vllm_config", "speculative_config"), "reads",
        "admission on draft trees (trees.admission): the engine's tree and which runner serves it",
    ),
    InternalAttributes(
        _RUNNER, "GPUModelRunner",
        ("input_batch", "num_accepted_tokens", "num_decode_draft_tokens", "positions", "query_start_loc",
         "kv_cache_config", "compilation_config", "speculative_config", "uniform_decode_query_len", "device"),
        "reads; sets positions",
        "the step's draft counts, accepted counts and positions (device and numpy buffers), the KV-cache groups and "
        "the layers (v1.accepted_counts, v1.runner, v1.full_graph_batches)",
    ),
    InternalAttributes(
        _RUNNER, "GPUModelRunner", ("cache_config", "seq_lens", "_mamba_bufs"), "reads; sets _mamba_bufs",
        "prefix caching (v1.prefix_caching): the GDN cache mode, the step's device sequence lengths (the running "
        "block column and the boundary of each row), the align buffers without the speculative context",
    ),
    InternalAttributes(
        _MAMBA_WORKER_UTILS, "MambaBuffers", ("postprocess_align",), "reads and replaces",
        "prefix caching under reconstruct: the runner's align buffers without the speculative context",
    ),
    InternalAttributes(
        _RUNNER_V2, "GPUModelRunner", ("block_tables", "kv_cache_config", "compilation_config", "speculative_config"),
        "reads", "Model Runner V2: the GDN groups' block tables (rows per request state), the KV-cache groups and the "
        "layers (v2.accepted_counts)",
    ),
    InternalAttributes(
        _RUNNER_V2, "GPUModelRunner", ("cache_config", "input_buffers"), "reads",
        "prefix caching under reconstruct on V2: whether GDN states are cached (align mode) and the step's seq lens "
        "(its persistent input buffer, batch rows) for the boundary states",
    ),
    InternalAttributes(
        _MAMBA_HYBRID_STATE, "MambaHybridModelState",
        ("_align_mode", "_mamba_state_copy_funcs", "recoverssm", "vllm_config", "model"), "reads; sets "
        "_mamba_state_copy_funcs (before V2 would, once)",
        "prefix caching under reconstruct on V2: whether V2 runs its align mode, the copy functions of its fused "
        "pre-copy (the buffer's states added), KDA's recoverssm (refused), the config and the model's copy functions",
    ),
    InternalAttributes(
        _RUNNER_V2, "GPUModelRunner",
        ("speculator", "sampler", "rejection_sampler", "model", "num_speculative_steps", "batch_sharder",
         "model_state", "attn_groups"),
        "reads", "draft trees on V2 (v2.runner): the tree speculator's state, the sampler, the logprobs helper; "
        "the attention groups whose TRITON_ATTN / FLASH_ATTN caches the post-sampler graphs compact (v2.accept_graphs)",
    ),
    InternalAttributes(
        _RUNNER_V2, "GPUModelRunner", ("req_states",), "reads",
        "synthetic tree acceptance on V2: a new request's slot (req_states.req_id_to_index), its rates' row",
    ),
    InternalAttributes(
        "vllm.v1.worker.gpu.states", "RequestState", ("req_id_to_index",), "reads",
        "synthetic tree acceptance on V2: the request slot of a new request",
    ),
    InternalAttributes(
        "vllm.v1.core.sched.output", "SchedulerOutput", ("scheduled_new_reqs",), "reads",
        "synthetic tree acceptance on V2: the step's new requests, whose rates are read once",
    ),
    InternalAttributes(
        "vllm.v1.core.sched.output", "NewRequestData", ("req_id", "sampling_params"), "reads",
        "synthetic tree acceptance on V2: a new request's id and its extra_args' rates",
    ),
    InternalAttributes(
        "vllm.v1.worker.utils", "AttentionGroup", ("backend", "layer_names", "kv_cache_group_id"), "reads",
        "draft trees on V2: the TRITON_ATTN / FLASH_ATTN layers of each KV-cache group, for the post-sampler graphs "
        "(v2.accept_graphs.paged_cache_groups_of)",
    ),
    InternalAttributes(
        "vllm.v1.worker.gpu.input_batch", "InputBatch",
        ("num_reqs", "num_draft_tokens_per_req", "is_prefilling_np", "query_start_loc_np", "positions", "input_ids",
         "logits_indices", "cu_num_logits", "cu_num_logits_np", "expanded_idx_mapping", "expanded_local_pos",
         "idx_mapping", "idx_mapping_np", "seq_lens", "seq_lens_cpu_upper_bound", "prefill_runs_as_decode_np"),
        "reads; replaces input_ids and "
        "positions in a copy", "draft trees on V2: the tree rows, their tokens, logits rows and positions",
    ),
    InternalAttributes(
        "vllm.v1.worker.gpu.input_batch", "InputBuffers", ("input_ids", "positions", "query_start_loc", "seq_lens"),
        "reads and sets", "draft trees on V2: the drafter's level inputs",
    ),
    InternalAttributes(
        "vllm.v1.worker.gpu.block_table", "BlockTables", ("input_block_tables", "block_sizes"), "reads",
        "draft trees on V2: the batch rows' block tables (gathered by the target's prepare_attn) for a level's slots",
    ),
    InternalAttributes(
        "vllm.v1.worker.gpu.spec_decode.target_dependent_ar.speculator", "TargetDependentARSpeculator",
        ("hidden_states", "input_buffers", "last_token_indices", "draft_tokens", "max_num_tokens", "max_model_len",
         "block_tables", "kv_cache_config", "draft_max_seq_len", "model", "device", "model_state", "max_num_reqs",
         "prefill_cudagraph_manager", "vllm_config"),
        "reads; sets draft_tokens, draft_max_seq_len and the input buffers",
        "draft trees on V2: the first pass's root outputs, positions and tokens; the levels' inputs; the first pass's "
        "graph manager, whose FULL sizes and pool the level graphs take",
        assigned_in="vllm.v1.worker.gpu.spec_decode.speculator",
    ),
    InternalAttributes(
        "vllm.v1.worker.gpu.cudagraph_utils", "CudaGraphManager", ("_capture_descs", "pool", "cudagraph_mode"),
        "reads", "draft trees on V2: the level graphs are captured per padded request count of the first pass's FULL "
        "graphs, into the same pool",
    ),
    InternalAttributes(
        "vllm.v1.worker.gpu.sample.sampler", "Sampler", ("req_states", "sampling_states", "logprobs_mode"), "reads",
        "draft trees on V2: the requests' prefill lengths and logprobs counts",
    ),
    InternalAttributes(
        "vllm.v1.worker.gpu.sample.states", "SamplingStates", ("max_num_logprobs",), "reads",
        "draft trees on V2: whether any request asks for logprobs",
    ),
    InternalAttributes(
        "vllm.v1.worker.gpu.sample.output", "SamplerOutput",
        ("sampled_token_ids", "logprobs_tensors", "num_nans", "num_sampled", "num_rejected"), "sets",
        "draft trees on V2: the tree step's sampler output",
    ),
    InternalAttributes(
        "vllm.v1.worker.gpu.block_table", "BlockTables", ("block_tables",), "reads",
        "Model Runner V2: one block table per KV-cache group, a row per request state for the request's life",
    ),
    InternalAttributes(
        "vllm.v1.worker.gpu.buffer_utils", "StagedWriteTensor", ("gpu",), "reads",
        "a V2 block table's device tensor, at a fixed address (the count-address table keeps it)",
    ),
    InternalAttributes(
        "vllm.v1.sample.logits_processor.builtin", "MinTokensLogitsProcessor", ("min_toks", "neg_inf_tensor"), "reads",
        "draft trees (v1.sampler): each request's (min_tokens, output list, stop tokens, structured) and whether "
        "any is pending, to mask a tree node's stop tokens at its depth",
    ),
    InternalAttributes(
        "vllm.v1.worker.gpu_input_batch", "InputBatch",
        ("block_table", "num_reqs", "num_computed_tokens_cpu", "sampling_metadata"), "reads",
        "the GDN groups' slots (block table column 0), the tree rows' committed lengths, greedy sampling",
    ),
    InternalAttributes(
        "vllm.v1.worker.block_table", "MultiGroupBlockTable", ("__getitem__",), "reads", "one block table per group",
    ),
    InternalAttributes(
        "vllm.v1.worker.block_table", "BlockTable", ("block_table", "get_device_tensor"), "reads",
        "a group's device block table, whole (captured graphs read it in place) or for the batch's rows",
    ),
    InternalAttributes(
        "vllm.v1.utils", "CpuGpuBuffer", ("gpu", "np"), "reads", "the runner's buffers on either side",
    ),
    InternalAttributes(
        _GDN_LAYER, "QwenGatedDeltaNetAttention",
        ("kv_cache", "enable_fused_gdn_spec_decode", "prefix", "model_config", "speculative_config", "tp_size",
         "num_k_heads", "num_v_heads", "head_k_dim", "head_v_dim", "gqa_interleaved_layout", "norm", "conv1d",
         "A_log", "dt_bias", "activation", "layer_norm_epsilon", "get_state_shape", "get_state_dtype"),
        "reads; sets enable_fused_gdn_spec_decode and kv_cache",
        "the layer's shapes, weights and states for the fused step; enable_fused_gdn_spec_decode sends speculative "
        "batches to the fused-norm path that reconstruct overrides (vLLM decides it in __init__)",
    ),
    InternalAttributes(
        _GDN_BUILDER, "GDNAttentionMetadata",
        ("num_prefills", "num_decodes", "num_spec_decodes", "num_spec_decode_tokens", "num_actual_tokens",
         "spec_query_start_loc", "spec_state_indices_tensor", "non_spec_state_indices_tensor", "spec_sequence_masks",
         "spec_sequence_masks_cpu", "spec_token_indx", "non_spec_token_indx", "num_accepted_tokens"),
        "reads and sets (a copy without the speculative rows for a mixed batch's prefills)",
        "the speculative rows' slots and tokens and, for chains on Model Runner V2 without prefix caching, their "
        "accepted counts (the commit nodes: step_metadata.uses_runner_accepted_counts); the metadata of a mixed "
        "batch's rest (step_metadata.rest_metadata)",
    ),
    InternalAttributes(
        _MAMBA_HYBRID_STATE, "MambaHybridModelState", ("num_accepted_tokens_gpu",),
        "reads (as the GDN metadata's num_accepted_tokens)",
        "reconstruct chains on V2 without prefix caching commit from V2's accepted count per request state, which its "
        "postprocess_state keeps (max(num_sampled, 1)) and its prepare_attn hands to the GDN builder",
    ),
    InternalAttributes(
        "vllm.config.vllm", "VllmConfig", ("use_v2_model_runner",), "reads",
        "which runner vLLM picks: reconstruct chains on V2 without prefix caching commit from V2's accepted counts "
        "(step_metadata.uses_runner_accepted_counts, read once per GDN layer), and the layer's prefix-caching check",
    ),
    InternalAttributes(
        _GDN_BUILDER, "GDNAttentionMetadataBuilder", ("num_accepted_tokens", "layer_names", "vllm_config"), "reads",
        "the builder's accepted-count buffer (its shape for the commit nodes) and its group's first layer",
    ),
    InternalAttributes(
        "vllm.v1.kv_cache_interface", "MambaSpec",
        ("shapes", "dtypes", "num_speculative_blocks", "block_size", "max_memory_usage_bytes"), "reads and replaces",
        "the GDN page's states (the buffer appended) and its blocks per request",
    ),
    InternalAttributes(
        "vllm.v1.kv_cache_interface", "KVCacheConfig", ("kv_cache_groups", "num_blocks"), "reads",
        "the GDN groups and the KV report",
    ),
    InternalAttributes(
        "vllm.v1.kv_cache_interface", "KVCacheGroupSpec", ("layer_names", "kv_cache_spec"), "reads",
        "which layers a GDN group holds",
    ),
    InternalAttributes(
        "vllm.v1.core.sched.output", "SchedulerOutput",
        ("num_scheduled_tokens", "scheduled_spec_decode_tokens", "total_num_scheduled_tokens"), "reads and sets",
        "draft trees: a request whose whole tree does not fit the step's budget keeps no drafts (trees.budget)",
    ),
    InternalAttributes(
        "vllm.v1.core.sched.output", "SchedulerOutput", ("num_spec_tokens_to_schedule", "finished_req_ids"), "reads",
        "draft_tree_max_batch_size (trees.budget): the draft count each scheduled request's next drafts will have "
        "(vLLM's dynamic speculative decoding), and the requests whose record goes",
    ),
    InternalAttributes(
        "vllm.v1.core.sched.output", "SchedulerOutput", ("num_spec_tokens_to_schedule", "scheduled_new_reqs"),
        "sets num_spec_tokens_to_schedule; reads scheduled_new_reqs",
        "draft_tree_max_batch_size 'auto' (trees.adaptive_shape): the step's next draft count is the chosen shape's; "
        "a step with a new request is not a decode step (its interval is not a step time of one shape)",
    ),
    InternalAttributes(
        "vllm.v1.outputs", "ModelRunnerOutput", ("sampled_token_ids", "req_id_to_index"), "reads",
        "draft_tree_max_batch_size 'auto' (trees.adaptive_shape): the tokens each request emitted, the accepted "
        "drafts plus one",
    ),
    InternalAttributes(
        "vllm.config.speculative", "SpeculativeConfig",
        ("num_speculative_tokens_per_batch_size", "uses_dynamic_speculative_decoding", "enable_adaptive_verification"),
        "reads; sets num_speculative_tokens_per_batch_size",
        "draft_tree_max_batch_size (config): the tree below the threshold, the chain above, as vLLM's dynamic "
        "speculative decoding schedule; V2's tree speculator refuses any other schedule",
    ),
    InternalAttributes(
        "vllm.v1.attention.backends.cpu_attn", "CPUAttentionBackendImpl",
        ("scale", "sliding_window", "logits_soft_cap", "alibi_slopes", "sinks"), "reads",
        "draft trees on CPU: the layer's attention settings, into the tree rows' attention (which refuses what it "
        "does not compute)",
    ),
    InternalAttributes(
        "vllm.v1.attention.backends.cpu_attn", "CPUAttentionMetadata", ("seq_lens", "max_seq_len", "block_table"),
        "reads", "draft trees on CPU: the tree rows' committed lengths and blocks",
    ),
    InternalAttributes(
        _TRITON_ATTN, "TritonAttentionImpl",
        ("scale", "head_size", "sliding_window", "chunk_lookback", "logits_soft_cap", "alibi_slopes", "sinks",
         "kv_cache_dtype", "attn_type"), "reads",
        "draft trees on CUDA: the settings the tree rows' launch passes on, refused where the tree bias is wrong",
    ),
    InternalAttributes(
        _TRITON_ATTN, "TritonAttentionMetadata", ("seq_lens", "max_seq_len", "block_table"), "reads and sets",
        "draft trees on CUDA: the tree rows' launch; the tree bias and step ride on it",
    ),
    InternalAttributes(
        _FLASH_ATTN, "FlashAttentionImpl",
        ("scale", "head_size", "num_kv_heads", "sliding_window", "logits_soft_cap", "alibi_slopes", "sinks",
         "kv_cache_dtype", "attn_type", "vllm_flash_attn_version", "dcp_world_size", "kv_sharing_target_layer_name"),
        "reads", "draft trees on FLASH_ATTN: the settings the two passes pass on, refused where they are wrong",
    ),
    InternalAttributes(
        _FLASH_ATTN, "FlashAttentionMetadata",
        ("query_start_loc", "max_query_len", "seq_lens", "max_seq_len", "block_table", "max_num_splits"), "reads",
        "draft trees on FLASH_ATTN: the two passes' batch; the tree's ancestor table and step ride on it",
    ),
    InternalAttributes(
        _ATTN_LAYER, "Attention", ("kv_cache", "_k_scale", "_v_scale", "isa"), "reads",
        "draft trees: the layer's paged cache, its KV descale (a buffer vLLM registers as \"_k_scale\") for the tree "
        "rows' own launch, and the CPU cache packing (`isa`, which vLLM's CPU builder sets on the layer)",
        assigned_in="vllm.v1.attention.backends.cpu_attn",
    ),
    # the equivalence harness's KV report (in-process engines): llm.llm_engine.engine_core.engine_core.scheduler
    InternalAttributes("vllm.v1.engine.llm_engine", "LLMEngine", ("engine_core", "vllm_config"), "reads",
                       "the KV report: the in-process engine core client"),
    InternalAttributes("vllm.v1.engine.core_client", "InprocClient", ("engine_core",), "reads",
                       "the KV report: the engine core in this process"),
    InternalAttributes("vllm.v1.engine.core", "EngineCore", ("scheduler",), "reads", "the KV report: its scheduler"),
    InternalAttributes("vllm.v1.core.sched.scheduler", "Scheduler", ("kv_cache_config", "vllm_config"), "reads",
                       "the KV report's blocks and pages; draft trees: the speculative config in the schedule hook"),
    # the equivalence harness's check that the adapter keeps no state on vLLM's objects (attributes_added_to_vllm)
    InternalAttributes("vllm.v1.worker.gpu_worker", "Worker", ("model_runner",), "reads",
                       "the added-attributes check: each worker's model runner (the CPU worker inherits it)"),
    InternalAttributes(_RUNNER, "GPUModelRunner", ("attn_groups", "drafter"), "reads",
                       "the added-attributes check: the runner's attention groups and drafter"),
    InternalAttributes("vllm.v1.worker.utils", "AttentionGroup", ("metadata_builders",), "reads",
                       "the added-attributes check: a group's metadata builders (one per microbatch)"),
    InternalAttributes("vllm.v1.spec_decode.llm_base_proposer", "SpecDecodeBaseProposer", ("draft_attn_groups",),
                       "reads", "the added-attributes check: the drafter's attention groups"),
    InternalAttributes(
        "vllm.v1.metrics.stats", "SchedulerStats", ("plugin_counters",), "sets",
        "tree fallbacks into the step's stats (trees.fallbacks); the field comes from "
        "patches/vllm-0.32.0-plugin-counters.diff, which `make install` applies: missing means it is not applied",
    ),
    InternalAttributes(
        "vllm.model_executor.custom_op", "", ("op_registry_oot", "PluggableLayer"), "reads",
        "the GDN layer class replaces vLLM's through PluggableLayer.register_oot, once (the registry says whether)",
    ),
)
