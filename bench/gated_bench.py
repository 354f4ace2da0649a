"""Like-for-like GDN MTP step on CUDA: our fused step after the conv (`gdn_step_triton`: gates, q/k L2 norm,
closed-form verify, gated RMSNorm with the output gate, and the previous step's commit fused in) against vLLM 0.32's
compiled store_all kernel `torch.ops._C.fused_gdn_decode_post_conv_mtp` (same inputs, same output), with vLLM's
Triton fallback `fused_sigmoid_gating_delta_rule_update` (no norm, no output gate) as a second column.
Qwen3.5-35B-A3B dims: H=16, HV=32, K=V=128; chains of T tokens; fp32 and bf16 SSM state.

On the H200 (vLLM's compiled ops from ../shared/tools/gpu-vllm):
    source .gpu-vllm/device-setup.sh && python3 bench/gated_bench.py --out $OUT
or, with the gated GPU tests, in one device call from the checkout root (carry .gpu-vllm; timeout_s 300):
    set -o pipefail; BENCH_TIMEOUT=170 TEST_TIMEOUT=105 bash bench/device_gated.sh 2>&1
(2026-11-30b: 20 candidates, bench 153 s, 19 tests 48 s, call 219 s; now 13 candidates, some of them bigger
kernels, and 31 tests: expected ~130 s + ~80 s, ~230 s in all; the timeouts keep it under 300 s.)

Method (as bench/kernels.py): median over CUDA-graph replays of many back-to-back calls, every call on its own state
slots until 256 MiB of states are cycled (state reads come from HBM, not L2); copy bandwidth measured in the same
run. "2-state bound": one state read + one state write per request at that bandwidth (what reconstruct's fused step
must move; store_all moves 1 + T states). Before timing, each configuration is checked against the fp64 reference
(`reference_gated_tree`) and the compiled kernel's own output.
"""

import argparse
import json
import math
import pathlib
import sys
import time
import traceback

import torch

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# as a package module, never a top-level `kernels` (tests import this file; tests/kernels is a package of that name)
from bench.kernels import (  # noqa: E402
    copy_bandwidth, device_facts, graph_time_us, measure_tree, serial_per_node_us, tree_case)

from vllm_treewy.kernels.reference import reference_gated_tree  # noqa: E402
from vllm_treewy.kernels.triton import gated as gated_module  # noqa: E402
from vllm_treewy.kernels.triton import (  # noqa: E402
    ancestor_table, gdn_commit_triton, gdn_step_triton, slot_factor_width, split_slot_factors)
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
    """One (T, B, state dtype): raw post-conv inputs, a cycled state pool (1 + T slots per request for store_all),
    our per-slot factor rows [S, T, F] and the pending commit of the previous step (the whole chain accepted:
    longest path)."""

    DT_BIAS_DTYPE = torch.bfloat16

    def __init__(self, tokens, batch, state_dtype, seed=0, sets=None, widths=None):
        """A chain of `tokens` nodes, or with `widths` the draft tree of those widths with its root node (what
        vLLM verifies: root + N nodes, `tokens` ignored); the pending commit follows the tree's last node, a leaf
        at full depth."""
        gen = torch.Generator(device="cuda").manual_seed(seed)
        tree = DraftTree.from_widths(widths).with_root() if widths else DraftTree.from_widths([1] * tokens)
        tokens = tree.num_nodes
        self.chain, self.tree_parents = not widths, list(tree.parents)
        self.T, self.B, self.dtype = tokens, batch, state_dtype
        self.state_bytes = HV * V * K * torch.tensor([], dtype=state_dtype).element_size()
        self.sets = sets or max(1, min(MAX_SLOT_SETS, math.ceil(CYCLED_STATE_BYTES / (batch * self.state_bytes))))
        n = tokens * batch
        self.n = n
        packed = pack_trees([tree] * batch, device="cuda")
        self.parents, self.cu_nodes, self.max_nodes = packed.parents, packed.cu_nodes, packed.max_nodes
        # a tree's ancestor tables, built once per step for all layers in vLLM: this batch's, and the previous
        # step's (one tree, shared by every slot) for the pending commit
        self.max_depth = None if self.chain else packed.max_depth
        self.ancestors = self.pending_ancestors = None
        if not self.chain:
            one = pack_trees([tree], device="cuda")
            self.ancestors = ancestor_table(self.parents, self.cu_nodes, packed.max_depth)
            self.pending_ancestors = ancestor_table(one.parents, one.cu_nodes, one.max_depth)
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
        self.accepted = torch.full((batch,), tokens - 1, dtype=torch.int32, device="cuda")

    def fill_prev(self, config):
        """A realistic previous step in every slot set's rows: our own verify's factors on the same inputs (set 0
        last: its outputs stay in self.out)."""
        for s in reversed(range(self.sets)):
            self.ours(s, config, fused=False)()

    def inputs(self):
        return (self.mixed_qkv, self.a, self.b, self.A_log, self.dt_bias, self.z, self.norm_weight)

    def ours(self, s, config, fused=True):
        pending = self.accepted if fused else None
        return lambda: gdn_step_triton(
            *self.inputs(), self.pool, self.slot_sets[s], self.parents, self.cu_nodes, num_key_heads=H,
            max_nodes=self.max_nodes, max_depth=self.max_depth, chain=self.chain, ancestors=self.ancestors,
            norm_eps=EPS, pending_nodes=pending, pending_ancestors=self.pending_ancestors if fused else None,
            out=self.out, factors=self.factors, **config)

    def launches(self, s, config):
        """The fused step's kernel launches one by one (the state pass and the epilogue of a two-pass launch), each
        as a call: what `ours(s, config)` runs, launch by launch."""
        launches, _ = gated_module._launch_arguments(
            *self.inputs(), self.pool, self.slot_sets[s], self.parents, self.cu_nodes, self.factors, self.accepted,
            self.pending_ancestors, num_key_heads=H, max_nodes=self.max_nodes, max_depth=self.max_depth,
            chain=self.chain, scale=None, norm_eps=EPS, activation="silu", ancestors=self.ancestors, out=self.out,
            do_verify=True, **config)
        return [lambda kernel=kernel, grid=grid, args=args, kwargs=kwargs: kernel[grid](*args, **kwargs)
                for kernel, grid, args, kwargs in launches]

    def commit(self, s, config):
        launch = {k: config[k] for k in ("block_k", "num_warps", "prefetch", "max_registers", "heads_per_program",
                                         "state_pass_rows", "state_pass_block_k", "state_pass_warps") if k in config}
        return lambda: gdn_commit_triton(self.pool, self.slot_sets[s], self.factors, self.accepted,
                                         num_key_heads=H, pending_ancestors=self.pending_ancestors, **launch)

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
        a, b = self.a, self.b
        return lambda: op(self.A_log, a, b, self.dt_bias, q, k, v, initial_state=self.pool,
                          inplace_final_state=True, cu_seqlens=self.cu_seqlens,
                          ssm_state_indices=self.store_all_slots[s], num_accepted_tokens=self.num_accepted,
                          use_qk_l2norm_in_kernel=True)


