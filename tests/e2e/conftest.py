"""End-to-end fixtures: the project's tiny Qwen3.5 model, its prompts, and every engine run of the suite.

vLLM engines in one process must run one after another, and the tie-aware comparison re-scores divergences
with the reference engine, so all speculative runs happen first (once per session; the runs of one engine
configuration, planted bugs included, on one engine) and one no-speculation engine then generates the references and
judges every run.
"""

import contextlib
import json
from dataclasses import dataclass, field

import pytest
import torch
import vllm.model_executor.layers.mamba.ops.cpu.gdn_attention as cpu_gdn

from tests.e2e.planted_bugs import planted_state_commit_bug
from vllm_treewy.fixture import build_fixture, fixture_prompts, prompts_before_a_block_boundary
from vllm_treewy.fixture.exact import ExactModel
from vllm_treewy.vllm_plugin.gdn.layer import ReconstructGatedDeltaNetAttention
from vllm_treewy.vllm_plugin.testing.equivalence import (
    EquivalenceVerdict,
    GenerationRun,
    compare_teacher_forced,
    compare_tie_aware,
    engine,
    generate_greedy,
    generate_run,
)

NUM_PROMPTS = 32
SPEC_KS = (1, 3, 4)  # vLLM's recommended 1, the README's 3, and past it (k = 2 is between: two engine starts)
STRATEGIES = ("store_all", "reconstruct")
PLANTED_BUGS = ("off_by_one", "no_rollback")
TEACHER_FORCED_RUNS = ("reconstruct-k3", "store_all-k3", *PLANTED_BUGS)
# Few concurrent sequences: prompts queue up and prefill while earlier ones are in speculative decode.
MAX_NUM_SEQS = 6
# Preemption workload: prompts of 230-237 tokens that cross the chains' 256-token attention block while decoding, in
# a KV cache of 12 blocks (3 requests' worth at max_model_len), so running requests get preempted.
NUM_LONG_PROMPTS = 8
ATTENTION_BLOCK_SIZE = 256
PREEMPTION_NUM_BLOCKS = 12


def mtp(k: int, strategy: str = "store_all") -> dict:
    return {"method": "mtp", "num_speculative_tokens": k, "mamba_state_commit": strategy}


@dataclass
class E2ERuns:
    runs: dict = field(default_factory=dict)  # name -> GenerationRun
    verdicts: dict = field(default_factory=dict)  # name -> EquivalenceVerdict
    teacher_forced: dict = field(default_factory=dict)  # name -> EquivalenceVerdict (compare_teacher_forced)
    mixed_batches: dict = field(default_factory=dict)  # name -> counts of GDN batches
    reference: dict = field(default_factory=dict)  # workload -> reference outputs

    def run(self, name) -> GenerationRun:
        return self.runs[name]

    def verdict(self, name) -> EquivalenceVerdict:
        return self.verdicts[name]


def _new_prefill_slots(metadata) -> set[int]:
    """State slots of the batch's prefills that start from no state (new or recomputed requests)."""
    if metadata.num_prefills == 0 or metadata.has_initial_state is None:
        return set()
    return set(metadata.non_spec_state_indices_tensor[~metadata.has_initial_state].tolist())


@contextlib.contextmanager
def count_mixed_batches(counter: dict):
    """Counts GDN forward calls whose batch holds both speculative decodes and prefills, and those where a new
    prefill takes a state slot that a speculative decode held in the layer's previous step (a request that
    finished or was preempted right after a step, its slot handed on at once)."""
    original = cpu_gdn._cpu_gdn_attention_spec_aware
    previous_spec_slots = {}  # layer -> slots of its previous step's speculative decodes

    def counting(layer, metadata, *args, **kwargs):
        counter["spec_batches"] = counter.get("spec_batches", 0) + (metadata.num_spec_decodes > 0)
        counter["mixed_batches"] = counter.get("mixed_batches", 0) + (
            metadata.num_spec_decodes > 0 and metadata.num_prefills > 0
        )
        reused = _new_prefill_slots(metadata) & previous_spec_slots.get(layer.prefix, set())
        counter["slot_reused_next_step"] = counter.get("slot_reused_next_step", 0) + bool(reused)
        spec = metadata.spec_state_indices_tensor
        previous_spec_slots[layer.prefix] = set(spec[: metadata.num_spec_decodes, 0].tolist()) if (
            metadata.num_spec_decodes > 0) else set()
        return original(layer, metadata, *args, **kwargs)

    cpu_gdn._cpu_gdn_attention_spec_aware = counting
    try:
        yield
    finally:
        cpu_gdn._cpu_gdn_attention_spec_aware = original


