"""Reconstruct vs store_all in real vLLM 0.32 on a CUDA GPU: tie-aware greedy equivalence, throughput, GDN memory.

Runs on the H200 through `../shared/tools/gpu-vllm` (vLLM with its compiled CUDA ops), in vLLM's default mode
(torch.compile + CUDA graphs; `--eager` for the second opinion). One engine per process (a second `LLM` in one
process fails there), so a shell loop (`bench/e2e/run_gpu_vllm_e2e.sh`) runs the speculative engines first and the
no-speculation reference last:

    source .gpu-vllm/device-setup.sh
    for s in store_all reconstruct; do
      python3 bench/e2e/gpu_vllm_e2e.py spec --strategy $s --k 3 --runs $OUT/runs
    done
    python3 bench/e2e/gpu_vllm_e2e.py reference --runs $OUT/runs --out $OUT/gpu_vllm_e2e.json

Each engine start takes ~170-185 s on a fresh H200 (measured 2026-11-30: vLLM's profile run with Triton
autotuning ~95 s, torch.compile ~25 s, kernel JIT warm-up 33 s, now off by default), so three engines need about
ten minutes of device time. `spec --self-check` judges one engine against its own prefill logits instead.

Model: the fixture at shape `qwen35` (GDN 16 key heads, 32 value heads, K = V = 128), as Qwen3.5 or (with
`--fixture-architecture qwen3_next`) as Qwen3-Next, whose GDN projections vLLM reads interleaved by key head and whose
config has no `mamba_ssm_dtype` (`--ssm-cache-dtype` sets the GDN state's dtype either way). For each batch size the
first B fixture prompts are submitted at once (`max_num_seqs` = the largest B) for `--max-tokens` greedy tokens;
tokens/s is B * max_tokens over the `generate` call's wall time, after a warm-up pass over the same batch sizes.
The reference engine times the same batches without speculation, then re-scores every divergence (tie-aware
verdict: a divergence passes only where the reference's top two logits are within one bf16 step). As a control, it
judges itself the same way: each batch's prompts generated again in the next smaller batch size's batches, the same
requests in other batch shapes (`no_spec_in_smaller_batches`: the fixture's floor for the criterion).

Draft trees (`draft_tree_widths`, CUDA with TRITON_ATTN), with the test drafter `continuation_drafter` (method
custom_class) as in the CPU e2e tests; `bench/e2e/run_gpu_tree_e2e.sh` runs them:

    python3 bench/e2e/gpu_vllm_e2e.py continuations --out-dir $OUT        # no speculation: the drafter's truth,
                                                                        # the reference outputs, no-spec tokens/s
    python3 bench/e2e/gpu_vllm_e2e.py tree --tree-widths 2 2 1 --out-dir $OUT   # one engine per tree shape
    python3 bench/e2e/gpu_vllm_e2e.py tree-report --out-dir $OUT          # no engine: the table and the verdict

Preemption (`PREEMPTION_SHAPES` in the script): `preemption-continuations` cuts, per tree shape, prompts that cross
its attention block while decoding (the block sizes earlier tree runs reported) and generates their references
without speculation; `tree --preemption` runs each shape on them in a KV cache of 9 blocks, as the CPU e2e test.

The tree engine judges itself (no reference engine after it): each divergence from the reference outputs is
re-scored with its own prompt logits (vLLM's prefill path, which never speculates: what the reference engine's
re-scoring reads), tie-aware as above, fp64 beyond a tie; `--self-check` adds the teacher-forced check. Tree
engines may run at once on the one GPU (`--kv-cache-memory-bytes` skips vLLM's memory profiling, which other
processes' allocations would disturb); their tokens/s are then not throughput measurements.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

from bench.e2e import gpu_site
from vllm_treewy.fixture import (ARCHITECTURES, PREEMPTION_MAX_TOKENS, PREEMPTION_NUM_BLOCKS, PREEMPTION_PROMPTS,
                                 prompts_before_a_block_boundary)
from vllm_treewy.fixture.exact import ExactModel

FIXTURE_DIR = "/tmp/fixture-qwen35"
DEFAULT_ARCHITECTURE = "qwen3_5"


def fixture_dir(architecture: str = DEFAULT_ARCHITECTURE, blurred_mtp: bool = False) -> str:
    """Where the scripts build the fixture of `architecture` at shape qwen35 (`blurred_mtp`: its blurred-MTP
    variant), one folder per architecture: Qwen3.5's keeps the name warm machines already hold."""
    if architecture not in ARCHITECTURES:
        raise ValueError(f"fixture architecture {architecture!r}: use one of {', '.join(ARCHITECTURES)}")
    path = FIXTURE_DIR if architecture == DEFAULT_ARCHITECTURE else f"{FIXTURE_DIR}-{architecture}"
    return path + ("-blurred-mtp" if blurred_mtp else "")