def relative_error(actual, expected):
    expected = expected.double()
    return float((actual.double() - expected).abs().max() / expected.abs().max())


def check(step, op, config, records):
    """Ours vs the fp64 reference (outputs, u, and the fused commit's state), and vs the compiled kernel's output
    on the same committed state (first 4 requests)."""
    slots = step.slot_sets[0]
    before = step.pool.clone()
    step.fill_prev(config)
    torch.cuda.synchronize()
    out_plain = step.out.clone()
    worst = dict(out=0.0, u=0.0, commit=0.0, vs_compiled=None)
    # verify only (pending=None) from the untouched pool: reference from h0
    for b in range(min(step.B, 4)):
        r = slice(b * step.T, (b + 1) * step.T)
        ref = reference_gated_tree(step.mixed_qkv[r].cpu(), step.a[r].cpu(), step.b[r].cpu(), step.A_log.cpu(),
                                   step.dt_bias.cpu(), step.z[r].cpu(), step.norm_weight.cpu(),
                                   before[int(slots[b])].cpu(), step.tree_parents, H, eps=EPS)
        worst["out"] = max(worst["out"], relative_error(out_plain[r].cpu(), ref.out))
        worst["u"] = max(worst["u"], relative_error(step.u_rows(int(slots[b])).cpu(), ref.recurrence.u))
        if b == 0:
            state_ref = ref.recurrence.state[-1]
    # fused: the previous step (the same inputs, whole chain accepted) committed into slot, then verify on top
    step.out.fill_(float("nan"))
    step.ours(0, config)()
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
    records.append(dict(check=True, T=step.T, B=step.B, state=str(step.dtype), config=config, **worst))
    print(f"check T={step.T} B={step.B} {step.dtype} {config}: {worst}", flush=True)
    return worst


def time_case(step, op, fb, config, with_baselines=True, separate=True):
    sets = range(step.sets)
    step.fill_prev(config)
    t = {}
    t["ours fused"] = graph_time_us([step.ours(s, config) for s in sets])
    if separate:
        t["ours verify"] = graph_time_us([step.ours(s, config, fused=False) for s in sets])
        t["ours commit"] = graph_time_us([step.commit(s, config) for s in sets])
    if with_baselines and op is not None:
        t["compiled store_all"] = graph_time_us([step.compiled(op, s) for s in sets])
    if with_baselines and fb is not None:
        try:
            t["triton fallback store_all"] = graph_time_us([step.fallback(fb, s) for s in sets])
        except Exception as error:  # noqa: BLE001
            print("fallback failed:", repr(error)[:300], flush=True)
    return t


