"""Greedy output equivalence of speculative decoding against the no-speculation engine, tie-aware.

Greedy bf16 outputs can legitimately differ where the reference's top two logits are within one bf16 step of
each other (different kernels round differently). So each prompt is compared up to its first differing token;
that divergence is a failure only if the reference, re-scored with `prompt_logprobs` in `raw_logits` mode,
separates its own token from the speculative engine's token (or, if that token is not in its top two, from its
second choice) by more than one bf16 step of the top logit, and, where an exact (fp64) evaluation of the model is
at hand, only if that exact model also prefers the reference's token by more than one bf16 step: the bf16
reference is itself rounded, and where it is the one that strays from the model, the speculative engine is right.
An example on the fixture (a CPU without AVX-512-BF16): the no-speculation engine chose token 284 over 46
by 0.0625 (two bf16 steps) at prompt 7, token 14, where the fp64 model prefers 46 by 0.0946 and transformers' own
bf16 evaluation has the two exactly tied; reconstruct chose 46.
"""

from __future__ import annotations

import contextlib
import gc
import math
import os
from dataclasses import dataclass, field
from typing import Callable

import torch

# In-process engine core: starts in seconds, and tests can patch vLLM internals it runs.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

from vllm import LLM, SamplingParams  # noqa: E402

# What vLLM's CPU backend needs to run the fixture with MTP: bf16 (its GDN kernel's dtype) and no prefix
# caching (unsupported with MTP on CPU). Eager mode skips a minute of torch.compile warm-up per engine. On CPU
# `gpu_memory_utilization` is only a start-up check of free host memory: keep it low so that a reference engine
# and a speculative engine fit side by side on a small machine (the KV cache is VLLM_CPU_KVCACHE_SPACE GiB).
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
ENGINE_DEFAULTS = dict(
    gpu_memory_utilization=0.2,
    dtype="bfloat16",
    enable_prefix_caching=False,
    enforce_eager=True,
    max_model_len=512,
    seed=0,
    disable_log_stats=False,
)


@contextlib.contextmanager
def engine(model: str, **kwargs):
    """An in-process `LLM`, torn down on exit so the next one can start in the same process, also when it fails
    to start (vLLM's distributed state is set up before a start-up check can refuse the configuration; a next engine
    would find it and keep it, e.g. without the expert-parallel group a MoE model needs).

    Engines in one process share vLLM's distributed state: run them one after another, never nested.
    """
    from vllm.distributed import cleanup_dist_env_and_memory  # imported once an engine runs, after its set-up
    from vllm.distributed.parallel_state import model_parallel_is_initialized

    llm = None
    try:
        # What the process holds before the engine (vLLM, torch, a test session's results) outlives it: frozen, out of
        # the collector's sight while the engine starts. vLLM's loader and memory profiler collect garbage several
        # times per start, each a walk over every object of the process (about 700k once vLLM is imported: seconds
        # per start in a test process, against a fraction of a second in a fresh one). Only the walk is saved:
        # vLLM freezes its heap itself once started, and the teardown below unfreezes and collects everything.
        gc.freeze()
        llm = LLM(model=model, **{**ENGINE_DEFAULTS, **kwargs})
        yield llm
    finally:
        if llm is not None:
            # Shut down here, not when the last reference goes (the caller's `with ... as llm` keeps one until its
            # function returns): vLLM's shutdown ends the executor (a TP engine's workers), tears its distributed
            # state down and collects the garbage, once; a closed engine left in a variable then tears down nothing.
            llm.llm_engine.engine_core.shutdown()
        del llm
        if model_parallel_is_initialized() or torch.distributed.is_initialized():  # an engine that failed to start
            gc.collect()
            cleanup_dist_env_and_memory()


