"""Like-for-like GDN MTP step on CUDA: our step after the conv (`gdn_step_triton`: the previous step's commit, gates,
q/k L2 norm, closed-form verify, gated RMSNorm with the output gate) against vLLM 0.32's compiled store_all kernel
`torch.ops._C.fused_gdn_decode_post_conv_mtp` (same inputs, same output), with vLLM's Triton fallback
`fused_sigmoid_gating_delta_rule_update` (no norm, no output gate) as a second column; draft trees against the
per-node serial baseline (`serial_baseline`). Qwen3.5-35B-A3B dims: H=16, HV=32, K=V=128; fp32 and bf16 SSM state.

On the H200 (vLLM's compiled ops from ../shared/tools/gpu-vllm; carry .gpu-vllm):
    source .gpu-vllm/device-setup.sh && PYTHONPATH=$PWD python3 bench/kernels/gated_bench.py --out $OUT
Each row runs the launch table's launch (`step_launch`), or with `--candidates` also the given `StepLaunch`es.

Method: median over CUDA-graph replays of many back-to-back calls (`timing.graph_time_us`), every call on its own
state slots until 256 MiB of states are cycled (state reads come from HBM, not L2); copy bandwidth measured in the
same run. "2-state bound": one state read + one state write per request at that bandwidth (what reconstruct's step
must move; store_all moves 1 + T states). Before timing, each launch is checked against the fp64 reference
(`reference_gated_tree`) and, where it runs, the compiled kernel's own output.
"""

import argparse
import dataclasses
import json
import math
import pathlib
import sys
import time
import traceback

import torch

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

# as a package module, never a top-level name (tests import this file; tests/kernels is a package)
from bench.kernels.serial_baseline import serial_per_node_us  # noqa: E402
from bench.kernels.timing import copy_bandwidth, device_facts, graph_time_us  # noqa: E402

from vllm_treewy.kernels.factor_rows import slot_factor_width, split_slot_factors  # noqa: E402
from vllm_treewy.kernels.reference import reference_gated_tree  # noqa: E402
from vllm_treewy.kernels.ancestor_table_triton import ancestor_table  # noqa: E402
from vllm_treewy.kernels.gdn_step_triton import StepLaunch, gdn_commit_triton, gdn_step_triton  # noqa: E402
from vllm_treewy.kernels.gdn_step_triton.step import step_launch, step_launches  # noqa: E402
from vllm_treewy.tree import DraftTree, pack_trees  # noqa: E402

H, HV, K, V = 16, 32, 128, 128
STATE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
CYCLED_STATE_BYTES = 256 << 20
MAX_SLOT_SETS = 64
EPS = 1e-6


def compiled_op():
    try:
        import vllm._C_stable_libtorch  # noqa: F401  registers torch.ops._C.*
    except Exception as error:  # noqa: BLE001
        print("vllm._C_stable_libtorch:", repr(error)[:200])
    return getattr(torch.ops._C, "fused_gdn_decode_post_conv_mtp", None)


def probe_compiled(op):
    """The compiled kernel's dtype for dt_bias (vLLM's parameter is created in the model dtype, bf16): try bf16,
    then fp32; None if neither runs."""
    for dtype in (torch.bfloat16, torch.float32):
        try:
            Step.DT_BIAS_DTYPE = dtype
            step = Step(2, 2, torch.float32, sets=1)
            step.compiled(op, 0)()
            torch.cuda.synchronize()
            print(f"compiled op runs with dt_bias {dtype}", flush=True)
            return op
        except Exception as error:  # noqa: BLE001
            print(f"compiled op with dt_bias {dtype}: {repr(error)[:300]}", flush=True)
    Step.DT_BIAS_DTYPE = torch.bfloat16
    return None


def fallback_op():
    try:
        from vllm.third_party.flash_linear_attention.ops.fused_sigmoid_gating import (
            fused_sigmoid_gating_delta_rule_update,
        )
        return fused_sigmoid_gating_delta_rule_update
    except Exception as error:  # noqa: BLE001
        print("fallback import:", repr(error)[:200])
        return None