def two_launch_facts(step, config):
    """A two-launch config's state pass with and without products and its epilogue, each timed alone, and the
    launches' registers and spills (each launch run once outside a graph for its compiled kernel)."""
    facts = dict(state_pass_commit_us=graph_time_us([step.commit(s, config) for s in range(step.sets)]))
    launches = [step.launches(s, config) for s in range(step.sets)]
    kernels = [call() for call in launches[0]]
    facts["registers"] = [k.n_regs for k in kernels]
    facts["spills"] = [k.n_spills for k in kernels]
    facts["state_pass_us"], facts["epilogue_us"] = (graph_time_us([calls[i] for calls in launches]) for i in range(2))
    return facts


def measure_gated_tree(widths, batch, name, records, hbm):
    """The fused step on a batch of draft trees (root + N nodes each, the previous step's deepest leaf committed):
    its launch default and the TREE_CONFIGS, each checked against fp64; and the per-node
    serial baseline on the same tree and batch. A candidate that is this tree's launch default is the "default" row
    (not timed twice)."""
    step = Step(None, batch, STATE_DTYPES[name], widths=widths)
    default = gated_module.launch_defaults(STATE_DTYPES[name], batch, K, step.max_nodes)
    others = [c for c in TREE_CONFIGS[name] if {**default, **c} != default]
    times, oks, facts = {}, {}, {}
    for label, config in [("default", {})] + [(str(c), c) for c in others]:
        try:
            err = check(step, None, config, records)
            oks[label] = err["out"] < 2e-2 and err["out_written"] and err["commit"] < (
                2e-5 if name == "fp32" else 1e-2) and err["u"] < (2e-5 if name == "fp32" else 2e-2)
            times[label] = time_case(step, None, None, config, with_baselines=False, separate=label == "default")
            if {**default, **config}["state_pass_rows"]:
                facts[label] = two_launch_facts(step, config)
        except Exception:  # noqa: BLE001
            traceback.print_exc()
    nodes = step.T
    del step
    torch.cuda.empty_cache()
    case = tree_case(widths, batch, name)
    serial = serial_per_node_us(case)
    bound = 2 * batch * case.state_bytes / hbm * 1e6
    del case
    for label, t in times.items():
        rec = dict(gated_tree=str(widths), nodes_per_request=nodes, B=batch, state=name, config=label, ok=oks[label],
                   times_us={k: round(v, 2) for k, v in t.items()}, serial_per_node_us=round(serial, 2),
                   serial_over_fused=round(serial / t["ours fused"], 3), two_state_bound_us=round(bound, 2),
                   fused_x_bound=round(t["ours fused"] / bound, 3), **facts.get(label, {}))
        records.append(rec)
        print(json.dumps(rec), flush=True)


def _cfg(block_k, num_warps, prefetch, max_registers=0, **variant):  # 0: no cap (None would take the default's)
    return dict(block_k=block_k, num_warps=num_warps, prefetch=prefetch, max_registers=max_registers, **variant)


# Options a candidate leaves out would come from `launch_defaults`, which depend on the state dtype and node count:
# pinned, so that a candidate is the same launch at every T and after the defaults change.
PINNED = dict(epilogue_in_mma_layout=False, split_state_bf16=False, heads_per_program=1, solve_by_dots=False,
              state_pass_rows=0, dependent_launch=False, path_epilogue_nodes=0)


def _dot(block_k, num_warps, prefetch, **variant):
    return _cfg(block_k, num_warps, prefetch, state_dot=True, late_node_terms=True, **{**PINNED, **variant})


def _two_pass(rows, block_k, warps, epilogue_warps, **variant):
    """The state pass (`rows` value rows a program, key chunks of `block_k`, `warps` warps) and the row epilogue in its
    own launch (`epilogue_warps` warps; `dependent_launch=True`: as the state pass's programmatic dependent). The one
    kernel's options it carries (block_k 32, the accumulator-layout epilogue) are the defaults' and unused."""
    return _dot(32, epilogue_warps, 1, **{**EPILOGUE, **variant}, state_pass_rows=rows, state_pass_block_k=block_k,
                state_pass_warps=warps)


DEPENDENT = dict(dependent_launch=True)
SPLIT = dict(split_state_tf32=True)  # 2xTF32 (fp32 states; bf16 q/k)
BF16_SPLIT = dict(split_state_bf16=True)  # bf16 pieces: 3xBF16 (fp32 states), one exact pass (bf16 states)
TWO_HEADS = dict(heads_per_program=2)
MMA_SPLIT = dict(split_in_mma_layout=True)  # one layout change per chunk, the pieces split in registers
EPILOGUE = dict(epilogue_in_mma_layout=True)  # the epilogue on [V, nodes] tiles in the accumulator's layout

