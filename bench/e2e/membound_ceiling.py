"""How fast any engine could run the work of a memory-bound run (`bench/e2e/gpu_memory_bound.py`), and so how far
reconstruct / store_all can go there.

Both strategies accept drafts at the same synthetic length, so they do the same matrix work; they differ in the GDN
state bytes a verify step moves and in how many requests run at once. A lower bound on a run's time is the sum of
each kernel's own roofline: every matrix FLOP at the bf16 matrix rate measured on this H200 and every GDN state byte
at its measured copy bandwidth (kernels of one stream do not overlap). The work, per request:
- prefill: the prompt through the target's layers and the MTP layer, the target's logit row, the drafter's k passes;
- (max_tokens - 1) / acceptance_length verify steps, each 1 + k tokens through the target (1 + k logit rows) and
  the drafter's k passes (the first over the 1 + k tokens, then one token each; one logit row per pass);
- per verify step and GDN layer, the state: reconstruct reads and writes 1 (and writes and reads its pseudo-value
  buffer), store_all reads 1 and writes 1 + k.
Matrix sizes come from transformers' Qwen3.5 model of the shape, built on the meta device (no weights); attention
scores and values (4 x heads x head_dim x context FLOPs a token) are counted, the conv and the recurrences' own
FLOPs (under 0.1% of the matrix work) are not.

    python3 -m bench.e2e.membound_ceiling bench/results/gpu_vllm_e2e/membound_27b_gmu0.9

writes DIR/ceiling.json and prints the table. No vllm import, no GPU.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

# KINDS.md (/work/.library/device): an 8192^3 bf16 product through PyTorch on one such H200, random data.
MEASURED_BF16_MATRIX_FLOPS = 788e12
# `copy_bandwidth_Bps` of the kernels run of 2026-12-01 (bench/results/kernels/copy_bandwidth_run.json).
MEASURED_COPY_BANDWIDTH = 4.28e12
# Our fused step's time over its 2-state bound at fp32 T=4, B=256 (bench/results/kernels/README.md, 2026-12-01e; H=16,
# HV=32: the 27B shape's 48 value heads are not benched), for the estimate of reconstruct's GDN kernel time.
MEASURED_FUSED_STEP_OVER_BOUND = 1.94
STATE_BYTES_PER_ELEMENT = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class ShapeCosts:
    """Per token: matrix FLOPs of the target's layers, of the MTP layer (fc included), of one logit row; attention
    FLOPs per token and unit of context (target, MTP); GDN state bytes per request and layer; GDN layers."""

    target_layer_flops: float
    mtp_layer_flops: float
    logit_row_flops: float
    target_attention_flops_per_context: float
    mtp_attention_flops_per_context: float
    gdn_state_bytes: int
    gdn_layers: int


def _matrix_flops(module) -> float:
    # 2 FLOPs per weight of every linear map (2-D weights; norms and the depthwise conv are 1-D / 3-D)
    return 2.0 * sum(p.numel() for name, p in module.named_parameters() if p.dim() == 2)


def shape_costs(dims: dict) -> ShapeCosts:
    import torch
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    pattern = ["linear_attention"] * 3 + ["full_attention"]
    layer_types = pattern * (dims["num_hidden_layers"] // len(pattern))
    config = Qwen3_5TextConfig(**dims, layer_types=layer_types)
    with torch.device("meta"):
        model = Qwen3_5ForCausalLM(config)
    attention_layer = model.model.layers[layer_types.index("full_attention")]
    hidden = dims["hidden_size"]
    # QK^T and PV: 2 x head_dim FLOPs each, per query head and context token
    attention_per_context = 4.0 * dims["num_attention_heads"] * dims["head_dim"]
    return ShapeCosts(
        target_layer_flops=_matrix_flops(model.model.layers),
        # vLLM's Qwen3_5MTP: fc (2 hidden -> hidden), one full-attention decoder layer, the target's lm_head
        mtp_layer_flops=2.0 * 2 * hidden * hidden + _matrix_flops(attention_layer),
        logit_row_flops=_matrix_flops(model.lm_head),
        target_attention_flops_per_context=attention_per_context * layer_types.count("full_attention"),
        mtp_attention_flops_per_context=attention_per_context,
        gdn_state_bytes=dims["linear_num_value_heads"] * dims["linear_key_head_dim"] * dims["linear_value_head_dim"]
        * STATE_BYTES_PER_ELEMENT[dims.get("mamba_ssm_dtype", "float32")],
        gdn_layers=layer_types.count("linear_attention"),
    )


@dataclass(frozen=True)
class RunWork:
    matrix_flops: float
    prefill_flops: float
    gdn_state_bytes: float
    verify_steps_per_request: float


def run_work(costs: ShapeCosts, args: dict, acceptance_length: float, strategy: str,
             buffer_bytes_per_request: int) -> RunWork:
    requests, prompt, max_tokens, k = args["requests"], args["prompt_len"], args["max_tokens"], args["k"]
    per_token = costs.target_layer_flops + costs.mtp_layer_flops
    attention = costs.target_attention_flops_per_context + costs.mtp_attention_flops_per_context
    # causal prefill: a prompt token sees prompt / 2 tokens on average; then the target's logit row and the
    # drafter's k passes (the first over the prompt, counted in per_token) with a logit row each
    prefill = (prompt * (per_token + attention * prompt / 2) + (1 + k) * costs.logit_row_flops
               + (k - 1) * (costs.mtp_layer_flops + costs.mtp_attention_flops_per_context * prompt))
    steps = (max_tokens - 1) / acceptance_length
    context = prompt + max_tokens / 2  # mean context of a verify step
    verify_tokens = 1 + k
    per_step = (verify_tokens * (costs.target_layer_flops + costs.target_attention_flops_per_context * context)
                + verify_tokens * (costs.mtp_layer_flops + costs.mtp_attention_flops_per_context * context)
                + (k - 1) * (costs.mtp_layer_flops + costs.mtp_attention_flops_per_context * context)
                + (verify_tokens + k) * costs.logit_row_flops)
    states_moved = 2 if strategy == "reconstruct" else 2 + k
    # the buffer is written by a verify and read by the next step's commit
    step_bytes = states_moved * costs.gdn_state_bytes * costs.gdn_layers + 2 * buffer_bytes_per_request
    prefill_bytes = costs.gdn_state_bytes * costs.gdn_layers  # the prompt's final state, written once
    return RunWork(
        matrix_flops=requests * (prefill + steps * per_step),
        prefill_flops=requests * prefill,
        gdn_state_bytes=requests * (prefill_bytes + steps * step_bytes),
        verify_steps_per_request=steps,
    )


def ceiling(results_dir: Path, matrix_flops_per_s: float, bandwidth: float, target_ratio: float,
            fused_step_over_bound: float) -> dict:
    from bench.sweep.models import SHAPES

    runs = {s: json.loads((results_dir / f"{s}.json").read_text()) for s in ("reconstruct", "store_all")}
    shapes = {run["args"]["shape"] for run in runs.values()}
    if len(shapes) != 1:
        raise SystemExit(f"the two runs served different shapes: {sorted(shapes)}")
    costs = shape_costs(SHAPES[shapes.pop()])
    report = {"command": " ".join([sys.executable, *sys.argv]), "shape_costs": asdict(costs),
              "matrix_flops_per_s": matrix_flops_per_s, "bandwidth_Bps": bandwidth, "strategies": {}}
    for strategy, run in runs.items():
        work = run_work(costs, run["args"], run["mean_acceptance_length"], strategy,
                        run["kv_cache"]["gdn_buffer_bytes_per_request"])
        matrix_s, state_s = work.matrix_flops / matrix_flops_per_s, work.gdn_state_bytes / bandwidth
        report["strategies"][strategy] = {
            **asdict(work), "measured_s": run["seconds"], "lower_bound_s": matrix_s + state_s,
            "lower_bound_matrix_s": matrix_s, "lower_bound_prefill_s": work.prefill_flops / matrix_flops_per_s,
            "lower_bound_state_s": state_s,
            "achieved_matrix_flops_per_s": work.matrix_flops / run["seconds"],
            "measured_over_lower_bound": run["seconds"] / (matrix_s + state_s),
        }
    rc, sa = report["strategies"]["reconstruct"], report["strategies"]["store_all"]
    report["measured_ratio"] = sa["measured_s"] / rc["measured_s"]
    report["ratio_ceiling"] = sa["measured_s"] / rc["lower_bound_s"]
    report["ratio_of_bounds"] = sa["lower_bound_s"] / rc["lower_bound_s"]
    # the share of the matrix rate reconstruct must sustain over its whole run for the target ratio
    budget = sa["measured_s"] / target_ratio - rc["lower_bound_state_s"]
    report["target_ratio"] = target_ratio
    # What the kernels issue can still change: reconstruct's GDN step time, estimated from the state bound and the
    # fused step's benched distance to it; the rest of its run (matrices, attention, host) is left as measured.
    gdn_s = rc["lower_bound_state_s"] * fused_step_over_bound
    report["reconstruct_gdn_step_s_estimate"] = gdn_s
    report["ratio_with_gdn_step_at_bound"] = sa["measured_s"] / (rc["measured_s"] - gdn_s + rc["lower_bound_state_s"])
    report["ratio_with_gdn_step_free"] = sa["measured_s"] / (rc["measured_s"] - gdn_s)
    # Below this many running requests a verify step's matrices wait on their bf16 weights, not on the matrix rate:
    # only there does holding more requests raise throughput in proportion (the target's layers; 2 bytes a weight)
    k = runs["reconstruct"]["args"]["k"]
    weight_read_s = costs.target_layer_flops / bandwidth
    report["weight_bound_below_requests"] = weight_read_s / ((1 + k) * costs.target_layer_flops / matrix_flops_per_s)
    report["max_concurrency"] = {s: run["kv_cache"]["max_concurrency"] for s, run in runs.items()}
    report["matrix_rate_share_for_target"] = rc["lower_bound_matrix_s"] / budget if budget > 0 else float("inf")
    return report


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results_dir", type=Path, help="holds reconstruct.json and store_all.json")
    parser.add_argument("--matrix-flops-per-s", type=float, default=MEASURED_BF16_MATRIX_FLOPS)
    parser.add_argument("--bandwidth", type=float, default=MEASURED_COPY_BANDWIDTH, help="bytes/s")
    parser.add_argument("--target-ratio", type=float, default=1.5)
    parser.add_argument("--fused-step-over-bound", type=float, default=MEASURED_FUSED_STEP_OVER_BOUND)
    args = parser.parse_args(argv)
    report = ceiling(args.results_dir, args.matrix_flops_per_s, args.bandwidth, args.target_ratio,
                     args.fused_step_over_bound)
    (args.results_dir / "ceiling.json").write_text(json.dumps(report, indent=1) + "\n")
    print("| strategy | measured s | lower bound s (prefill / all matrices / GDN state) | measured / bound "
          "| matrix TFLOP/s reached |")
    print("|---|---|---|---|---|")
    for strategy, s in report["strategies"].items():
        print(f"| {strategy} | {s['measured_s']:.1f} | {s['lower_bound_s']:.1f} ({s['lower_bound_prefill_s']:.1f}"
              f" / {s['lower_bound_matrix_s']:.1f} / {s['lower_bound_state_s']:.1f}) "
              f"| {s['measured_over_lower_bound']:.2f} | {s['achieved_matrix_flops_per_s'] / 1e12:.0f} |")
    print(f"reconstruct / store_all measured {report['measured_ratio']:.3f}, of the bounds "
          f"{report['ratio_of_bounds']:.3f}; ceiling (store_all as measured, "
          f"reconstruct at its bound) {report['ratio_ceiling']:.3f}; {report['target_ratio']}x needs reconstruct at "
          f"{100 * report['matrix_rate_share_for_target']:.0f}% of {args.matrix_flops_per_s / 1e12:.0f} TFLOP/s "
          "over its whole run")
    print(f"reconstruct's GDN step ~{report['reconstruct_gdn_step_s_estimate']:.1f} s "
          f"({args.fused_step_over_bound}x its state bound); the ratio with that step at its bound "
          f"{report['ratio_with_gdn_step_at_bound']:.3f}, with it free {report['ratio_with_gdn_step_free']:.3f}")
    print(f"matrices weight-bound below ~{report['weight_bound_below_requests']:.0f} running requests; max concurrency "
          + ", ".join(f"{s} {c:.0f}" for s, c in report["max_concurrency"].items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