@contextlib.contextmanager
def verify_inputs_overwritten(counter: dict):
    """Overwrites what each reconstruct step was handed as soon as it returns, as vLLM's CUDA graphs do on the GPU
    (the GDN op's inputs live in the graph pool, which the next pieces of the forward reuse). The commit inside the
    next step must read the pseudo-value buffer: a commit that read them would rebuild the state from noise."""
    original = ReconstructGatedDeltaNetAttention.speculative_step

    def verify_then_overwrite(layer, metadata, x, a, b):
        out = original(layer, metadata, x, a, b)
        for t in (x, a, b):
            t.copy_(torch.randn_like(t))
        counter["overwritten"] = counter.get("overwritten", 0) + 1
        return out

    ReconstructGatedDeltaNetAttention.speculative_step = verify_then_overwrite
    try:
        yield
    finally:
        ReconstructGatedDeltaNetAttention.speculative_step = original


def _planted(bug: str | None, counter: dict):
    if bug is None:
        return contextlib.nullcontext()
    if bug == "overwrite_verify_inputs":
        return verify_inputs_overwritten(counter)
    return planted_state_commit_bug(bug)


def _run_on_one_engine(results: E2ERuns, model: str, workloads: dict, runs: list) -> None:
    """Runs of one engine configuration (workload, speculative config) on one engine, one `generate` after another,
    each with its own planted bug and counters (no prefix caching: a run finds nothing of the runs before it but
    freed blocks and state slots)."""
    _, workload, spec, _ = runs[0]
    kwargs = dict(max_num_seqs=MAX_NUM_SEQS, speculative_config=spec)
    if workload == "long":
        kwargs.update(num_gpu_blocks_override=PREEMPTION_NUM_BLOCKS, max_num_seqs=NUM_LONG_PROMPTS)
    with engine(model, **kwargs) as llm:
        for name, workload, _, bug in runs:
            counter = results.mixed_batches.setdefault(name, {})
            with count_mixed_batches(counter), _planted(bug, counter):
                results.runs[name] = generate_run(llm, *workloads[workload])


@pytest.fixture(scope="session")
def fixture_model(tmp_path_factory) -> str:
    return str(build_fixture(tmp_path_factory.mktemp("qwen35-tiny")))


@pytest.fixture(scope="session")
def workloads(fixture_model) -> dict:
    from transformers import AutoTokenizer

    prompts = fixture_prompts(AutoTokenizer.from_pretrained(fixture_model), NUM_PROMPTS)
    tokens = [t for p in prompts for t in p]
    long_prompts = prompts_before_a_block_boundary(tokens, ATTENTION_BLOCK_SIZE, NUM_LONG_PROMPTS, offset=0)
    # Different lengths make requests finish at different steps, so later prompts prefill beside decodes.
    return {
        "standard": (prompts, [20 + (i * 7) % 17 for i in range(NUM_PROMPTS)]),
        "long": (long_prompts, [40] * NUM_LONG_PROMPTS),
    }


@pytest.fixture(scope="session")
def e2e(fixture_model, workloads) -> E2ERuns:
    results = E2ERuns()
    plan = [(f"{s}-k{k}", "standard", mtp(k, s), None) for k in SPEC_KS for s in STRATEGIES]
    plan += [(bug, "standard", mtp(3), bug) for bug in PLANTED_BUGS]
    plan += [("reconstruct-preempted", "long", mtp(3, "reconstruct"), None)]
    plan += [("reconstruct-inputs-overwritten", "standard", mtp(3, "reconstruct"), "overwrite_verify_inputs")]
    engines = {}  # engine configuration -> its runs, in the plan's order (a planted bug's after the sound run's)
    for name, workload, spec, bug in plan:
        engines.setdefault(json.dumps([workload, spec], sort_keys=True), []).append((name, workload, spec, bug))
    for runs in engines.values():
        _run_on_one_engine(results, fixture_model, workloads, runs)

    exact = ExactModel(fixture_model)
    with engine(fixture_model, logprobs_mode="raw_logits", max_num_seqs=MAX_NUM_SEQS) as reference:
        for workload, (prompts, max_tokens) in workloads.items():
            results.reference[workload] = generate_greedy(reference, prompts, max_tokens)
        for name, workload, _, _ in plan:
            prompts, _ = workloads[workload]
            results.verdicts[name] = compare_tie_aware(
                reference, prompts, results.reference[workload], results.runs[name].outputs, exact.next_token_logits
            )
        # The bench's one-engine check (`--self-check` on the GPU), held against runs known good and bad.
        for name in TEACHER_FORCED_RUNS:
            results.teacher_forced[name] = compare_teacher_forced(
                reference, workloads["standard"][0], results.runs[name].outputs, exact.next_token_logits)
    return results