# candidates, timed at the tuning batches and speculative lengths (first = the launch default at large batches, also
# checked against the compiled kernel); the fastest correct one per (state, T, small/large batch) serves the rows.
# Registers from the sm_90 offline compile (bench/compile_report.py, fused): fp32 T=4 32/8/1 2xTF32 123 (tf32x3 109),
# 16/8/1 2xTF32 80, two heads 16/8/1 2xTF32 128; fp32 T=8 32/8/1 2xTF32 184 (1 program per SM), 16/8/1 2xTF32 112
# (2). bf16 T=4 64/8/1 161, 64/4/1 236, two heads 32/4/1 245; bf16 T=8 64/8/1 234, 32/8/1 138, 16/8/1 94.
# Split in the accumulator layout (MMA_SPLIT, fp32 T=4 32/8/1): 2xTF32 124, 3xBF16 127 (in the load's layout 121);
# per chunk 16 KiB stored + 16 KiB loaded through shared memory instead of 2xTF32's 32 + 32 (3xBF16's 24 + 24).
# Lagged 2xTF32 (LAGGED) 121: 32 KiB stored, no loads back (the tensor cores read the 32 KiB), 5 iterations.
# TMA 2xTF32 32/8/1: 102 registers, 69 KiB shared (a two-chunk ring of 32 KiB plus the pieces' 32), two CTAs per SM
# as the default's 123 / 34 KiB; per chunk one more 16 KiB read from shared memory (the ring into registers).
# With the pending key rows prefetched (2026-12-01, sixth session): default 128 registers (still two CTAs per SM),
# 32/8/2 184 (one; 145 before). More bytes in flight: TMA at prefetch 2 and 3 (3: the whole 128-column head, a ring
# of four chunks), 102 / 100 registers, 86.5 / 104 KiB shared, two CTAs per SM; 32/8/2 back (dropped after 2026-12-01,
# before the key rows were prefetched).
# The epilogue in the accumulator's layout (EPILOGUE, not timed): fp32 T=4 32/8/1 2xTF32 128 registers as the
# default, bf16 two heads 32/4/1 255 (254); fewer shared-memory round trips, as many shuffles (kernels.md).
# Dropped after 2026-12-01 (lost at B=64 and B=1, `results/2026-12-01/device/gated.json`): fp32 32/8/2, two heads
# 16/8/1 tf32x3 and 32/8/1 2xTF32; bf16 one row per thread (8/4/2), two heads 16/8/1 and 32/8/1. Earlier: fp32
# 32/4/1, 16/4/2, 16/8/2, 64/8/1, 16 warps; one row per thread without row sums. After 2026-12-01b
# (`results/2026-12-01b/device/gated.json`): CUDA-core products with [V, BK] partial sums, 16/8/1 and 32/8/1 (fp32
# B=64: 292 / 245 vs 159.5 us; bf16 B=1: 16.9 / 13.3 vs 12.5); fp32 32/8/1 tf32x3 (164.2) and 16/8/1 2xTF32 (210.8),
# second losses. After 2026-12-01c (`results/2026-12-01c/device/gated.json`, T=4): fp32 3xBF16 32/8/1 and 16/8/1
# (160.2 / 371.2 us at B=64 vs 153.2; 15.2 / 23.3 at B=1 vs 13.8), making room for the three above. After
# 2026-12-01d (`results/2026-12-01d/device/gated.json`, T=4, B=64 / B=1 vs the epilogue's 133.9 / 11.5 us): fp32 TMA
# at prefetch 1, 2, 3 (153.3 / 150.4 / 150.6; 14.4 / 14.1 / 14.2), 2xTF32 split in the accumulator layout (213.9 /
# 13.3), lagged products (215.2 / 13.2); bf16 (vs 127.3 / 10.6) two heads with the bf16 pass (154.8 / 17.5), 64/4/1
# (295.4 / 12.5). The T=8 rows keep their candidates: fp32 two heads 16/8/1, bf16 two heads 32/4/1.
# Eighth session (2026-12-01, offline sm_90 compile, fused T=4 unless said): two CTAs per SM where the defaults
# have one. bf16 64/8/1 bf16 pass 166 registers (one CTA), with `max_registers=128` 125 and no spill (with the
# epilogue too); bf16 32/8/1 bf16 pass with the epilogue 127. fp32 T=8 32/8/1 2xTF32 with the epilogue (the T=8
# default) 200 (one CTA), capped at 128 it spills 96 bytes; 16/8/1 with the epilogue 174, capped at 128 no spill;
# T=4 16/8/1 with the epilogue 121. Dropped for them: bf16 32/8/1 and 16/8/1 tf32 pass (157.4 / 153.1 us at B=64).
# After 2026-12-01f (`results/2026-12-01f/device/gated.json`, T=4, B=64 / B=1): the state in chunks of value rows
# (the `state_row_chunk` kernel, since removed): fp32 64 rows 16/8/4 capped 248.2 / 24.3 us, 32 rows 16/4/4 232.2 /
# 27.3 vs the default's 133.4 / 11.5; bf16 64 rows 32/8/4 and 16/8/8 capped 135.0 / 14.4 and 155.1 / 16.6 vs 98.9 /
# 9.5.
# Dropped then as well: fp32 two heads 16/8/1 (282.1 / 21.3 at T=4; 619.8 at T=8 B=64 in 2026-12-01e, against
# 385.9), bf16 32/8/1 bf16 pass with the epilogue uncapped and 64/8/1 tf32 pass uncapped (232.0 / 173.8 at B=64 in
# e; f's figures for them ran capped, kernels.md).
# More resident programs per SM (tenth session, offline sm_90, fused T=4 with the epilogue; the defaults hold two
# CTAs of 8 warps): fp32 2xTF32 16/8/1 capped at 80 registers, 16 bytes of stack (three CTAs); 16/4/1 capped at 128,
# 40 bytes (four CTAs of 4 warps). bf16 pass 32/8/1 capped at 80, 80 bytes (three CTAs); 16/4/1 capped at 128, no
# spill (four CTAs of 4 warps).
# They lost at T=2 and T=4, B=64 and B=1 (`results/2026-12-02/device/gated.json`): fp32 16/8/1 capped 80 314.0 / 312.3
# us at T=2 / T=4, B=64, 16/4/1 capped 128 326.7 / 159.3, against 107.8 / 134.3 for the defaults; bf16 32/8/1 capped 80
# 273.8 / 307.9, 16/4/1 capped 128 230.1 / 231.9, against 69.8 / 98.5. Dropped.
# The solve by tensor-core products (2026-12-02): the fp32 default for 5-8 nodes; for bf16 a candidate (it spilled when
# it lost at 8 nodes, 247.7 against 223.3 us, `trees_solve_by_dots/`; no spill since its Gram matrices' bf16 products).
# The first of each is the launch default at T=4 (`launch_defaults`; bf16's since 2026-12-01e,
# `test_first_candidate_is_the_launch_default`).
# Fifteenth session (2026-12-02c, `results/2026-12-02c/kernels/`, T=4, B=64 / B=1): two launches, the state pass and
# the epilogue kernel (`_two_pass`). Epilogue warps 4 / 2 / 1: fp32 151-154 / 133.7 / 126.0 us (the epilogue alone
# 42.1 / 24.3 / 16.0), bf16 93.3 / 75.7 / 68.3; 3xBF16 products in the fp32 state pass (88.9 us with them, 72.7
# without) against 2xTF32 (109.6): 106.4 us; then (`rows.json`) 64 rows 101.4, the large-batch default since;
# bf16 128 rows / 8 warps 68.1, the default. One launch with the last of a head's programs running its epilogue (an acq_rel arrival counter; built,
# removed): fp32 132.8-154.9, bf16 93.5-142.1 at B=64; [4,2,2] fp32 379.4 against the default's 262.4. Dropped then:
# fp32 2xTF32 32/8/1 without the epilogue (146.5 / 12.6), 3xBF16 in the accumulator layout (145.5 / 13.1), 16/8/1 with
# the epilogue uncapped and capped (326.9 / 323.6), the solve by dots at T=4 (205.0); bf16 64/8/1 without the epilogue,
# uncapped and capped (162.4 / 113.2), two heads 32/4/1 with and without the epilogue (100.4 / 129.0), the solve by
# dots at T=4 (148.0); two launches with 2- and 4-warp epilogues.
# Sixteenth session (2026-12-02d, `results/2026-12-02d/kernels/`): the accumulator-layout epilogue kernel capped at
# 128 registers (12.6 us alone at B=64 fp32 against 16.5 uncapped) lost to the row epilogue with node-major products
# (7.0), which replaced it (`t4.json`, `final.json`, kernels.md). Tuned at T = 2 / 4 / 8, B = 64 / 8 / 1: the defaults
# (every chain of up to 8 nodes in two launches) come from this list; the one-kernel entries are the rules before
# (3-4 nodes at B <= 8; T <= 2, fp32 and 16-bit; T = 5-8 fp32 by dots and 16-bit two heads). Dropped after the first
# call: the two-launch candidates with the accumulator-layout epilogue, and the row epilogue with 4 warps (B=64 fp32
# 102.4 / bf16 70.6 us against 98.4 / 65.6 for one warp, row-major products).
# Seventeenth session (2026-12-02e, `results/2026-12-02e/kernels/`, T=4, B=64, us fused / state pass alone; registers
# from the runs' compiled kernels): the state-pass tile shapes not tried before all lost to the defaults (bf16
# 128/128/8 59.0 / 52.0, fp32 64/64/4 89.2 / 81.9; `sweep.json`): bf16 64/128/8 76.6 / 69.4 (90 registers), 128/64/8
# 74.7 / 67.2, 64/64/8 73.7 / 66.8, 32/128/8 82.4 / 75.2, 128/128/16 84.6 / 77.7, 128/64/16 78.9 / 72.2, 64/128/4
# 67.2 / 59.9 (143); fp32 64/64/8 108.9 / 101.1, 32/128/8 107.5 / 101.0, 64/128/8 129.3 / 121.1, 128/64/8 98.8 /
# 91.5, 32/64/4 95.5 / 87.6, 16/128/4 121.1 / 114.1. So did a persistent state pass with the next tile in registers
# (bf16 82.2-89.1, 181-220 registers), row-epilogue programs waiting on per-head counters instead of the whole state
# pass, the state chunk loaded before the pending commit's factor rows, an L2 bulk prefetch of the next wave's tiles
# and a register cap (`persistent.json`, `options.json`), and the state pass as a stream (persistent programs over
# whole-K tiles arriving by TMA, Triton's pipeliner 2-4 stages deep, the slots gathered up front; `stream.json`):
# bf16 70.7-81.4 us (commit alone 49.6-64.3 against 43.7), fp32 115.7-132.0. The kernels were removed (kernels.md).
# The first of each is the launch default at large batches (`launch_defaults`, `test_first_candidate_is_the_launch_
# default`); the second the default at B=1.
# Twentieth session (2026-12-03b, `results/2026-12-03b/kernels/chains.json`, T=4): the state pass and the path
# epilogue (`path_epilogue`, below) for chains lost to the row epilogue, 1 / 2 / 4 nodes a program over 1 / 2 / 4
# warps: bf16 63.7 / 64.9 / 65.9 us against 59.9 at B=64 (the epilogue alone 13.8-15.9 against 8.6), 241.3-249.0
# against 229.2 at 256; fp32 89.0-91.3 against 85.6, 340.4-347.5 against 327.6. Not kept as candidates.
def _path(rows, block_k, warps, epilogue_warps, nodes, **variant):
    return _two_pass(rows, block_k, warps, epilogue_warps, path_epilogue_nodes=nodes, **BF16_SPLIT, **DEPENDENT,
                     **variant)


