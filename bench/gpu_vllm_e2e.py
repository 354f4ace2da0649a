"""Greedy equivalence and GDN state blocks of reconstruct vs store_all in real vLLM 0.32 on a CUDA GPU.

Runs on the H200 through `../shared/tools/gpu-vllm` (vLLM's Python on its Triton kernels, V1 runner, eager):

    source .gpu-vllm/device-setup.sh && PYTHONPATH=$PWD:$PYTHONPATH python3 bench/gpu_vllm_e2e.py --out $OUT

Builds the Qwen3.5-shaped fixture (GDN: 16 key heads, 32 value heads, K = V = 128), runs MTP k=3 with
store_all and with reconstruct, then the no-speculation reference, and writes a JSON report with the
tie-aware verdicts, vLLM's acceptance counters, and its KV-cache report (GDN blocks per request, max concurrency).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from dataclasses import asdict
from pathlib import Path

# What vLLM's Python needs on this site, where its compiled CUDA extensions are absent (gpu-vllm README).
GPU_ENGINE_KWARGS = dict(
    attention_backend="TRITON_ATTN",
    compilation_config={"custom_ops": ["none"]},
    gdn_prefill_backend="triton",
    enforce_eager=True,
)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", required=True)
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--k", type=int, nargs="+", default=[3])
    # Qwen3.5 checkpoints keep the SSM state in fp32 (mamba_ssm_dtype); with a bf16 state every engine rounds
    # the state at different points (per token vs per commit), which shows as divergences of a few bf16 steps.
    parser.add_argument("--ssm-cache-dtype", default="float32", choices=["float32", "bfloat16"])
    # A small value queues prompts, so prefills share batches with speculative decodes (the CUDA path's split).
    parser.add_argument("--max-num-seqs", type=int, default=None, help="default: vLLM's")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    import torch
    from transformers import AutoTokenizer

    import vllm_treewy.vllm_plugin as plugin
    from vllm_treewy.fixture import build_fixture, fixture_prompts
    from vllm_treewy.vllm_plugin.equivalence import compare_tie_aware, engine, generate_greedy, run_greedy

    plugin.register()  # in-process engine: this process is the only vLLM process
    model = str(build_fixture("/tmp/fixture-qwen35", shape="qwen35"))
    prompts = fixture_prompts(AutoTokenizer.from_pretrained(model), args.num_prompts)
    max_tokens = [20 + (i * 7) % 17 for i in range(len(prompts))]

    engine_kwargs = {**GPU_ENGINE_KWARGS, "mamba_ssm_cache_dtype": args.ssm_cache_dtype}
    if args.max_num_seqs is not None:
        engine_kwargs["max_num_seqs"] = args.max_num_seqs
    runs, seconds = {}, {}
    for k in args.k:
        for strategy in ("store_all", "reconstruct"):
            spec = {"method": "mtp", "num_speculative_tokens": k, "mamba_state_commit": strategy,
                    "attention_backend": "TRITON_ATTN"}
            start = time.perf_counter()
            runs[f"{strategy}-k{k}"] = run_greedy(model, prompts, max_tokens, speculative_config=spec,
                                                  **engine_kwargs)
            seconds[f"{strategy}-k{k}"] = time.perf_counter() - start
            print(f"{strategy} k={k}: done in {seconds[f'{strategy}-k{k}']:.0f} s", flush=True)

    report = {
        "command": " ".join([sys.executable, *sys.argv]),
        "device": torch.cuda.get_device_name(), "torch": torch.__version__, "python": platform.python_version(),
        "note": "vLLM 0.32 Python on its Triton kernels (no compiled CUDA extensions: Triton attention, "
                "no fused C++ GDN MTP decode), V1 runner, eager mode",
        "runs": {},
    }
    report["ssm_cache_dtype"] = args.ssm_cache_dtype
    with engine(model, logprobs_mode="raw_logits", **engine_kwargs) as reference:
        reference_outputs = generate_greedy(reference, prompts, max_tokens)
        for name, run in runs.items():
            verdict = compare_tie_aware(reference, prompts, reference_outputs, run.outputs)
            report["runs"][name] = {
                "verdict": verdict.summary(), "passed": verdict.passed,
                "divergence_gaps_in_bf16_steps": [round(d.logit_gap / d.bf16_step, 2) for d in verdict.divergences],
                "acceptance": asdict(run.acceptance), "acceptance_rate": run.acceptance.acceptance_rate,
                "kv_cache": asdict(run.kv_cache), "seconds_with_engine_start": seconds[name],
            }
            print(name, verdict.summary(), run.acceptance.accepted_per_position, run.kv_cache, flush=True)
    (out / "gpu_vllm_e2e.json").write_text(json.dumps(report, indent=2) + "\n")
    # vLLM's own store_all is the yardstick, reported but not required: reconstruct must pass.
    ok = True
    for k in args.k:
        ok &= report["runs"][f"reconstruct-k{k}"]["passed"]
        ok &= set(report["runs"][f"reconstruct-k{k}"]["kv_cache"]["gdn_blocks_per_request"]) == {1}
        ok &= set(report["runs"][f"store_all-k{k}"]["kv_cache"]["gdn_blocks_per_request"]) == {1 + k}
    print("ALL CHECKS PASSED" if ok else "CHECKS FAILED", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    raise SystemExit(main())