def engine_kwargs(args, num_tokens_per_request: int | tuple[int, ...], cuda: bool | None = None) -> dict:
    """What vLLM needs on the gpu-vllm site (gpu-vllm README), and CUDA graphs only at the measured sizes: each batch
    size times each of `num_tokens_per_request` (several where the verified shape changes with the batch:
    `draft_tree_max_batch_size`). Without CUDA (a dry run of the script's flow on vLLM's CPU backend): vLLM's CPU
    defaults, eager; the GDN state's dtype as on CUDA. `cuda`: the kwargs for CUDA or not (default: whether torch
    sees a GPU; True for a dry run that prints what a GPU engine gets)."""
    import torch

    if not (torch.cuda.is_available() if cuda is None else cuda):
        return dict(max_num_seqs=max(args.batch_sizes), mamba_ssm_cache_dtype=args.ssm_cache_dtype)
    kwargs = dict(
        **gpu_site.ENGINE,
        **gpu_site.attention_site(getattr(args, "attention_backend", gpu_site.ATTENTION_BACKEND)),
        mamba_ssm_cache_dtype=args.ssm_cache_dtype,
        dtype=args.dtype,
        max_num_seqs=max(args.batch_sizes),
        gpu_memory_utilization=args.gpu_memory_utilization,
        enforce_eager=args.eager,
        # The kernels a run uses compile at first use (the warm-up pass); vLLM's JIT warm-up compiles ~150
        # kernel variants up front, most of which this model never runs.
        kernel_config={"enable_jit_warmup": args.jit_warmup},
    )
    if args.max_num_batched_tokens is not None:
        kwargs["max_num_batched_tokens"] = args.max_num_batched_tokens
    if getattr(args, "kv_cache_memory_bytes", None) is not None:
        kwargs["kv_cache_memory_bytes"] = args.kv_cache_memory_bytes
    if args.no_async_scheduling:
        kwargs["async_scheduling"] = False
    if not args.eager:
        per_request = (num_tokens_per_request,) if isinstance(num_tokens_per_request, int) else num_tokens_per_request
        sizes = sorted({b * t for b in args.batch_sizes for t in per_request})
        kwargs["compilation_config"] = {"cudagraph_capture_sizes": sizes}
        if args.cudagraph_mode is not None:
            kwargs["compilation_config"]["cudagraph_mode"] = args.cudagraph_mode
    return kwargs


def add_common_args(parser, runs: bool = True):
    if runs:
        parser.add_argument("--runs", required=True, help="folder for the per-engine results")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 64, 256])
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--staggered", action="store_true",
                        help="request i of a batch of B generates max_tokens - i * max_tokens // (2 B) tokens (down to "
                             "about half): the batch shrinks while it runs (e.g. through draft_tree_max_batch_size)")
    parser.add_argument("--fixture-architecture", default=DEFAULT_ARCHITECTURE, choices=sorted(ARCHITECTURES),
                        help="the fixture's model class: qwen3_5 (Qwen3.5) or qwen3_next (Qwen3-Next), same shape")
    # vLLM's mamba_ssm_cache_dtype. Qwen3.5 checkpoints keep the SSM state in fp32 (mamba_ssm_dtype, what "auto"
    # reads); Qwen3-Next configs have none, so "auto" is the activation dtype there (bf16 as users run it, fp16 under
    # --dtype float16): a bf16 state under fp16 activations is "bfloat16".
    parser.add_argument("--ssm-cache-dtype", default="float32", choices=["float32", "bfloat16", "auto"])
    # The activations: bf16 as users run the checkpoints; fp16 rounds 8x finer (vLLM's GDN prefill refuses fp32),
    # so the batch shape, which moves bf16 runs by 2-4 bf16 steps at B >= 64 without speculation, stays within the
    # verdict's one bf16 step there, and a divergence beyond it is a wrong state.
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    parser.add_argument("--eager", action="store_true", help="enforce_eager (a second opinion; compiled ops stay)")
    # A smaller token budget shortens vLLM's start-up profile run (Triton autotuning at that many tokens).
    parser.add_argument("--max-num-batched-tokens", type=int, default=None, help="default: vLLM's")
    parser.add_argument("--jit-warmup", action="store_true", help="vLLM's kernel JIT warm-up at engine start")
    parser.add_argument("--cudagraph-mode", default=None, help="default: vLLM's (FULL_AND_PIECEWISE)")
    parser.add_argument("--no-async-scheduling", action="store_true", help="a second opinion: vLLM's sync scheduler")
    parser.add_argument("--timing-repeats", type=int, default=3, help="timed passes per batch size (median)")
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="timed passes sample at this temperature, one seed per prompt (0: greedy); a sampled "
                             "run's outputs are reported, never judged")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--profile-batch", type=int, nargs="+", default=None,
                        help="after the timed batches, profile one generate of each many prompts: GPU kernels, then "
                             "the host's Python under cProfile (bench/e2e/e2e_profile.py)")
    parser.add_argument("--kv-cache-memory-bytes", type=int, default=None,
                        help="fixed KV cache size (no memory profiling): for engines that share the GPU at once")
    parser.add_argument("--attention-backend", default=gpu_site.ATTENTION_BACKEND,
                        help="the target's and the drafter's attention backend (e.g. TRITON_ATTN beside FLASH_ATTN "
                             "for the same engine in one call); default: $ATTENTION_BACKEND, else vLLM's pick")


def prompts_and_model(architecture: str = DEFAULT_ARCHITECTURE) -> tuple[str, list]:
    """The fixture of `architecture` at shape qwen35 (built once, `fixture_dir`) and its 256 prompts."""
    from transformers import AutoTokenizer

    from vllm_treewy.fixture import build_fixture, fixture_prompts

    model = built_once(fixture_dir(architecture),
                       lambda out: build_fixture(out, shape="qwen35", architecture=architecture))
    return model, fixture_prompts(AutoTokenizer.from_pretrained(model), 256)


def built_once(path: str, build) -> str:
    """`path`, which `build(dir)` makes once: into a folder of this process, then renamed into place, so engines
    started at once (`--concurrent`) never read a model another process is still writing."""
    if (Path(path) / "fixture.json").exists():
        return path
    staging = f"{path}.{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    build(staging)
    try:
        os.rename(staging, path)
    except OSError:  # another process renamed its copy first
        shutil.rmtree(staging, ignore_errors=True)
    return path