CONFIGS = {
    "fp32": [_two_pass(64, 64, 4, 1, **BF16_SPLIT, **DEPENDENT), _two_pass(16, 128, 2, 1, **BF16_SPLIT, **DEPENDENT),
             _dot(32, 8, 1, **SPLIT, **EPILOGUE), _two_pass(64, 64, 4, 1, **BF16_SPLIT),
             _two_pass(64, 64, 4, 2, **BF16_SPLIT, **DEPENDENT), _two_pass(32, 128, 4, 1, **BF16_SPLIT, **DEPENDENT),
             _dot(32, 8, 1, **SPLIT), _dot(32, 8, 1, **SPLIT, **EPILOGUE, solve_by_dots=True)],
    "bf16": [_two_pass(128, 128, 8, 1, **BF16_SPLIT, **DEPENDENT), _two_pass(16, 128, 2, 1, **BF16_SPLIT, **DEPENDENT),
             _dot(64, 8, 1, max_registers=128, **BF16_SPLIT, **EPILOGUE), _two_pass(128, 128, 8, 1, **BF16_SPLIT),
             _two_pass(64, 64, 4, 1, **BF16_SPLIT, **DEPENDENT), _two_pass(32, 128, 4, 1, **BF16_SPLIT, **DEPENDENT),
             _dot(64, 8, 1, **BF16_SPLIT), _dot(32, 4, 1, **EPILOGUE, heads_per_program=2)],
}