@dataclass
class SpecDecodeAcceptance:
    """vLLM's own spec-decode counters (`vllm:spec_decode_*`)."""

    num_drafts: int
    num_draft_tokens: int
    num_accepted_tokens: int
    accepted_per_position: list[int]

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / max(self.num_draft_tokens, 1)

    @property
    def mean_acceptance_length(self) -> float:
        """1 + accepted drafts per verify: the tokens a verify emits, the bonus included."""
        return 1 + self.num_accepted_tokens / max(self.num_drafts, 1)

    @property
    def per_position_rate(self) -> list[float]:
        """Accepted drafts per verify at each draft position (for a draft tree: position i is depth i + 1)."""
        return [a / max(self.num_drafts, 1) for a in self.accepted_per_position]

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens emitted per verify: the accepted drafts plus the bonus token (vLLM's definition)."""
        return 1 + self.num_accepted_tokens / max(self.num_drafts, 1)


def read_acceptance(llm: LLM) -> SpecDecodeAcceptance | None:
    """The spec-decode counters since the engine started; None if it does not speculate."""
    metrics = {m.name: m for m in llm.get_metrics()}
    if "vllm:spec_decode_num_drafts" not in metrics:
        return None
    return SpecDecodeAcceptance(
        num_drafts=metrics["vllm:spec_decode_num_drafts"].value,
        num_draft_tokens=metrics["vllm:spec_decode_num_draft_tokens"].value,
        num_accepted_tokens=metrics["vllm:spec_decode_num_accepted_tokens"].value,
        accepted_per_position=list(metrics["vllm:spec_decode_num_accepted_tokens_per_pos"].values),
    )


def acceptance_since(before: SpecDecodeAcceptance | None,
                     after: SpecDecodeAcceptance | None) -> SpecDecodeAcceptance | None:
    """The spec-decode counters between two reads of one engine."""
    if before is None:
        return after
    return SpecDecodeAcceptance(
        after.num_drafts - before.num_drafts, after.num_draft_tokens - before.num_draft_tokens,
        after.num_accepted_tokens - before.num_accepted_tokens,
        [a - b for a, b in zip(after.accepted_per_position, before.accepted_per_position, strict=True)])


def mtp_tree_config(widths: list[int], mamba_state_commit: str = "reconstruct") -> dict:
    """The `speculative_config` of the model's MTP head drafting a tree of these widths, one per depth (all 1: vLLM's
    MTP chain of that depth)."""
    return {"method": "mtp", "num_speculative_tokens": len(widths), "draft_tree_widths": list(widths),
            "mamba_state_commit": mamba_state_commit}


def greedy_params(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def generate_greedy(llm: LLM, prompt_ids: list[list[int]], max_tokens: list[int]) -> list[list[int]]:
    """Greedy continuations, all prompts submitted at once (so prefills and decodes share batches)."""
    return _generate(llm, prompt_ids, [greedy_params(n) for n in max_tokens])


def generate_sampled(llm: LLM, prompt_ids: list[list[int]], max_tokens: list[int], temperature: float,
                     top_p: float = 1.0, first_seed: int = 0) -> list[list[int]]:
    """Sampled continuations (request i seeded `first_seed + i`, so that every pass and engine draws the same seeds),
    all prompts submitted at once."""
    return _generate(llm, prompt_ids, [SamplingParams(temperature=temperature, top_p=top_p, seed=first_seed + i,
                                                      max_tokens=n, ignore_eos=True)
                                       for i, n in enumerate(max_tokens)])  # fmt: skip


def _generate(llm: LLM, prompt_ids: list[list[int]], params: list[SamplingParams]) -> list[list[int]]:
    outputs = llm.generate([{"prompt_token_ids": ids} for ids in prompt_ids], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


@dataclass
class GenerationRun:
    outputs: list[list[int]]
    acceptance: SpecDecodeAcceptance | None
    kv_cache: KVCacheReport | None = None
    num_preemptions: int = 0
    added_attributes: list[str] = field(default_factory=list)  # `attributes_added_to_vllm` after the generation


def run_greedy(model: str, prompt_ids: list[list[int]], max_tokens: list[int], **engine_kwargs) -> GenerationRun:
    """Starts an engine, generates greedily (`generate_run`), tears it down."""
    with engine(model, **engine_kwargs) as llm:
        return generate_run(llm, prompt_ids, max_tokens)


def generate_run(llm: LLM, prompt_ids: list[list[int]], max_tokens: list[int]) -> GenerationRun:
    """Generates greedily on a running engine: the outputs, the spec-decode and preemption counters of these requests
    alone (vLLM's count from the engine's start), its KV-cache report and the attributes the adapter added to vLLM's
    objects so far."""
    acceptance, preemptions = read_acceptance(llm), read_preemptions(llm)
    outputs = generate_greedy(llm, prompt_ids, max_tokens)
    return GenerationRun(outputs, acceptance_since(acceptance, read_acceptance(llm)), kv_cache_report(llm),
                         read_preemptions(llm) - preemptions, attributes_added_to_vllm(llm))


# The adapter's names contain this; none may be set on vLLM's objects (state that crosses steps lives in buffers
# vLLM allocates or in objects of the adapter: the GDN layers' `step_buffers` and `gdn.sampling_tables`, the tree
# drafter's `tree_state`).
ADAPTER_MARK = "treewy"


def _runner_attributes_added(worker) -> list[str]:
    """On one worker (`LLM.collective_rpc`): `object.name` of each attribute named with `ADAPTER_MARK` on its model
    runner and on the runner's and its drafter's attention metadata builders."""
    runner = worker.model_runner
    objects = {"runner": runner}
    for group_id, groups in enumerate(getattr(runner, "attn_groups", ())):
        for i, group in enumerate(groups):
            objects.update({f"builder[{group_id}][{i}][{u}]": b for u, b in enumerate(group.metadata_builders)})
    for i, group in enumerate(getattr(getattr(runner, "drafter", None), "draft_attn_groups", ())):
        objects.update({f"drafter builder[{i}][{u}]": b for u, b in enumerate(group.metadata_builders)})
    return [f"{owner}.{name}" for owner, obj in objects.items() for name in vars(obj) if ADAPTER_MARK in name]


def attributes_added_to_vllm(llm: LLM) -> list[str]:
    """`object.name` of each attribute named with `ADAPTER_MARK` on vLLM's scheduler (an in-process engine core),
    each worker's model runner and its attention metadata builders: empty unless the adapter keeps state on them."""
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    added = [f"scheduler.{name}" for name in vars(scheduler) if ADAPTER_MARK in name]
    return added + [name for worker in llm.collective_rpc(_runner_attributes_added) for name in worker]


def read_preemptions(llm: LLM) -> int:
    """How many times the engine's scheduler preempted a running request so far."""
    preemptions = {m.name: m for m in llm.get_metrics()}.get("vllm:num_preemptions")
    return int(preemptions.value) if preemptions else 0


def bf16_step(x: float) -> float:
    """Spacing of bfloat16 numbers at |x| (8 significant bits)."""
    if x == 0.0 or not math.isfinite(x):
        return 2.0**-133
    return 2.0 ** (math.floor(math.log2(abs(x))) - 7)


@dataclass
class Divergence:
    prompt_index: int
    position: int  # index into the generated tokens
    reference_token: int
    candidate_token: int
    logit_gap: float
    bf16_step: float
    exact_gap: float | None = None  # the same gap in the exact (fp64) model, where one was at hand

    @property
    def is_tie(self) -> bool:
        return self.logit_gap <= self.bf16_step

    @property
    def is_failure(self) -> bool:
        reference_strayed = self.exact_gap is not None and self.exact_gap <= self.bf16_step
        return not self.is_tie and not reference_strayed


@dataclass
class EquivalenceVerdict:
    num_prompts: int
    num_tokens_compared: int
    divergences: list[Divergence] = field(default_factory=list)

    @property
    def ties(self) -> list[Divergence]:
        return [d for d in self.divergences if d.is_tie]

    @property
    def failures(self) -> list[Divergence]:
        return [d for d in self.divergences if d.is_failure]

    @property
    def excused(self) -> list[Divergence]:
        """Divergences at a bf16 tie or where the exact model sides with the candidate."""
        return [d for d in self.divergences if not d.is_failure]

    @property
    def passed(self) -> bool:
        return not self.failures

    def summary(self) -> str:
        exact = self.num_prompts - len(self.divergences)
        text = (
            f"{'PASS' if self.passed else 'FAIL'}: {exact}/{self.num_prompts} prompts identical, "
            f"{len(self.ties)} diverge at a bf16 tie, {len(self.excused) - len(self.ties)} where the exact model "
            f"sides with the candidate, {len(self.failures)} diverge beyond one bf16 step"
        )
        for d in self.failures[:5]:
            text += (
                f"\n  prompt {d.prompt_index} token {d.position}: reference {d.reference_token}, "
                f"got {d.candidate_token}, logit gap {d.logit_gap:.4g} > bf16 step {d.bf16_step:.3g}"
                + ("" if d.exact_gap is None else f" (exact model: {d.exact_gap:.4g})")
            )
        return text


def compare_tie_aware(
    reference_llm: LLM,
    prompt_ids: list[list[int]],
    reference_outputs: list[list[int]],
    candidate_outputs: list[list[int]],
    exact_logits: Callable[[list[int]], torch.Tensor] | None = None,
) -> EquivalenceVerdict:
    """Compares candidate against reference outputs; `reference_llm` must run with logprobs_mode="raw_logits".

    `exact_logits(token_ids)`: the exact model's next-token logits, consulted where a divergence exceeds a tie.
    """
    assert reference_llm.llm_engine.model_config.logprobs_mode == "raw_logits", "re-scoring needs raw logits"
    verdict = EquivalenceVerdict(len(prompt_ids), sum(map(len, reference_outputs)))
    first_diffs = {}
    for i, (ref, cand) in enumerate(zip(reference_outputs, candidate_outputs, strict=True)):
        pos = next((t for t, (a, b) in enumerate(zip(ref, cand)) if a != b), None)
        if pos is None and len(ref) != len(cand):
            raise AssertionError(f"prompt {i}: {len(cand)} tokens generated, reference has {len(ref)}")
        if pos is not None:
            first_diffs[i] = pos
    if not first_diffs:
        return verdict

    order = sorted(first_diffs)
    rescore = reference_llm.generate(
        [{"prompt_token_ids": prompt_ids[i] + reference_outputs[i][: first_diffs[i] + 1]} for i in order],
        SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=2),
        use_tqdm=False,
    )
    for i, result in zip(order, rescore):
        pos = first_diffs[i]
        ref_token, cand_token = reference_outputs[i][pos], candidate_outputs[i][pos]
        logits = result.prompt_logprobs[len(prompt_ids[i]) + pos]  # token id -> Logprob (raw logit here)
        ranked = sorted(logits.items(), key=lambda kv: kv[1].logprob, reverse=True)
        top = ranked[0][1].logprob
        rival = logits[cand_token].logprob if cand_token in logits else ranked[1][1].logprob
        divergence = Divergence(i, pos, ref_token, cand_token, logits[ref_token].logprob - rival, bf16_step(top))
        if not divergence.is_tie and exact_logits is not None:
            exact = exact_logits(prompt_ids[i] + reference_outputs[i][:pos])
            divergence.exact_gap = float(exact[ref_token] - exact[cand_token])
        verdict.divergences.append(divergence)
    return verdict


def compare_teacher_forced(
    llm: LLM,
    prompt_ids: list[list[int]],
    candidate_outputs: list[list[int]],
    exact_logits: Callable[[list[int]], torch.Tensor] | None = None,
) -> EquivalenceVerdict:
    """Every generated token against the same model's prefill logits for its own prefix (no second engine).

    The engine's prompt logits (`raw_logits` mode) come from vLLM's prefill path, which never speculates; a
    greedy token passes where it is that path's top token or within one bf16 step of it. Each prompt's first
    token that is not the top one is recorded (a tie or a failure); a failure anywhere in a prompt is recorded
    even after a tie. Stronger than `compare_tie_aware` (every position is checked, in its own context), but
    prefill and decode kernels round differently, so near-ties show up as ties here too. `exact_logits` as in
    `compare_tie_aware`: a token beyond a tie passes where the exact model does not prefer the prefill's choice.
    """
    assert llm.llm_engine.model_config.logprobs_mode == "raw_logits", "re-scoring needs raw logits"
    verdict = EquivalenceVerdict(len(prompt_ids), sum(map(len, candidate_outputs)))
    rescore = llm.generate(
        [{"prompt_token_ids": p + c} for p, c in zip(prompt_ids, candidate_outputs)],
        SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1),
        use_tqdm=False,
    )
    for i, (prompt, candidate, result) in enumerate(zip(prompt_ids, candidate_outputs, rescore)):
        first_excused = None
        for pos, token in enumerate(candidate):
            logits = result.prompt_logprobs[len(prompt) + pos]  # token id -> Logprob (raw logit here)
            top_token, top = max(logits.items(), key=lambda kv: kv[1].logprob)
            if top_token == token:
                continue
            divergence = Divergence(i, pos, top_token, token, top.logprob - logits[token].logprob,
                                    bf16_step(top.logprob))
            if not divergence.is_tie and exact_logits is not None:
                exact = exact_logits(prompt + candidate[:pos])
                divergence.exact_gap = float(exact[top_token] - exact[token])
            if divergence.is_failure:
                verdict.divergences.append(divergence)
                break
            first_excused = first_excused or divergence
        else:
            if first_excused is not None:
                verdict.divergences.append(first_excused)
    return verdict


@dataclass
class KVCacheReport:
    """What vLLM's own KV-cache config says about a running engine."""

    num_blocks: int
    max_concurrency: float  # requests of max_model_len that fit, as vLLM logs it
    # per GDN (Mamba) group, the pages vLLM reserves a request: 1 + num_speculative_blocks, in align mode (prefix
    # caching) 2 + num_speculative_blocks
    gdn_blocks_per_request: list[int]
    gdn_state_bytes_per_request: int  # all GDN layers, at the pages vLLM allocates
    # all GDN layers: states on the page beyond vLLM's conv and SSM state (reconstruct's pseudo-value buffer)
    gdn_buffer_bytes_per_request: int = 0
    # tokens per block of the attention groups: vLLM grows it until an attention page holds a GDN page
    attention_block_size: int | None = None


def kv_cache_report(llm: LLM) -> KVCacheReport:
    """Reads an in-process engine's KV-cache config (needs VLLM_ENABLE_V1_MULTIPROCESSING=0)."""
    # vLLM's KV-cache internals, read from a running engine only
    from vllm.utils.torch_utils import get_dtype_size
    from vllm.v1.core.kv_cache_utils import get_max_concurrency_for_kv_cache_config
    from vllm.v1.kv_cache_interface import MambaSpec

    vllm_config = llm.llm_engine.vllm_config
    kv_cache_config = llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_config
    blocks, state_bytes, buffer_bytes, attention_block_size = [], 0, 0, None
    for group in kv_cache_config.kv_cache_groups:
        spec = group.kv_cache_spec
        if not isinstance(spec, MambaSpec):
            attention_block_size = spec.block_size
        if isinstance(spec, MambaSpec):
            blocks.append(spec.max_memory_usage_bytes(vllm_config) // spec.page_size_bytes)
            state_bytes += len(group.layer_names) * spec.max_memory_usage_bytes(vllm_config)
            buffer_bytes += len(group.layer_names) * sum(
                math.prod(shape) * get_dtype_size(dtype) for shape, dtype in zip(spec.shapes[2:], spec.dtypes[2:]))
    return KVCacheReport(
        num_blocks=kv_cache_config.num_blocks,
        max_concurrency=get_max_concurrency_for_kv_cache_config(vllm_config, kv_cache_config),
        gdn_blocks_per_request=blocks,
        gdn_state_bytes_per_request=state_bytes,
        gdn_buffer_bytes_per_request=buffer_bytes,
        attention_block_size=attention_block_size,
    )