def generate(llm, prompts, lengths, args) -> list[list[int]]:
    """Greedy continuations, or with `--temperature` > 0 sampled ones (request i seeded i; top-p `--top-p`)."""
    from vllm_treewy.vllm_plugin.testing.equivalence import generate_greedy, generate_sampled

    if args.temperature == 0:
        return generate_greedy(llm, prompts, lengths)
    return generate_sampled(llm, prompts, lengths, args.temperature, args.top_p)


def timed_batches(llm, prompts, args) -> tuple[dict, dict, dict]:
    """Outputs (of the first timed pass), tokens/s per batch size and, for a speculative engine, the mean acceptance
    length per batch size over its timed passes (1 + accepted drafts per verify, vLLM's "Mean acceptance length"; the
    two strategies' texts part at ties, so a small batch's tokens/s compare like for like only where these agree).
    Tokens/s: the median of `--timing-repeats` passes, after one warm-up pass over the same batch sizes. A pass at
    B = 1 lasts a fraction of a second, so one pass alone moved by 1.4x between two calls (2026-12-01); the passes of
    all batch sizes alternate, so drift spreads over them."""
    from vllm_treewy.vllm_plugin.testing.equivalence import read_acceptance

    for b in args.batch_sizes:
        generate(llm, prompts[:b], [8] * b, args)
    outputs, samples = {}, {b: [] for b in args.batch_sizes}
    verifies, accepted = dict.fromkeys(args.batch_sizes, 0.0), dict.fromkeys(args.batch_sizes, 0.0)
    for _ in range(args.timing_repeats):
        for b in args.batch_sizes:
            before = read_acceptance(llm)
            start = time.perf_counter()
            lengths = request_lengths(args, b)
            out = generate(llm, prompts[:b], lengths, args)
            samples[b].append(sum(lengths) / (time.perf_counter() - start))
            outputs.setdefault(b, out)
            if before is not None:
                after = read_acceptance(llm)
                verifies[b] += after.num_drafts - before.num_drafts
                accepted[b] += after.num_accepted_tokens - before.num_accepted_tokens
    tokens_per_s = {b: statistics.median(v) for b, v in samples.items()}
    acceptance_length = {b: 1 + accepted[b] / verifies[b] for b in args.batch_sizes if verifies[b]}
    for b, v in samples.items():
        length = f", mean acceptance length {acceptance_length[b]:.3f}" if b in acceptance_length else ""
        print(f"  batch {b}: {tokens_per_s[b]:,.0f} tokens/s (median of {len(v)}: "
              f"{', '.join(f'{x:,.0f}' for x in v)}){length}", flush=True)
    return outputs, tokens_per_s, acceptance_length


def maybe_profile(llm, prompts, args, name: str) -> list[dict] | None:
    if not args.profile_batch:
        return None
    from bench.e2e.e2e_profile import host_profile_generate, print_host_summary, print_summary, profile_generate

    profiles = []
    for batch in args.profile_batch:
        summary = profile_generate(llm, prompts[:batch], args.max_tokens)
        print_summary(f"{name} B={batch}", summary)
        dump = (str(Path(args.out_dir) / f"{name}-B{batch}.pstats") if getattr(args, "out_dir", None) else None)
        host = host_profile_generate(llm, prompts[:batch], args.max_tokens, dump)
        print_host_summary(f"{name} B={batch}", host)
        profiles.append({"batch": batch, **summary, "host": host})
    return profiles


def verdict_record(verdict) -> dict:
    """An `EquivalenceVerdict` as this script's JSON records it."""
    return {"passed": verdict.passed, "summary": verdict.summary(),
            "identical": verdict.num_prompts - len(verdict.divergences),
            "ties": len(verdict.ties), "beyond_one_step": len(verdict.failures),
            # how far the exact model separates the reference's token at the worst failure, in bf16 steps: bf16
            # noise (batch shape, kernels) flips choices within a few steps; a wrong state flips them anywhere
            "worst_failure_exact_steps": max((d.exact_gap / d.bf16_step for d in verdict.failures
                                              if d.exact_gap is not None), default=None),
            # every divergence, so the gaps of failures can be set beside the control's
            "divergences": [dict(prompt=d.prompt_index, position=d.position, reference=d.reference_token,
                                 got=d.candidate_token, logit_gap=d.logit_gap, bf16_step=d.bf16_step,
                                 exact_gap=d.exact_gap, failure=d.is_failure) for d in verdict.divergences]}