# draft trees (`--gated-trees`), beside the launch default (since 2026-12-03b the state pass and the path epilogue):
# other tiles for it, and the one kernel's launches before it (the solve by tensor-core products: fp32 32/8/1 2xTF32
# capped at 128 registers and uncapped, bf16 64/8/1 uncapped and capped). History of the one kernel's: offline
# sm_90 (fused, pending tree commit, since the Gram matrices' native products), 11 / 29 nodes: the defaults 171 / 255
# registers (fp32) and 176 / 255 (bf16), no spill: one CTA per SM; capped at 128 (two CTAs), fp32 32/8/1 spills 0 /
# 328 bytes, 16/8/1 0 / 296, bf16 32/8/1 0 / 392, 64/8/1 32 / 376.
# Dropped after 2026-12-02c (B=64, `results/2026-12-02c/kernels/t4c.json`): bf16 two heads 32/4/1 (596.7 us on
# [2,2,1]); two launches with the solve by dots (fp32 32 rows, 2-warp epilogue: 174.1 / 615.2 on [2,2,1] / [4,2,2]
# against the default's 161.0 / 262.4; bf16 128 rows: 139.0 on [2,2,1] against 165.5, capped 64/8/1 114.2); one
# launch (fp32 262.6 / 379.4, bf16 212.6).
# Seventeenth session (2026-12-02e, `results/2026-12-02e/kernels/trees.json`, bf16, B=64, [4,2,2] / [2,2,1]; the
# default then 64/8/1 uncapped, 229.9 / 163.3 us): 64/8/1 capped at 128 254 / 113 (the default for up to 16 nodes
# since), capped at 168 227 / 170; dropped: 32/8/1 uncapped 342.9 / 309.0, capped at 128 444 / 266, at 168 393 /
# 281; the one tf32 pass (bf16 states are exact in tf32) 32/8/1 284 / 206, 64/8/1 259 / 171.
# Twentieth session (2026-12-03b, `trees.json`, B=64; the default since: the state pass 64/64/4 and the path epilogue,
# 4 nodes a program over 2 warps): bf16 [4,2,2] / [2,2,1] path epilogues of 8 nodes over 4 warps 162.3 / 105.2 us, 2
# over 1 159.6 / 98.2; state passes of 32 / 16 rows 169.2 / 181.1 on [4,2,2]; the one kernel, the default before,
# 229.7 / 113.4 (uncapped / capped at 128, kept below). Dropped: path epilogues of 16 nodes over 4 warps (226.3 /
# 126.7), 128-row state passes (185.7 / 124.7); fp32 one-kernel 16/8/1 capped at 128 (466.3 / 376.1), 32/8/1
# without the epilogue (2505.4 / 1083.6); bf16 64/8/1 capped at 168 (227.5 / 170.8).
PATH_CONFIGS = [_path(64, 64, 4, 4, 8), _path(64, 64, 4, 1, 2), _path(32, 128, 4, 4, 8), _path(16, 128, 2, 4, 8)]
TREE_CONFIGS = {
    "fp32": [_dot(32, 8, 1, max_registers=128, **SPLIT, **EPILOGUE, solve_by_dots=True),
             _dot(32, 8, 1, **SPLIT, **EPILOGUE, solve_by_dots=True), *PATH_CONFIGS],
    "bf16": [_dot(64, 8, 1, **BF16_SPLIT, **EPILOGUE, solve_by_dots=True),
             _dot(64, 8, 1, max_registers=128, **BF16_SPLIT, **EPILOGUE, solve_by_dots=True), *PATH_CONFIGS],
}


