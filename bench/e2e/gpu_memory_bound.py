"""Reconstruct vs store_all where memory binds: the Qwen3.5-27B shape with dummy weights on one H200.

One engine per process (a second `LLM` in one process fails on the GPU). The model is the 27B text shape written
locally (`bench.sweep.models.QWEN35_27B`: 64 layers, 48 GDN value heads of 128 x 128, fp32 SSM state, an MTP
head), `--load-format dummy`, no tokenizer (token-id prompts); both strategies accept drafts at vLLM's synthetic
acceptance length, so they do the same work per accepted token and differ only in GDN state memory and kernels.
Correctness is measured on the fixture (`bench/e2e/gpu_vllm_e2e.py`).

    source .gpu-vllm/device-setup.sh && export PYTHONPATH=$PWD:$PYTHONPATH
    for s in store_all reconstruct; do python3 bench/e2e/gpu_memory_bound.py --strategy $s --out $OUT/membound; done

No allocator settings (PYTORCH_CUDA_ALLOC_CONF unset): reconstruct must start wherever store_all starts. On CUDA the
engine's start-up records allocation stacks; a start-up OOM writes which live blocks pin the memory that vLLM
counted as free to OUT/STRATEGY_oom_segments.json (`bench/e2e/memory_pins.py`). OUT/STRATEGY.json is written once the
engine has started (start-up seconds, vLLM's KV-cache report) and again with the run's figures.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from dataclasses import asdict
from pathlib import Path


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--strategy", required=True, choices=["store_all", "reconstruct"])
    parser.add_argument("--out", required=True)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument("--requests", type=int, default=512)
    parser.add_argument("--max-num-seqs", type=int, default=None,
                        help="default: --requests. Under FULL decode graphs (reconstruct) vLLM refuses more than it "
                             "has Mamba blocks for")
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--acceptance-length", type=float, default=2.8)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--shape", default="qwen35-27b", help="a shape of bench.sweep.models.SHAPES")
    parser.add_argument("--eager", action="store_true", help="enforce_eager (the CPU smoke test; not on the GPU)")
    args = parser.parse_args(argv)
    max_num_seqs = args.max_num_seqs or args.requests

    import vllm_treewy.vllm_plugin as plugin
    from bench.e2e import gpu_site
    from bench.sweep.models import prepare_qwen35_shape
    from vllm_treewy.vllm_plugin.testing.equivalence import engine, kv_cache_report, read_acceptance

    plugin.register()
    gpu_site.seed_model_info_cache()
    from vllm.platforms import current_platform

    # what the gpu-vllm site runs (bench/e2e/gpu_site.py); vLLM's CPU backend picks its own
    cuda_only, spec_cuda_only = {}, {}
    if current_platform.is_cuda():
        # decode batches are padded to these (1 + k tokens per request); fewer sizes, a shorter start-up
        sizes = [(1 + args.k) * b for b in (1, 2, 4, 8, 16, 32, 64, 128, 256) if b <= max_num_seqs]
        cuda_only = dict(gpu_site.ENGINE, **gpu_site.attention_site(),
                         compilation_config={"cudagraph_capture_sizes": sizes})
        spec_cuda_only = gpu_site.SPECULATIVE
    model = prepare_qwen35_shape(Path(f"/tmp/{args.shape}"), args.shape).path
    spec = {"method": "mtp", "num_speculative_tokens": args.k, "mamba_state_commit": args.strategy,
            "rejection_sample_method": "synthetic", "synthetic_acceptance_length": args.acceptance_length,
            **spec_cuda_only}
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(3, 248320) for _ in range(args.prompt_len)]}
               for _ in range(args.requests)]
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True, detokenize=False)
    result = {"command": " ".join([sys.executable, *sys.argv]), "strategy": args.strategy, "args": vars(args),
              "pytorch_cuda_alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF")}
    out = Path(args.out)

    def save():  # after the start-up too: a run cut by its time limit keeps what its start-up showed
        out.mkdir(parents=True, exist_ok=True)
        (out / f"{args.strategy}.json").write_text(json.dumps(result, indent=2) + "\n")

    if current_platform.is_cuda():
        from bench.e2e import memory_pins

        memory_pins.attach(out / f"{args.strategy}_oom_segments.json")
    start = time.perf_counter()
    try:
        with engine(str(model), load_format="dummy", skip_tokenizer_init=True, speculative_config=spec,
                    gpu_memory_utilization=args.gpu_memory_utilization, enforce_eager=args.eager,
                    max_model_len=args.prompt_len + args.max_tokens + 2 * args.k, max_num_seqs=max_num_seqs,
                    max_num_batched_tokens=args.max_num_batched_tokens, mamba_ssm_cache_dtype="float32",
                    **cuda_only) as llm:
            result["engine_start_s"] = time.perf_counter() - start
            result["kv_cache"] = asdict(kv_cache_report(llm))
            save()
            if current_platform.is_cuda():
                import torch

                torch.cuda.memory._record_memory_history(enabled=None)  # start-up only: the run is timed
            llm.generate(prompts[:8], SamplingParams(max_tokens=8, ignore_eos=True, detokenize=False), use_tqdm=False)
            before = read_acceptance(llm)
            start = time.perf_counter()
            outputs = llm.generate(prompts, params, use_tqdm=False)
            seconds = time.perf_counter() - start
            after = read_acceptance(llm)
    except Exception as error:  # a failed start-up is a result too
        result["error"] = f"{type(error).__name__}: {error}"[:2000]
        print(result["error"], flush=True)
    else:
        generated = sum(len(o.outputs[0].token_ids) for o in outputs)
        result.update(seconds=seconds, output_tokens=generated, tokens_per_s=generated / seconds,
                      mean_acceptance_length=1 + (after.num_accepted_tokens - before.num_accepted_tokens)
                      / max(after.num_drafts - before.num_drafts, 1))
        print(f"{args.strategy}: {result['tokens_per_s']:,.0f} tokens/s, "
              f"max concurrency {result['kv_cache']['max_concurrency']:.1f}", flush=True)
    save()
    return 0 if "error" not in result else 1


if __name__ == "__main__":
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    raise SystemExit(main())