class Step:
    """One (draft, B, state dtype): raw post-conv inputs, a cycled state pool (1 + T slots per request for
    store_all), our per-slot factor rows [S, T, F] and the commit of the previous step (the deepest node: the
    longest path)."""

    DT_BIAS_DTYPE = torch.bfloat16

    def __init__(self, tokens, batch, state_dtype, seed=0, sets=None, widths=None):
        """A chain of `tokens` nodes, or with `widths` the draft tree of those widths with its root node (what
        vLLM verifies: root + N nodes, `tokens` ignored); the commit follows the tree's last node, a leaf at full
        depth."""
        gen = torch.Generator(device="cuda").manual_seed(seed)
        tree = DraftTree.from_widths(widths).with_root() if widths else DraftTree.from_widths([1] * tokens)
        tokens = tree.num_nodes
        self.chain, self.tree_parents = not widths, list(tree.parents)
        self.T, self.B, self.dtype = tokens, batch, state_dtype
        self.state_bytes = HV * V * K * torch.tensor([], dtype=state_dtype).element_size()
        self.sets = sets or max(1, min(MAX_SLOT_SETS, math.ceil(CYCLED_STATE_BYTES / (batch * self.state_bytes))))
        n = tokens * batch
        packed = pack_trees([tree] * batch, device="cuda")
        self.parents, self.cu_nodes, self.max_nodes = packed.parents, packed.cu_nodes, packed.max_nodes
        # a tree's ancestor tables, built once per step for all layers in vLLM: this batch's, and the previous
        # step's (one tree, shared by every slot) for the commit
        self.ancestors = self.commit_ancestors = None
        if not self.chain:
            one = pack_trees([tree], device="cuda")
            self.ancestors = ancestor_table(self.parents, self.cu_nodes, packed.max_depth)
            self.commit_ancestors = ancestor_table(one.parents, one.cu_nodes, one.max_depth)
        self.mixed_qkv = torch.randn(n, 2 * H * K + HV * V, device="cuda", generator=gen).bfloat16()
        self.a = torch.randn(n, HV, device="cuda", generator=gen).bfloat16()
        self.b = torch.randn(n, HV, device="cuda", generator=gen).bfloat16()
        self.A_log = torch.randn(HV, device="cuda", generator=gen) * 0.5
        self.dt_bias = torch.randn(HV, device="cuda", generator=gen).to(self.DT_BIAS_DTYPE)
        self.z = torch.randn(n, HV, V, device="cuda", generator=gen).bfloat16()
        self.norm_weight = (1 + 0.1 * torch.randn(V, device="cuda", generator=gen)).bfloat16()
        per_request = tokens  # vLLM's spec_state_indices [B, T]: token t's state into slot t, h0 read from slot 0
        # slot 0 is vLLM's null block: never used
        self.pool = (torch.randn(1 + self.sets * batch * per_request, HV, V, K, device="cuda", generator=gen) * 0.3
                     ).to(state_dtype)
        slots = 1 + torch.arange(self.sets * batch * per_request, device="cuda", dtype=torch.int32)
        self.store_all_slots = slots.view(self.sets, batch, per_request)
        self.slot_sets = self.store_all_slots[..., 0].contiguous()
        self.cu_seqlens = torch.arange(0, (batch + 1) * tokens, tokens, dtype=torch.int32, device="cuda")
        self.num_accepted = torch.ones(batch, dtype=torch.int32, device="cuda")
        self.out = torch.empty(n, HV, V, dtype=torch.bfloat16, device="cuda")
        self.out_ref = torch.empty_like(self.out)
        self.factors = torch.empty(self.pool.shape[0], tokens, slot_factor_width(HV, K, V), device="cuda")
        self.commit_nodes = torch.full((batch,), tokens - 1, dtype=torch.int32, device="cuda")

    def fill_prev(self, launch):
        """A realistic previous step in every slot set's rows: our own verify's factors on the same inputs (set 0
        last: its outputs stay in self.out)."""
        for s in reversed(range(self.sets)):
            self.ours(s, launch, commit=False)()

    def inputs(self):
        return (self.mixed_qkv, self.a, self.b, self.A_log, self.dt_bias, self.z, self.norm_weight)

    def ours(self, s, launch, commit=True):
        return lambda: gdn_step_triton(
            *self.inputs(), self.pool, self.slot_sets[s], self.cu_nodes, num_key_heads=H,
            max_nodes=self.max_nodes, ancestors=self.ancestors,
            norm_eps=EPS, commit_nodes=self.commit_nodes if commit else None,
            commit_ancestors=self.commit_ancestors if commit else None, out=self.out, factors=self.factors,
            launch=launch)

    def launches(self, s, launch):
        """The step's two launches one by one (the state pass, the epilogue), each as a call."""
        launches, _ = step_launches(
            *self.inputs(), self.pool, self.slot_sets[s], self.cu_nodes, self.factors,
            self.commit_nodes, self.commit_ancestors, num_key_heads=H, max_nodes=self.max_nodes, scale=None,
            norm_eps=EPS, activation="silu", ancestors=self.ancestors, out=self.out, launch=launch)
        return [lambda kernel=kernel, grid=grid, args=args, kwargs=kwargs: kernel[grid](*args, **kwargs)
                for kernel, grid, args, kwargs in launches]

    def commit(self, s, launch):
        return lambda: gdn_commit_triton(self.pool, self.slot_sets[s], self.factors, self.commit_nodes,
                                         num_key_heads=H, commit_ancestors=self.commit_ancestors, launch=launch)

    def u_rows(self, slot):
        return split_slot_factors(self.factors[slot], HV, K, V)[2]

    def compiled(self, op, s):
        return lambda: op(self.mixed_qkv, self.a, self.b, self.A_log, self.dt_bias, self.store_all_slots[s],
                          self.cu_seqlens, self.num_accepted, self.pool, self.z, self.norm_weight, self.out_ref,
                          K**-0.5, EPS, "silu")

    def fallback(self, op, s):
        q = self.mixed_qkv[:, :H * K].unflatten(1, (H, K))[None]
        k = self.mixed_qkv[:, H * K: 2 * H * K].unflatten(1, (H, K))[None]
        v = self.mixed_qkv[:, 2 * H * K:].unflatten(1, (HV, V))[None]
        return lambda: op(self.A_log, self.a, self.b, self.dt_bias, q, k, v, initial_state=self.pool,
                          inplace_final_state=True, cu_seqlens=self.cu_seqlens,
                          ssm_state_indices=self.store_all_slots[s], num_accepted_tokens=self.num_accepted,
                          use_qk_l2norm_in_kernel=True)


