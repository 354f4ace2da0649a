"""Would splitting a head's value rows over several programs speed up the fused GDN step? A probe, no kernel change:
the state rows of a delta-rule head evolve independently given the keys and gates, so a program that holds V / s of
a head's rows does the work of a program of the same kernel on a model with s times the value heads of V / s rows
each (the same state bytes, the same per-node terms, s key copies per node in the factor rows). Only the gated
RMSNorm, which sums over all V rows, would need a second pass; its cost is timed on its own (a Triton row norm over
the step's bf16 output, in place).

    source .gpu-vllm/device-setup.sh && python3 bench/value_split_probe.py --out $OUT

Same method as `gated_bench.py` (cycled state slots, CUDA-graph replays, the previous step's commit fused in).
"""

import argparse
import json
import pathlib
import sys
import time
import traceback

import torch
import triton
import triton.language as tl

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import bench.gated_bench as gb  # noqa: E402
from bench.kernels import copy_bandwidth, device_facts, graph_time_us  # noqa: E402


@triton.jit
def _gated_rms_norm_kernel(out, z, weight, eps, stride_row, V: tl.constexpr, ROWS: tl.constexpr):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, V)
    offs = rows[:, None] * stride_row + cols[None, :]
    o = tl.load(out + offs).to(tl.float32)
    zz = tl.load(z + offs).to(tl.float32)
    w = tl.load(weight + cols).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(o * o, 1) / V + eps)
    tl.store(out + offs, (o * rstd[:, None] * w[None, :] * zz * tl.sigmoid(zz)).to(out.dtype.element_ty))


def norm_call(out, z, weight, rows=16):
    flat, zf = out.view(-1, out.shape[-1]), z.view(-1, z.shape[-1])
    grid = (flat.shape[0] // rows,)
    return lambda: _gated_rms_norm_kernel[grid](flat, zf, weight, 1e-6, flat.stride(0), V=flat.shape[1], ROWS=rows,
                                                num_warps=4)


def candidates(name, v):
    extra = gb.SPLIT if name == "fp32" else gb.BF16_SPLIT
    if v == 128:
        return [{}]  # the launch default, what users run
    if v == 64:
        shapes = [(32, 4), (64, 4), (128, 4), (64, 8)]
    else:
        shapes = [(32, 4), (64, 4), (128, 4), (64, 2), (128, 2)]
    return [gb._dot(bk, w, 1, **extra, **gb.EPILOGUE) for bk, w in shapes] + [
        gb._dot(shapes[0][0], shapes[0][1], 2, **extra, **gb.EPILOGUE)]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--splits", type=int, nargs="*", default=[1, 2, 4])
    parser.add_argument("--batches", type=int, nargs="*", default=[64, 1, 256])
    parser.add_argument("--tokens", type=int, default=4)
    args = parser.parse_args()
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    started = time.time()
    facts, hbm = device_facts(), copy_bandwidth()
    op = gb.compiled_op()
    if op is not None:
        op = gb.probe_compiled(op)
    records = []

    def save():
        (out / "value_split_probe.json").write_text(json.dumps(dict(
            command="python3 bench/value_split_probe.py " + " ".join(sys.argv[1:]), device=facts,
            copy_bandwidth_Bps=hbm, seconds=round(time.time() - started, 1), records=records), indent=1))

    base_hv, base_v = gb.HV, gb.V
    with torch.inference_mode():
        for name in ("fp32", "bf16"):
            for B in args.batches:
                for s in args.splits:
                    gb.HV, gb.V = base_hv * s, base_v // s
                    step = gb.Step(args.tokens, B, gb.STATE_DTYPES[name])
                    if s == 1 and op is not None:
                        us = graph_time_us([step.compiled(op, k) for k in range(step.sets)])
                        records.append(dict(state=name, B=B, split=1, op="compiled store_all", us=us))
                        print(f"{name} B={B} compiled store_all {us:.2f} us", flush=True)
                    for config in candidates(name, gb.V):
                        try:
                            ok = None
                            if B == 64:
                                err = gb.check(step, None, config, [])
                                ok = err["out"] < 2e-2 and err["commit"] < (2e-5 if name == "fp32" else 1e-2)
                            us = graph_time_us([step.ours(k, config) for k in range(step.sets)])
                        except Exception:  # noqa: BLE001
                            traceback.print_exc()
                            continue
                        bound = 2 * B * step.state_bytes / hbm * 1e6
                        records.append(dict(state=name, B=B, split=s, op="ours fused", config=config, us=us,
                                            ok=ok, x_bound=us / bound))
                        print(f"{name} B={B} split={s} fused {us:.2f} us x{us / bound:.2f} bound ok={ok} {config}",
                              flush=True)
                    if s > 1:  # the second pass a split needs: the gated RMSNorm over the whole head, in place
                        gb.HV, gb.V = base_hv, base_v
                        o = torch.randn(B * args.tokens, base_hv, base_v, device="cuda").bfloat16()
                        z = torch.randn_like(o)
                        w = torch.ones(base_v, device="cuda").bfloat16()
                        us = graph_time_us([norm_call(o, z, w)])
                        records.append(dict(state=name, B=B, split=s, op="gated rms norm", us=us))
                        print(f"{name} B={B} norm pass {us:.2f} us", flush=True)
                    del step
                    torch.cuda.empty_cache()
                    save()
    print(f"done in {time.time() - started:.0f} s")


if __name__ == "__main__":
    main()