def request_lengths(args, batch: int) -> list[int]:
    """max_tokens of each request of a batch of `batch` prompts: all `--max-tokens`, or with `--staggered` from it
    down to about half, so requests finish one after another and the batch shrinks while it runs."""
    if not getattr(args, "staggered", False):
        return [args.max_tokens] * batch
    return [args.max_tokens - i * args.max_tokens // (2 * batch) for i in range(batch)]


def batch_shape_control(reference, prompts, args) -> dict:
    """The no-speculation engine's outputs for each batch size's prompts generated again in smaller batches (those of
    the next smaller batch size): the same requests in other batch shapes, which vLLM's kernels are not invariant to.
    Judged against the reference outputs like a speculative run, their divergences beyond one bf16 step are the
    fixture's own floor for the tie-aware criterion."""
    from vllm_treewy.vllm_plugin.testing.equivalence import generate_greedy

    sizes = sorted(args.batch_sizes)
    control = {}
    for chunk, b in zip(sizes, sizes[1:]):
        lengths = request_lengths(args, b)
        control[b] = [out for start in range(0, b, chunk)
                      for out in generate_greedy(reference, prompts[start : start + chunk],
                                                 lengths[start : start + chunk])]
    return control


def teacher_forced_verdicts(llm, prompts, outputs, exact_logits) -> dict:
    from vllm_treewy.vllm_plugin.testing.equivalence import compare_teacher_forced

    verdicts = {}
    for b, out in outputs.items():
        verdict = compare_teacher_forced(llm, prompts[:b], out, exact_logits)
        verdicts[str(b)] = verdict_record(verdict)
        print(f"  batch {b} teacher-forced: {verdict.summary()}", flush=True)
    return verdicts


def run_spec(args) -> int:
    import vllm_treewy.vllm_plugin as plugin
    from vllm_treewy.vllm_plugin.testing.equivalence import engine, kv_cache_report, read_acceptance

    plugin.register()  # in-process engine: this process is the only vLLM process
    model, prompts = prompts_and_model(args.fixture_architecture)
    spec = {"method": "mtp", "num_speculative_tokens": args.k, "mamba_state_commit": args.strategy,
            **gpu_site.SPECULATIVE}
    name = f"{args.strategy}-k{args.k}"
    start = time.perf_counter()
    extra = {"logprobs_mode": "raw_logits"} if args.self_check else {}
    with engine(model, speculative_config=spec, **engine_kwargs(args, 1 + args.k), **extra) as llm:
        started = time.perf_counter() - start
        before = read_acceptance(llm)
        outputs, tokens_per_s, acceptance_length = timed_batches(llm, prompts, args)
        after = read_acceptance(llm)
        kv = kv_cache_report(llm)
        profile = maybe_profile(llm, prompts, args, name)
        self_check = (teacher_forced_verdicts(llm, prompts, outputs, ExactModel(model).next_token_logits)
                      if args.self_check else None)
    accepted = after.num_accepted_tokens - before.num_accepted_tokens
    drafted = after.num_draft_tokens - before.num_draft_tokens
    result = {
        "name": name, "strategy": args.strategy, "k": args.k, "engine_start_s": started,
        "outputs": {str(b): o for b, o in outputs.items()},
        "tokens_per_s": {str(b): t for b, t in tokens_per_s.items()},
        "acceptance_rate": accepted / max(drafted, 1),
        "acceptance_length": {str(b): n for b, n in acceptance_length.items()}, "kv_cache": asdict(kv),
        "teacher_forced_verdicts": self_check, "profile": profile,
    }
    Path(args.runs).mkdir(parents=True, exist_ok=True)
    (Path(args.runs) / f"{name}.json").write_text(json.dumps(result))
    print(name, "done", kv, flush=True)
    return 0


def device_facts() -> dict:
    import torch
    import vllm

    if not torch.cuda.is_available():
        return {"device": "cpu (a dry run)", "torch": torch.__version__, "vllm": vllm.__version__,
                "python": platform.python_version()}
    smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.max.sm",
                          "--format=csv,noheader"], capture_output=True, text=True).stdout.strip()
    return {"device": torch.cuda.get_device_name(), "nvidia_smi": smi, "torch": torch.__version__,
            "vllm": vllm.__version__, "python": platform.python_version(),
            "compiled_mtp_kernel": hasattr(torch.ops._C, "fused_gdn_decode_post_conv_mtp")}


def beside_store_all(runs: dict) -> list[str]:
    """Reconstruct's divergences beside vLLM's own MTP's, per k and batch: on a fixture whose near-ties make even
    store_all fail the one-bf16-step rule at large batches, the comparison that separates a bug from bf16 noise."""
    lines = []
    for name, run in runs.items():
        other = runs.get(name.replace("reconstruct", "store_all"))
        if not name.startswith("reconstruct") or other is None:
            continue
        for b, v in run["verdicts"].items():
            w = other["verdicts"][b]
            ratio = run["tokens_per_s"][b] / other["tokens_per_s"][b]
            lengths = [r.get("acceptance_length", {}).get(str(b)) for r in (run, other)]
            per_verify = (f", acceptance length {lengths[0]:.3f} vs {lengths[1]:.3f} (tokens/s per verify "
                          f"{ratio * lengths[1] / lengths[0]:.2f}x)") if None not in lengths else ""
            worst = [x.get("worst_failure_exact_steps") for x in (v, w)]
            worst_text = "" if worst == [None, None] else (
                ", worst failure's exact gap " + " vs ".join("-" if x is None else f"{x:.1f}" for x in worst)
                + " bf16 steps")
            lines.append(f"{name} beside store_all at batch {b}: identical {v['identical']} vs {w['identical']}, "
                         f"ties {v['ties']} vs {w['ties']}, beyond one bf16 step {v['beyond_one_step']} vs "
                         f"{w['beyond_one_step']}{worst_text}; tokens/s {ratio:.2f}x{per_verify}")
    return lines


def judged(entry: dict, run: dict, reference, prompts, outputs: dict, tokens_per_s: dict, exact_logits,
           batch_sizes) -> dict:
    """A speculative run's report entry with its tokens/s beside no speculation's and its tie-aware verdict against
    the reference outputs at every batch size."""
    from vllm_treewy.vllm_plugin.testing.equivalence import compare_tie_aware

    entry["tokens_per_s"] = {int(b): t for b, t in run["tokens_per_s"].items()}
    entry["speedup_vs_no_spec"] = {b: t / tokens_per_s[b] for b, t in entry["tokens_per_s"].items()}
    entry["verdicts"] = {b: verdict_record(compare_tie_aware(reference, prompts[:b], outputs[b],
                                                             run["outputs"][str(b)], exact_logits))
                         for b in batch_sizes}
    return entry