def relative_error(actual, expected):
    expected = expected.double()
    return float((actual.double() - expected).abs().max() / expected.abs().max())


def check(step, op, launch, records):
    """Ours vs the fp64 reference (outputs, u, and the fused commit's state), and vs the compiled kernel's output
    on the same committed state (first 4 requests). Returns whether every error is within tolerance."""
    slots = step.slot_sets[0]
    before = step.pool.clone()
    step.fill_prev(launch)
    torch.cuda.synchronize()
    out_plain = step.out.clone()
    worst = dict(out=0.0, u=0.0, commit=0.0, vs_compiled=None)
    # verify only (no commit) from the untouched pool: reference from h0
    for b in range(min(step.B, 4)):
        r = slice(b * step.T, (b + 1) * step.T)
        ref = reference_gated_tree(step.mixed_qkv[r].cpu(), step.a[r].cpu(), step.b[r].cpu(), step.A_log.cpu(),
                                   step.dt_bias.cpu(), step.z[r].cpu(), step.norm_weight.cpu(),
                                   before[int(slots[b])].cpu(), step.tree_parents, H, eps=EPS)
        worst["out"] = max(worst["out"], relative_error(out_plain[r].cpu(), ref.out))
        worst["u"] = max(worst["u"], relative_error(step.u_rows(int(slots[b])).cpu(), ref.recurrence.u))
        if b == 0:
            state_ref = ref.recurrence.state[-1]
    # fused: the previous step (the same inputs, the deepest node committed) into slot, then verify on top
    step.out.fill_(float("nan"))
    step.ours(0, launch)()
    torch.cuda.synchronize()
    worst["commit"] = relative_error(step.pool[int(slots[0])].cpu(), state_ref)
    worst["out_written"] = bool(step.out.isfinite().all())
    if op is not None:
        step.pool.copy_(before)
        step.out_ref.fill_(float("nan"))
        step.compiled(op, 0)()
        torch.cuda.synchronize()
        worst["vs_compiled"] = relative_error(out_plain.cpu(), step.out_ref.cpu())
    step.pool.copy_(before)
    fp32 = step.dtype == torch.float32
    ok = (worst["out"] < 2e-2 and worst["out_written"] and worst["commit"] < (2e-5 if fp32 else 1e-2)
          and worst["u"] < (2e-5 if fp32 else 2e-2))
    records.append(dict(check=True, T=step.T, B=step.B, state=str(step.dtype), launch=_name(launch), ok=ok, **worst))
    print(f"check T={step.T} B={step.B} {step.dtype} {_name(launch)}: ok={ok} {worst}", flush=True)
    return ok