def tuned_key(name, T, B, tune_batches):
    """A row takes the tuning at the largest tuned batch up to B, else the smallest (a T or batch list not tuned:
    None, the launch default)."""
    below = [b for b in tune_batches if b <= B] or sorted(tune_batches)[:1]
    return f"{name}/T={T}/B={max(below)}" if below else None


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(ROOT / "bench" / "results"))
    parser.add_argument("--name", default="gated")
    parser.add_argument("--states", nargs="*", default=list(STATE_DTYPES))
    parser.add_argument("--tokens", type=int, nargs="*", default=[2, 4, 8])
    parser.add_argument("--batches", type=int, nargs="*", default=[1, 8, 64, 256])
    parser.add_argument("--tune-tokens", type=int, nargs="*", default=[4, 8])
    parser.add_argument("--tune-batches", type=int, nargs="*", default=[64, 1])
    parser.add_argument("--trees", type=int, nargs="*", default=[64])  # [4,2,2] tree batches
    parser.add_argument("--gated-trees", nargs="*", default=[],
                        help="draft trees as widths (e.g. 2,2,1) for the fused step at its launch defaults (what "
                             "vLLM's CUDA tree step runs) and TREE_CONFIGS, against the per-node serial baseline")
    parser.add_argument("--gated-tree-batches", type=int, nargs="*", default=[64])
    parser.add_argument("--no-tune", action="store_true")
    parser.add_argument("--candidates", type=int, nargs="*", default=None,
                        help="tune only these CONFIGS entries (indices; the first, the launch default, always)")
    parser.add_argument("--short-batches", type=int, nargs="*", default=[1, 64, 256],
                        help="batches for the T != 4 rows")
    parser.add_argument("--separate-batches", type=int, nargs="*", default=[1, 64, 256],
                        help="batches where verify and commit are also timed alone")
    args = parser.parse_args()
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    started = time.time()
    facts = device_facts()
    hbm = copy_bandwidth()
    op, fb = compiled_op(), fallback_op()
    if op is not None:
        op = probe_compiled(op)
    print(json.dumps(facts), f"\ncopy bandwidth {hbm / 1e12:.3f} TB/s; compiled op {op is not None}", flush=True)
    records, tuned = [], {}

    def save():
        result = dict(command="python3 bench/gated_bench.py " + " ".join(sys.argv[1:]), device=facts,
                      copy_bandwidth_Bps=hbm, seconds=round(time.time() - started, 1), tuned=tuned, records=records)
        (out / f"{args.name}.json").write_text(json.dumps(result, indent=1))

    with torch.inference_mode():
        # most important first (a run cut by its time limit keeps them): tuning at B=64, then T=4 rows, then the rest
        for name, T, tune_batch in [(n, T, B) for n in args.states for T in args.tune_tokens
                                    for B in args.tune_batches]:
            step = Step(T, tune_batch, STATE_DTYPES[name])
            best = None
            chosen = ([0] + [i for i in args.candidates if 0 < i < len(CONFIGS[name])]
                      if args.candidates is not None else range(len(CONFIGS[name])))
            for config in [CONFIGS[name][i] for i in chosen][: 1 if args.no_tune else None]:
                try:
                    err = check(step, op if config is CONFIGS[name][0] else None, config, records)
                    ok = err["out"] < 2e-2 and err["out_written"] and err["commit"] < (
                        2e-5 if name == "fp32" else 1e-2) and err["u"] < (2e-5 if name == "fp32" else 2e-2)
                    us = graph_time_us([step.ours(s, config) for s in range(step.sets)])
                except Exception:  # noqa: BLE001
                    traceback.print_exc()
                    continue
                record = dict(tune=True, T=T, B=tune_batch, state=name, config=config, us=us, ok=ok)
                if config.get("state_pass_rows"):
                    record.update(two_launch_facts(step, config))
                records.append(record)
                print(f"tune {name} T={T} B={tune_batch}: {config} fused {us:.2f} us ok={ok} "
                      f"{record.get('state_pass_commit_us', '')} {record.get('state_pass_us', '')} "
                      f"{record.get('epilogue_us', '')}", flush=True)
                if ok and (best is None or us < best[0]):
                    best = (us, config)
            tuned[tuned_key(name, T, tune_batch, args.tune_batches)] = best[1] if best else CONFIGS[name][0]
            del step
            save()
        cases = [(T, B, name) for T in sorted(args.tokens, key=lambda t: t != 4) for name in args.states
                 for B in args.batches if T == 4 or B in args.short_batches]
        for T, B, name in cases:
            dtype = STATE_DTYPES[name]
            # a T not tuned runs what a user gets at that T: {} takes every option from `launch_defaults`
            config = tuned.get(tuned_key(name, T, B, args.tune_batches), {})
            step = Step(T, B, dtype)
            try:
                if B in (1, 64):
                    check(step, op, config, records)
                t = time_case(step, op, fb, config, separate=B in args.separate_batches)
            except Exception:  # noqa: BLE001
                traceback.print_exc()
                continue
            bound = 2 * B * step.state_bytes / hbm * 1e6
            rec = dict(T=T, B=B, state=name, config=config or "launch default",
                       times_us={k: round(v, 2) for k, v in t.items()},
                       two_state_bound_us=round(bound, 2), fused_x_bound=round(t["ours fused"] / bound, 3))
            if "compiled store_all" in t:
                rec["compiled_over_fused"] = round(t["compiled store_all"] / t["ours fused"], 3)
                if "ours verify" in t:
                    rec["compiled_over_separate"] = round(
                        t["compiled store_all"] / (t["ours verify"] + t["ours commit"]), 3)
                # store_all moves 1 state read + T written
                rec["compiled_TBps"] = round((1 + T) * B * step.state_bytes / t["compiled store_all"] / 1e6, 3)
            rec["fused_TBps"] = round(2 * B * step.state_bytes / t["ours fused"] / 1e6, 3)
            records.append(rec)
            print(json.dumps(rec), flush=True)
            del step
            torch.cuda.empty_cache()
            save()
        for widths in args.gated_trees:
            for B in args.gated_tree_batches:
                for name in args.states:
                    try:
                        measure_gated_tree([int(w) for w in widths.split(",")], B, name, records, hbm)
                    except Exception:  # noqa: BLE001
                        traceback.print_exc()
                    torch.cuda.empty_cache()
                    save()
        trees = []
        for B in args.trees:
            for name in args.states:
                try:
                    measure_tree((4, 2, 2), B, name, trees, hbm)
                except Exception:  # noqa: BLE001
                    traceback.print_exc()
                torch.cuda.empty_cache()
        records.append(dict(trees=trees))
        save()

    print("\n| state | T | B | compiled | fallback | ours fused | ours verify+commit | compiled/fused | x 2-state "
          "bound | config |")
    for r in records:
        if "times_us" in r and "T" in r:
            t = r["times_us"]
            sep = t.get("ours verify", 0) + t.get("ours commit", 0)
            print(f"| {r['state']} | {r['T']} | {r['B']} | {t.get('compiled store_all', '')} | "
                  f"{t.get('triton fallback store_all', '')} | {t['ours fused']} | {sep:.2f} | "
                  f"{r.get('compiled_over_fused', '')} | {r['fused_x_bound']} | {r['config']} |")
    for r in records:
        if "gated_tree" in r:
            print(f"gated tree {r['gated_tree']} B={r['B']} {r['state']} {r['config'][:60]}: fused "
                  f"{r['times_us']['ours fused']} us, "
                  f"per-node serial {r['serial_per_node_us']} us, serial/fused {r['serial_over_fused']}")
    for r in trees:
        if r["op"] in ("verify", "serial per-node"):
            print(f"tree [4,2,2] B={r['batch']} {r['state']} {r['op']}: {r['us']} us serial/ours "
                  f"{r['serial_over_ours']}")
    print(f"done in {time.time() - started:.0f} s")


if __name__ == "__main__":
    main()