def print_runs(report: dict) -> None:
    for name, entry in report["runs"].items():
        print(name, json.dumps({k: v for k, v in entry.items() if k != "verdicts"}), flush=True)
        for b, v in entry.get("verdicts", {}).items():
            print(f"  batch {b}: {v['summary']}", flush=True)
    for b, v in report["no_spec_in_smaller_batches"].items():
        print(f"  no speculation, batch {b} in smaller batches: {v['summary']}", flush=True)


def run_reference(args) -> int:
    from vllm_treewy.vllm_plugin.testing.equivalence import compare_tie_aware, engine, kv_cache_report

    model, prompts = prompts_and_model(args.fixture_architecture)
    runs = [json.loads(p.read_text()) for p in sorted(Path(args.runs).glob("*.json"))]
    report = {
        "command": args.command or " ".join([sys.executable, *sys.argv]),
        **device_facts(),
        "mode": "eager (enforce_eager), compiled ops" if args.eager else "default (torch.compile + CUDA graphs), "
                "compiled ops",
        "fixture_architecture": args.fixture_architecture, "model_dtype": args.dtype,
        "ssm_cache_dtype": args.ssm_cache_dtype, "max_tokens": args.max_tokens,
        "batch_sizes": args.batch_sizes,
        "gpu_memory_utilization": args.gpu_memory_utilization, "runs": {},
    }
    exact_logits = ExactModel(model).next_token_logits  # fp64, on the CPU: consulted beyond a bf16 tie only
    with engine(model, logprobs_mode="raw_logits", **engine_kwargs(args, 1)) as reference:
        outputs, tokens_per_s, _ = timed_batches(reference, prompts, args)
        report["runs"]["no-spec"] = {"tokens_per_s": tokens_per_s, "kv_cache": asdict(kv_cache_report(reference)),
                                     "profile": maybe_profile(reference, prompts, args, "no-spec")}
        report["no_spec_in_smaller_batches"] = {
            b: verdict_record(compare_tie_aware(reference, prompts[:b], outputs[b], out, exact_logits))
            for b, out in batch_shape_control(reference, prompts, args).items()}
        for run in runs:
            entry = {key: run.get(key) for key in ("strategy", "k", "engine_start_s", "acceptance_rate",
                                                   "acceptance_length", "kv_cache", "profile")}
            report["runs"][run["name"]] = judged(entry, run, reference, prompts, outputs, tokens_per_s, exact_logits,
                                                 args.batch_sizes)
    print_runs(report)
    report["beside_store_all"] = beside_store_all(report["runs"])
    for line in report["beside_store_all"]:
        print(line, flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    verdicts = [v for name, e in report["runs"].items() if name.startswith("reconstruct")
                for v in e["verdicts"].values()]
    ok = bool(verdicts) and all(v["passed"] for v in verdicts)  # no reconstruct run (it crashed) is a failure
    print("RECONSTRUCT PASSES AT EVERY BATCH" if ok else "RECONSTRUCT FAILS", flush=True)
    return 0 if ok else 1


# --- draft trees -------------------------------------------------------------------------------------------------

TREE_DRAFTER = "vllm_treewy.vllm_plugin.testing.continuation_drafter.ContinuationTreeDrafter"
LOOKAHEAD = 4  # tokens past max_tokens in the drafter's truth: a whole depth of it at every step (depth <= 4 here)
TRUE_BRANCH = 1  # the true path on a non-first child where the width allows (as the CPU e2e tests)


def tree_name(widths) -> str:
    return "tree-" + "x".join(map(str, widths))


def run_continuations(args) -> int:
    """No speculation: the reference outputs (the drafter's truth, LOOKAHEAD tokens longer) of all prompts in one
    batch, and tokens/s at every batch size. Writes `continuations.json` into `--out-dir`."""
    from vllm_treewy.vllm_plugin.testing.equivalence import engine, generate_greedy

    model, prompts = prompts_and_model(args.fixture_architecture)
    batch = prompts[: max(args.batch_sizes)]
    start = time.perf_counter()
    with engine(model, **engine_kwargs(args, 1)) as llm:
        started = time.perf_counter() - start
        reference = generate_greedy(llm, batch, [args.max_tokens + LOOKAHEAD] * len(batch))
        _, tokens_per_s, _ = timed_batches(llm, prompts, args)
    result = {"engine_start_s": started, "max_tokens": args.max_tokens, "lookahead": LOOKAHEAD,
              "sequences": [p + r for p, r in zip(batch, reference)],
              "reference_outputs": [r[: args.max_tokens] for r in reference],
              "tokens_per_s": {str(b): t for b, t in tokens_per_s.items()}, **device_facts()}
    Path(args.out_dir).mkdir(parents=True, exist_ok=True)
    (Path(args.out_dir) / "continuations.json").write_text(json.dumps(result))
    print("continuations done", flush=True)
    return 0


# Preemption: the fixture's preemption workload, as in the CPU e2e test (tests/e2e/test_tree_wiring.py).
# With an fp32 SSM state the fixture's attention blocks hold 5,072-6,992 tokens (vLLM grows them until a page holds
# a GDN page), past the fixture's 4,096 positions: the preemption engines (reference and trees alike) run a copy of
# the fixture that declares 16,384 (a random model: no length it was trained for).
LONG_CONTEXT_POSITIONS = 16384


def long_context_model(model: str) -> str:
    """The copy, made once: `preemption-continuations` makes it before the tree engines, which start at once."""
    import shutil

    long_dir = Path(f"{model}-long")
    if not (long_dir / "config.json").exists():
        shutil.copytree(model, long_dir)
        config = json.loads((long_dir / "config.json").read_text())
        config["max_position_embeddings"] = LONG_CONTEXT_POSITIONS
        (long_dir / "config.json").write_text(json.dumps(config, indent=2))
    return str(long_dir)


def attention_block_sizes(sources: list[str]) -> dict[str, int]:
    """Tree name -> the attention block size vLLM gave that tree's engine, from earlier runs' KV reports: run folders
    (`runs/tree-*.json`), tree reports (`gpu_tree_e2e.json`) or `NAME=TOKENS` as an engine's log stated it ("Setting
    attention block size to ..."); the first source that has the tree wins. The block size is only known once an
    engine has built its layers, and the preemption prompts (hence the reference outputs the drafter needs at
    start-up) depend on it; the preempted run checks it against its engine's."""
    sizes = {}
    for text in sources:
        if "=" in text:
            name, tokens = text.split("=")
            sizes.setdefault(name, int(tokens))
            continue
        source = Path(text)
        if source.is_file():
            runs = json.loads(source.read_text())["runs"].values()
        else:
            runs = [json.loads(path.read_text()) for path in sorted(source.glob("tree-*.json"))]
        for run in runs:
            sizes.setdefault(run["name"], run["kv_cache"]["attention_block_size"])
    return sizes


def run_preemption_continuations(args) -> int:
    """No speculation, on the long-context fixture: for each tree shape, prompts that cross that shape's attention
    block boundary while decoding, and their greedy continuations (LOOKAHEAD longer: the drafter's truth). Writes
    `preemption.json` into `--out-dir`."""
    from vllm_treewy.vllm_plugin.testing.equivalence import engine, generate_greedy

    model, prompts = prompts_and_model(args.fixture_architecture)
    tokens = [t for p in prompts for t in p]
    sizes = attention_block_sizes(args.block_sizes_from)
    names = [tree_name(map(int, shape.split(","))) for shape in args.tree_shapes]
    missing = [name for name in names if name not in sizes]
    if missing:
        raise SystemExit(f"no attention block size for {missing} in {args.block_sizes_from}: run those trees first")
    n = args.num_prompts
    sets = {name: prompts_before_a_block_boundary(tokens, sizes[name], n) for name in names}
    batch = [p for name in names for p in sets[name]]
    args.batch_sizes = [n]
    with engine(long_context_model(model), **engine_kwargs(args, 1), max_model_len=LONG_CONTEXT_POSITIONS) as llm:
        reference = generate_greedy(llm, batch, [PREEMPTION_MAX_TOKENS + LOOKAHEAD] * len(batch))
    result = {}
    for i, name in enumerate(names):
        ref = reference[i * n : (i + 1) * n]
        result[name] = {"attention_block_size": sizes[name], "prompts": sets[name],
                        "sequences": [p + r for p, r in zip(sets[name], ref)],
                        "reference_outputs": [r[:PREEMPTION_MAX_TOKENS] for r in ref]}
    (Path(args.out_dir) / "preemption.json").write_text(json.dumps(result))
    print("preemption continuations done:", {name: sizes[name] for name in names}, flush=True)
    return 0


def tree_spec(widths: list[int], drafter: str = "continuation") -> dict:
    """The continuation test drafter, or the model's own MTP head (`--drafter mtp`; widths of 1: vLLM's chain)."""
    if drafter == "mtp":
        return {"method": "mtp", "num_speculative_tokens": len(widths), "draft_tree_widths": widths,
                "mamba_state_commit": "reconstruct", **gpu_site.SPECULATIVE}
    return {"method": "custom_class", "model": TREE_DRAFTER, "num_speculative_tokens": len(widths),
            "draft_tree_widths": widths, "mamba_state_commit": "reconstruct"}


def tree_model(args) -> tuple[str, list]:
    """The fixture of `args.fixture_architecture` (default Qwen3.5), or its blurred-MTP variant (`--blurred-mtp`:
    same target, a head right about half the time)."""
    from vllm_treewy.fixture import blurred_mtp_variant

    architecture = getattr(args, "fixture_architecture", DEFAULT_ARCHITECTURE)
    base, prompts = prompts_and_model(architecture)
    if getattr(args, "blurred_mtp", False):
        return built_once(fixture_dir(architecture, blurred_mtp=True),
                          lambda out: blurred_mtp_variant(base, out)), prompts
    return base, prompts


def run_preempted_tree(args) -> int:
    """One draft-tree engine on its preemption prompts (`preemption.json`) in a KV cache of PREEMPTION_NUM_BLOCKS
    blocks: passes when the scheduler preempted and the outputs are tie-aware equal to the reference's. Fails at once
    if vLLM chose another attention block size than the prompts were cut for (they would not cross it)."""
    import vllm_treewy.vllm_plugin as plugin
    from vllm_treewy.tree import DraftTree
    from vllm_treewy.vllm_plugin.testing.continuation_drafter import DRAFTS_ENV, write_drafts_file
    from vllm_treewy.vllm_plugin.testing.equivalence import (compare_tie_aware, engine, generate_greedy, kv_cache_report,
                                                     read_acceptance, read_preemptions)

    plugin.register()
    out = Path(args.out_dir)
    widths = list(args.tree_widths)
    name = tree_name(widths)
    known = json.loads((out / "preemption.json").read_text())[name]
    os.environ[DRAFTS_ENV] = write_drafts_file(out / f"preempted-{name}-drafts.json", known["sequences"], TRUE_BRANCH)
    model = long_context_model(prompts_and_model(args.fixture_architecture)[0])
    prompts = known["prompts"]
    args.batch_sizes = [len(prompts)]
    kwargs = engine_kwargs(args, 1 + DraftTree.from_widths(widths).num_nodes)
    kwargs.update(num_gpu_blocks_override=PREEMPTION_NUM_BLOCKS, max_num_seqs=len(prompts),
                  max_model_len=LONG_CONTEXT_POSITIONS)
    with engine(model, speculative_config=tree_spec(widths), logprobs_mode="raw_logits", **kwargs) as llm:
        kv = kv_cache_report(llm)
        if kv.attention_block_size != known["attention_block_size"]:
            raise SystemExit(f"{name}: attention blocks of {kv.attention_block_size} tokens, the prompts were cut for "
                             f"{known['attention_block_size']}")
        outputs = generate_greedy(llm, prompts, [PREEMPTION_MAX_TOKENS] * len(prompts))
        acceptance, preemptions = read_acceptance(llm), read_preemptions(llm)
        verdict = compare_tie_aware(llm, prompts, known["reference_outputs"], outputs,
                                    ExactModel(model).next_token_logits)
    record = verdict_record(verdict)
    record["passed"] = verdict.passed and preemptions > 0
    record["summary"] = f"{preemptions} preemptions; {verdict.summary()}"
    result = {"name": f"preempted-{name}", "widths": widths, "concurrent": args.concurrent,
              "num_preemptions": preemptions, "kv_cache": asdict(kv),
              "accepted_per_verify": acceptance.num_accepted_tokens / max(acceptance.num_drafts, 1),
              "verdicts": {str(len(prompts)): record}}
    (out / "runs").mkdir(parents=True, exist_ok=True)
    (out / "runs" / f"preempted-{name}.json").write_text(json.dumps(result))
    print(result["name"], "done:", record["summary"], flush=True)
    return 0 if record["passed"] else 1


def run_tree(args) -> int:
    """One draft-tree engine (reconstruct, the continuation drafter): outputs, tokens/s, acceptance, and its own
    tie-aware verdict against the reference outputs at every batch size."""
    import vllm_treewy.vllm_plugin as plugin
    from vllm_treewy.tree import DraftTree
    from vllm_treewy.vllm_plugin.testing.continuation_drafter import DRAFTS_ENV, write_drafts_file
    from vllm_treewy.vllm_plugin.testing.equivalence import (compare_tie_aware, engine, generate_greedy,
                                                                  kv_cache_report, read_acceptance)

    plugin.register()
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    # Without the no-speculation run (`continuations`): throughput and acceptance only, no verdicts.
    known = json.loads((out / "continuations.json").read_text()) if (out / "continuations.json").exists() else None
    widths = list(args.tree_widths)
    name = ("mtp-" if args.drafter == "mtp" else "") + tree_name(widths) + ("-blurred" if args.blurred_mtp else "")
    os.environ[DRAFTS_ENV] = write_drafts_file(out / f"{name}-drafts.json", known["sequences"] if known else [],
                                               TRUE_BRANCH)
    model, prompts = tree_model(args)
    tree = DraftTree.from_widths(widths)
    exact_logits = ExactModel(model).next_token_logits
    phases = None
    if args.phase_timing:
        from bench.host import phase_timing

        phases = phase_timing.install()
    start = time.perf_counter()
    with engine(model, speculative_config=tree_spec(widths, args.drafter), logprobs_mode="raw_logits",
                **engine_kwargs(args, 1 + tree.num_nodes)) as llm:
        started = time.perf_counter() - start
        before = read_acceptance(llm)
        phase_times = {}
        for b in args.batch_sizes if phases else ():  # per batch size, after a warm-up pass
            generate_greedy(llm, prompts[:b], [8] * b)
            phases.clear()
            generate_greedy(llm, prompts[:b], request_lengths(args, b))
            phase_times[str(b)] = phase_timing.report(phases)
            print(f"  phases B={b}:", json.dumps(phase_times[str(b)]), flush=True)
        outputs, tokens_per_s, acceptance_length = timed_batches(llm, prompts, args)
        after = read_acceptance(llm)
        kv = kv_cache_report(llm)
        verdicts = {}
        for b, got in outputs.items() if known else ():
            verdict = compare_tie_aware(llm, prompts[:b], known["reference_outputs"][:b], got, exact_logits)
            verdicts[str(b)] = verdict_record(verdict)
            print(f"  batch {b} tie-aware: {verdict.summary()}", flush=True)
        self_check = (teacher_forced_verdicts(llm, prompts, outputs, exact_logits) if args.self_check else None)
        profile = maybe_profile(llm, prompts, args, name)
    accepted = after.num_accepted_tokens - before.num_accepted_tokens
    drafts = after.num_drafts - before.num_drafts
    result = {
        "name": name, "widths": widths, "num_nodes": tree.num_nodes, "engine_start_s": started,
        "drafter": args.drafter, "blurred_mtp": args.blurred_mtp, "dtype": args.dtype,
        "mode": "eager (enforce_eager)" if args.eager else "default (torch.compile + CUDA graphs)",
        "concurrent": args.concurrent, "outputs": {str(b): o for b, o in outputs.items()},
        "tokens_per_s": {str(b): t for b, t in tokens_per_s.items()},
        "accepted_per_verify": accepted / max(drafts, 1),
        "acceptance_length": {str(b): n for b, n in acceptance_length.items()}, "accepted_per_position": [
            a - b for a, b in zip(after.accepted_per_position, before.accepted_per_position)],
        "kv_cache": asdict(kv), "verdicts": verdicts, "teacher_forced_verdicts": self_check, "profile": profile,
        "phase_times": phase_times,
    }
    (out / "runs").mkdir(parents=True, exist_ok=True)
    (out / "runs" / f"{name}.json").write_text(json.dumps(result))
    print(name, "done", json.dumps({k: result[k] for k in ("tokens_per_s", "accepted_per_verify", "verdicts")}),
          flush=True)
    return 0 if all(v["passed"] for v in verdicts.values()) else 1


def run_tree_report(args) -> int:
    """No engine: the tree runs under `--out-dir`/runs (and the preempted ones) against the no-speculation timings;
    PASS when every run passed at every batch size."""
    out = Path(args.out_dir)
    runs = [json.loads(p.read_text()) for p in sorted((out / "runs").glob("*tree-*.json"))]
    if (out / "continuations.json").exists():
        known = json.loads((out / "continuations.json").read_text())
    else:  # preemption runs only: their block sizes came from earlier tree runs
        known = {**device_facts(), "max_tokens": None, "tokens_per_s": {}, "engine_start_s": None}
    no_spec = {int(b): t for b, t in known["tokens_per_s"].items()}
    report = {"command": args.command, **{k: known[k] for k in ("device", "torch", "vllm", "max_tokens")},
              "no_spec_tokens_per_s": no_spec, "no_spec_engine_start_s": known["engine_start_s"], "runs": {}}
    for run in runs:
        entry = {k: v for k, v in run.items() if k != "outputs"}
        entry["speedup_vs_no_spec"] = {b: t / no_spec[int(b)] for b, t in run.get("tokens_per_s", {}).items()
                                       if int(b) in no_spec}
        report["runs"][run["name"]] = entry
        print(run["name"], json.dumps({k: entry.get(k) for k in ("accepted_per_verify", "speedup_vs_no_spec",
                                                                 "concurrent", "engine_start_s", "num_preemptions")}),
              flush=True)
        for b, v in run["verdicts"].items():
            print(f"  batch {b}: {v['summary']}", flush=True)
    missing = sorted(set(args.expected_runs) - set(report["runs"]))
    report["missing_runs"] = missing
    (out / "gpu_tree_e2e.json").write_text(json.dumps(report, indent=2) + "\n")
    ok = bool(report["runs"]) and not missing and all(
        v["passed"] for e in report["runs"].values() for v in e["verdicts"].values())
    print("TREES PASS AT EVERY BATCH" if ok else f"TREES FAIL (runs missing: {missing or 'none'})", flush=True)
    return 0 if ok else 1


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="role", required=True)
    spec = sub.add_parser("spec", help="one speculative engine: outputs, tokens/s, KV report")
    add_common_args(spec)
    spec.add_argument("--strategy", required=True, choices=["store_all", "reconstruct"])
    spec.add_argument("--k", type=int, default=3)
    spec.add_argument("--self-check", action="store_true",
                      help="also judge the outputs against this engine's own prefill logits "
                           "(equivalence.compare_teacher_forced), without a reference engine")
    ref = sub.add_parser("reference", help="the no-speculation engine: tokens/s, then judges every run")
    add_common_args(ref)
    ref.add_argument("--out", required=True)
    ref.add_argument("--command", default=None, help="the whole shell command, for the report")
    cont = sub.add_parser("continuations", help="no speculation: the tree drafter's truth and the reference outputs")
    add_common_args(cont, runs=False)
    cont.add_argument("--out-dir", required=True)
    tree = sub.add_parser("tree", help="one draft-tree engine (continuation drafter or MTP), judged against the "
                                       "reference")
    add_common_args(tree, runs=False)
    tree.add_argument("--out-dir", required=True)
    tree.add_argument("--tree-widths", type=int, nargs="+", required=True)
    tree.add_argument("--self-check", action="store_true", help="also the teacher-forced check against itself")
    tree.add_argument("--drafter", default="continuation", choices=["continuation", "mtp"],
                      help="the continuation test drafter, or the model's own MTP head (widths of 1: vLLM's chain)")
    tree.add_argument("--blurred-mtp", action="store_true", help="the fixture's blurred-MTP variant (same target)")
    tree.add_argument("--phase-timing", action="store_true",
                      help="host time per engine step by phase over the timed passes (bench/host/phase_timing.py)")
    tree.add_argument("--concurrent", action="store_true", help="recorded: other engines share the GPU meanwhile")
    tree.add_argument("--preemption", action="store_true",
                      help="the preemption prompts (preemption-continuations) in a KV cache that preempts")
    preempt = sub.add_parser("preemption-continuations",
                             help="no speculation: prompts crossing each tree's attention block, their continuations")
    add_common_args(preempt, runs=False)
    preempt.add_argument("--out-dir", required=True)
    preempt.add_argument("--tree-shapes", nargs="+", required=True, help="e.g. 2,2,1 4,2")
    preempt.add_argument("--num-prompts", type=int, default=PREEMPTION_PROMPTS,
                         help="per tree (3 still preempt: more than the KV cache's two requests)")
    preempt.add_argument("--block-sizes-from", nargs="+", required=True,
                         help="earlier tree runs' folders (runs/), reports (gpu_tree_e2e.json) or NAME=TOKENS")
    report = sub.add_parser("tree-report", help="no engine: the tree runs' table and verdict")
    report.add_argument("--out-dir", required=True)
    report.add_argument("--command", default=None)
    report.add_argument("--expected-runs", nargs="*", default=[], help="run names that must be there to PASS")
    args = parser.parse_args(argv)
    roles = {"spec": run_spec, "reference": run_reference, "continuations": run_continuations,
             "tree": run_preempted_tree if getattr(args, "preemption", False) else run_tree,
             "preemption-continuations": run_preemption_continuations, "tree-report": run_tree_report}
    gpu_site.seed_model_info_cache()
    return roles[args.role](args)


if __name__ == "__main__":
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    raise SystemExit(main())