def time_case(step, op, fb, launch, separate=True):
    sets = range(step.sets)
    step.fill_prev(launch)
    t = {"ours fused": graph_time_us([step.ours(s, launch) for s in sets])}
    if separate:
        t["ours verify"] = graph_time_us([step.ours(s, launch, commit=False) for s in sets])
        t["ours commit"] = graph_time_us([step.commit(s, launch) for s in sets])
        calls = [step.launches(s, launch) for s in sets]
        t["state pass alone"], t["epilogue alone"] = (graph_time_us([c[i] for c in calls]) for i in range(2))
    if op is not None:
        t["compiled store_all"] = graph_time_us([step.compiled(op, s) for s in sets])
    if fb is not None:
        try:
            t["triton fallback store_all"] = graph_time_us([step.fallback(fb, s) for s in sets])
        except Exception as error:  # noqa: BLE001
            print("fallback failed:", repr(error)[:300], flush=True)
    return t


def _name(launch):
    return "launch table" if launch is None else str(dataclasses.asdict(launch))


def chain_row(T, B, name, launch, op, fb, hbm, separate, records):
    step = Step(T, B, STATE_DTYPES[name])
    ok = check(step, op if B in (1, 64) else None, launch, records)
    t = time_case(step, op, fb, launch, separate=separate)
    bound = 2 * B * step.state_bytes / hbm * 1e6
    rec = dict(T=T, B=B, state=name, launch=_name(launch), ok=ok, times_us={k: round(v, 2) for k, v in t.items()},
               two_state_bound_us=round(bound, 2), fused_x_bound=round(t["ours fused"] / bound, 3),
               fused_TBps=round(2 * B * step.state_bytes / t["ours fused"] / 1e6, 3))
    if "compiled store_all" in t:
        rec["compiled_over_fused"] = round(t["compiled store_all"] / t["ours fused"], 3)
        # store_all moves 1 state read + T written
        rec["compiled_TBps"] = round((1 + T) * B * step.state_bytes / t["compiled store_all"] / 1e6, 3)
    records.append(rec)
    print(json.dumps(rec), flush=True)


def tree_row(widths, B, name, launch, hbm, serial_us, records):
    step = Step(None, B, STATE_DTYPES[name], widths=widths)
    ok = check(step, None, launch, records)
    t = time_case(step, None, None, launch, separate=True)
    bound = 2 * B * step.state_bytes / hbm * 1e6
    rec = dict(gated_tree=str(widths), nodes_per_request=step.T, B=B, state=name, launch=_name(launch), ok=ok,
               times_us={k: round(v, 2) for k, v in t.items()}, serial_per_node_us=round(serial_us, 2),
               serial_over_fused=round(serial_us / t["ours fused"], 3), two_state_bound_us=round(bound, 2),
               fused_x_bound=round(t["ours fused"] / bound, 3))
    records.append(rec)
    print(json.dumps(rec), flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(ROOT / "bench" / "results"))
    parser.add_argument("--name", default="gated")
    parser.add_argument("--states", nargs="*", default=list(STATE_DTYPES))
    parser.add_argument("--tokens", type=int, nargs="*", default=[2, 4, 8], help="chain lengths")
    parser.add_argument("--batches", type=int, nargs="*", default=[1, 64, 256], help="chain batches")
    parser.add_argument("--trees", nargs="*", default=["2,2,1", "4,2,2"],
                        help="draft trees as widths (root + N nodes a request)")
    parser.add_argument("--tree-batches", type=int, nargs="*", default=[64])
    parser.add_argument("--separate-batches", type=int, nargs="*", default=[64],
                        help="chain batches where verify, commit and each launch are also timed alone")
    parser.add_argument("--no-fallback", action="store_true", help="leave vLLM's Triton fallback column out")
    parser.add_argument("--candidates", nargs="*", default=[],
                        help="StepLaunch fields as JSON, timed beside the launch table's at every row")
    args = parser.parse_args()
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    started = time.time()
    facts = device_facts()
    hbm = copy_bandwidth()
    op, fb = compiled_op(), None if args.no_fallback else fallback_op()
    if op is not None:
        op = probe_compiled(op)
    print(json.dumps(facts), f"\ncopy bandwidth {hbm / 1e12:.3f} TB/s; compiled op {op is not None}", flush=True)
    launches = [None] + [StepLaunch(**json.loads(c)) for c in args.candidates]
    records = []

    def save():
        result = dict(command="python3 bench/kernels/gated_bench.py " + " ".join(sys.argv[1:]), device=facts,
                      copy_bandwidth_Bps=hbm, seconds=round(time.time() - started, 1), records=records)
        (out / f"{args.name}.json").write_text(json.dumps(result, indent=1))

    with torch.inference_mode():
        for T in sorted(args.tokens, key=lambda t: t != 4):
            for name in args.states:
                for B in args.batches:
                    for launch in launches:
                        try:
                            chain_row(T, B, name, launch, op if launch is None else None,
                                      fb if launch is None else None, hbm, B in args.separate_batches, records)
                        except Exception:  # noqa: BLE001
                            traceback.print_exc()
                        torch.cuda.empty_cache()
                    save()
        for widths in args.trees:
            widths = [int(w) for w in widths.split(",")]
            for B in args.tree_batches:
                for name in args.states:
                    try:
                        serial = serial_per_node_us(widths, B, STATE_DTYPES[name])
                        for launch in launches:
                            tree_row(widths, B, name, launch, hbm, serial, records)
                    except Exception:  # noqa: BLE001
                        traceback.print_exc()
                    torch.cuda.empty_cache()
                    save()
        save()

    print("\n| state | T | B | launch | ours fused | compiled | fallback | compiled / fused | x 2-state bound |")
    for r in records:
        if "times_us" in r and "T" in r:
            t = r["times_us"]
            print(f"| {r['state']} | {r['T']} | {r['B']} | {r['launch']} | {t['ours fused']} | "
                  f"{t.get('compiled store_all', '')} | {t.get('triton fallback store_all', '')} | "
                  f"{r.get('compiled_over_fused', '')} | {r['fused_x_bound']} |")
    for r in records:
        if "gated_tree" in r:
            print(f"| tree {r['gated_tree']} | {r['state']} | {r['B']} | {r['launch']} | "
                  f"{r['times_us']['ours fused']} | serial {r['serial_per_node_us']} | {r['serial_over_fused']}x |")
    print(f"done in {time.time() - started:.0f} s")


if __name__ == "__main__":
    main()
