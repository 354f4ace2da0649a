"""Per-GDN-layer kernel benchmark on CUDA: our fused verify / commit against vLLM 0.32's store_all kernels (chains)
and the per-node serial baseline (trees), at Qwen3.5-35B-A3B dims (H=16, HV=32, K=V=128).

    python3 bench/extract_vllm_baseline.py          # once: vLLM's kernels into .vllm-baseline/ (git-ignored)
    python3 bench/kernels.py --tune --out bench/results

Every time is the median over CUDA-graph replays of many back-to-back calls (vLLM decodes under CUDA graphs), with
each call on its own set of state slots until 256 MiB of states are cycled, so the state reads come from HBM, not
L2. HBM bound = one state read + one state write per request at the copy bandwidth measured in the same run.
Inputs are what the layer holds at that point: q, k (normalised, q scaled), v in bf16; g, beta fp32.

The like-for-like comparison with vLLM's compiled MTP kernel (`fused_gdn_decode_post_conv_mtp`, raw post-conv
inputs, gates and gated RMSNorm inside) is `bench/gated_bench.py`; this file keeps the verify/commit kernels on
precomputed gates and the trees against the per-node serial baseline.
"""

import argparse
import json
import math
import pathlib
import platform
import statistics
import subprocess
import sys
import time

import torch
import triton

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / ".vllm-baseline"))

from vllm.third_party.flash_linear_attention.ops.fused_recurrent import (  # noqa: E402
    fused_recurrent_gated_delta_rule,
)
from vllm.third_party.flash_linear_attention.ops.fused_sigmoid_gating import (  # noqa: E402
    fused_sigmoid_gating_delta_rule_update,
)

from vllm_treewy.kernels.triton import (  # noqa: E402
    PendingCommit,
    ancestor_table,
    commit_packed_triton,
    serial_tree_triton,
    verify_packed_triton,
)
from vllm_treewy.kernels.triton.commit import COMMIT_CONFIGS, SMALL_BATCH_COMMIT_CONFIGS  # noqa: E402
from vllm_treewy.kernels.triton.verify import (  # noqa: E402
    SMALL_BATCH_VERIFY_CONFIGS,
    VERIFY_CONFIGS,
    measured_config,
)
from vllm_treewy.tree import DraftTree, pack_trees  # noqa: E402

H, HV, K, V = 16, 32, 128, 128
CHAINS = (2, 4, 8)
TREES = ((2, 2, 1), (4, 2, 2), (4, 4, 2, 2))
BATCHES = (1, 8, 64, 256)
STATE_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
CYCLED_STATE_BYTES = 256 << 20
MAX_SLOT_SETS = 128
SERIAL_NODE_STATE_LIMIT = 48 << 30  # skip per-node serial runs whose node states would not fit comfortably

# Launch configurations: the wrappers' measured defaults (they depend on the batch size), unless --tune measures
# them again at B=64; tuned ones then serve every batch. Keys: (op, wrapper kind, state), op in verify/fused/commit.
_LAUNCH_KEYS = ("block_v", "block_k", "num_warps", "max_registers")
TUNED = {}


def launch(op, kind, dtype_name, batch):
    """(the overrides passed to the wrapper, the configuration it runs with) for one op of one case."""
    if (op, kind, dtype_name) in TUNED:
        return TUNED[op, kind, dtype_name], TUNED[op, kind, dtype_name]
    fp32 = dtype_name == "fp32"
    if op == "commit":
        measured = measured_config(COMMIT_CONFIGS, SMALL_BATCH_COMMIT_CONFIGS, fp32, batch)
    else:
        measured = measured_config(VERIFY_CONFIGS, SMALL_BATCH_VERIFY_CONFIGS, (kind, fp32), batch)
    return {}, dict(zip(_LAUNCH_KEYS, measured))


def graph_time_us(calls, replays=7, min_calls=48):
    """Median time of one call: capture all `calls` (repeated up to min_calls) in a CUDA graph, replay it."""
    for call in calls:
        call()
    torch.cuda.synchronize()
    repeat = max(1, math.ceil(min_calls / len(calls)))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(repeat):
            for call in calls:
                call()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / (repeat * len(calls)))
    del graph
    return statistics.median(times)


def copy_bandwidth():
    """Device-to-device copy of 1 GiB of bf16, bytes read + written per second: the best of a memcpy (eager and
    in a CUDA graph) and an elementwise kernel (also graphed)."""
    src = torch.randn(1 << 29, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    seconds = []
    for _ in range(10):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        seconds.append(start.elapsed_time(end) * 1e-3)
    seconds.append(graph_time_us([lambda: dst.copy_(src)], min_calls=10) * 1e-6)
    seconds.append(graph_time_us([lambda: torch.mul(src, 1, out=dst)], min_calls=10) * 1e-6)
    del src, dst
    return 2 * (1 << 30) / min(seconds)


def device_facts():
    props = torch.cuda.get_device_properties(0)
    smi = subprocess.run(
        ["nvidia-smi", "--query-gpu=name,driver_version,clocks.max.sm,clocks.max.mem,memory.total",
         "--format=csv,noheader"], capture_output=True, text=True).stdout.strip()
    return dict(
        name=props.name, sms=props.multi_processor_count, l2_bytes=getattr(props, "L2_cache_size", None),
        memory_bytes=props.total_memory, capability=f"{props.major}.{props.minor}", nvidia_smi=smi,
        torch=torch.__version__, triton=triton.__version__, cuda=torch.version.cuda, python=platform.python_version(),
    )


class Case:
    """One (draft shape, batch, state dtype): inputs, `sets` slot sets, factor buffers."""

    def __init__(self, parents, chain, batch, state_dtype, store_all_tokens=0):
        self.chain, self.batch, self.state_dtype = chain, batch, state_dtype
        self.tree = DraftTree(tuple(parents))
        packed = pack_trees([self.tree] * batch, device="cuda")
        self.parents, self.cu_nodes = packed.parents, packed.cu_nodes
        self.max_nodes, self.max_depth, self.nodes = packed.max_nodes, packed.max_depth, packed.num_nodes
        self.state_bytes = HV * V * K * torch.tensor([], dtype=state_dtype).element_size()
        self.sets = max(1, min(MAX_SLOT_SETS, math.ceil(CYCLED_STATE_BYTES / (batch * self.state_bytes))))
        slots_per_request = max(1, store_all_tokens)
        # slot 0 is vLLM's null block: never used
        self.pool = torch.randn(1 + self.sets * batch * slots_per_request, HV, V, K, device="cuda").mul_(0.05).to(
            state_dtype)
        slots = 1 + torch.arange(self.sets * batch * slots_per_request, device="cuda", dtype=torch.int32)
        self.store_all_slots = slots.view(self.sets, batch, slots_per_request)
        self.slot_sets = self.store_all_slots[..., 0].contiguous()
        n = self.nodes
        self.q = torch.nn.functional.normalize(torch.randn(n, H, K, device="cuda"), dim=-1).mul_(K**-0.5).bfloat16()
        self.k = torch.nn.functional.normalize(torch.randn(n, H, K, device="cuda"), dim=-1).bfloat16()
        self.v = torch.randn(n, HV, V, device="cuda").bfloat16()
        self.g = -torch.rand(n, HV, device="cuda")
        self.beta = torch.rand(n, HV, device="cuda")
        self.o = torch.empty_like(self.v)
        self.u = torch.empty(n, HV, V, device="cuda")
        self.u_next = torch.empty_like(self.u)
        # commit the deepest node (the whole chain accepted): the longest path
        deepest = max(range(len(parents)), key=self.tree.depth.__getitem__)
        self.accepted = torch.full((batch,), deepest, dtype=torch.int32, device="cuda")
        # built once per step and shared by every GDN layer (`ancestor_table` asks for that): timed on its own
        self.ancestors = None if chain else self.ancestor_table()

    def ancestor_table(self):
        return ancestor_table(self.parents, self.cu_nodes, self.max_depth)

    def bounds(self):
        return dict(max_nodes=self.max_nodes, max_depth=self.max_depth, chain=self.chain, ancestors=self.ancestors)

    def verify(self, s, config):
        return lambda: verify_packed_triton(
            self.q, self.k, self.v, self.g, self.beta, self.pool, self.slot_sets[s], self.parents, self.cu_nodes,
            o=self.o, u=self.u, **config, **self.bounds())

    def commit(self, s, config):
        return lambda: commit_packed_triton(
            self.pool, self.slot_sets[s], self.k, self.u, self.g, self.parents, self.cu_nodes, self.accepted,
            **config, **self.bounds())

    def verify_commit(self, s, vcfg, ccfg):
        verify, commit = self.verify(s, vcfg), self.commit(s, ccfg)
        return lambda: (verify(), commit())

    def fused(self, s, config):
        pending = PendingCommit(self.k, self.u, self.g, self.parents, self.cu_nodes, self.accepted, **self.bounds())
        return lambda: verify_packed_triton(
            self.q, self.k, self.v, self.g, self.beta, self.pool, self.slot_sets[s], self.parents, self.cu_nodes,
            o=self.o, u=self.u_next, pending=pending, **config, **self.bounds())


def input_bytes(case):
    per_node = 2 * H * K * 2 + HV * V * 2 + 2 * HV * 4  # q, k, v, g, beta
    return case.nodes * (per_node + HV * V * (2 + 4))  # + o (bf16), u (fp32)


def time_ours(case, dtype_name):
    """Our kernels on one case: times (us), bytes moved and launch configurations per op."""
    sets, B, sb, io = range(case.sets), case.batch, case.state_bytes, input_bytes(case)
    kind = "chain" if case.chain else "tree" if case.max_nodes <= 64 else "large"
    (vcfg, veff), (ccfg, ceff) = launch("verify", kind, dtype_name, B), launch("commit", kind, dtype_name, B)
    fcfg, feff = launch("fused", "fused" if case.chain else kind, dtype_name, B)
    times = {
        "verify": graph_time_us([case.verify(s, vcfg) for s in sets]),
        "commit": graph_time_us([case.commit(s, ccfg) for s in sets]),
        "verify+commit": graph_time_us([case.verify_commit(s, vcfg, ccfg) for s in sets]),
        "verify+commit fused": graph_time_us([case.fused(s, fcfg) for s in sets]),
    }
    moved = {"verify": B * sb + io, "commit": 2 * B * sb, "verify+commit": 3 * B * sb + io,
             "verify+commit fused": 2 * B * sb + io}
    configs = {"verify": veff, "commit": ceff, "verify+commit": [veff, ceff], "verify+commit fused": feff}
    return times, moved, configs


def measure_chain(tokens, batch, dtype_name, records, hbm):
    dtype = STATE_DTYPES[dtype_name]
    parents = DraftTree.from_widths([1] * tokens).parents
    case = Case(parents, True, batch, dtype, store_all_tokens=tokens)
    sets = range(case.sets)
    sb, B = case.state_bytes, batch
    times, moved, configs = time_ours(case, dtype_name)
    # vLLM store_all: one state written per token into its own slot; initial state read from slot [b, 0]
    cu_seqlens = torch.arange(0, (B + 1) * tokens, tokens, dtype=torch.int32, device="cuda")
    num_accepted = torch.ones(B, dtype=torch.int32, device="cuda")
    q4, k4, v4 = case.q[None], case.k[None], case.v[None]
    g4, beta4 = case.g[None], case.beta[None]
    a = torch.randn(case.nodes, HV, device="cuda").bfloat16()
    b = torch.randn(case.nodes, HV, device="cuda").bfloat16()
    a_log, dt_bias = torch.randn(HV, device="cuda") * 0.1, torch.randn(HV, device="cuda") * 0.1

    def store_all_recurrent(s):
        return lambda: fused_recurrent_gated_delta_rule(
            q4, k4, v4, g4, beta4, scale=1.0, initial_state=case.pool, inplace_final_state=True,
            cu_seqlens=cu_seqlens, ssm_state_indices=case.store_all_slots[s], num_accepted_tokens=num_accepted)

    def store_all_sigmoid(s):
        return lambda: fused_sigmoid_gating_delta_rule_update(
            a_log, a, b, dt_bias, q4, k4, v4, initial_state=case.pool, inplace_final_state=True,
            cu_seqlens=cu_seqlens, ssm_state_indices=case.store_all_slots[s], num_accepted_tokens=num_accepted,
            use_qk_l2norm_in_kernel=True)

    times["store_all fused_recurrent"] = graph_time_us([store_all_recurrent(s) for s in sets])
    times["store_all fused_sigmoid_gating"] = graph_time_us([store_all_sigmoid(s) for s in sets])
    io = input_bytes(case)
    moved["store_all fused_recurrent"] = moved["store_all fused_sigmoid_gating"] = (1 + tokens) * B * sb + io
    store_all = times["store_all fused_sigmoid_gating"]
    emit(records, "chain", f"T={tokens}", tokens, B, dtype_name, times, moved, hbm, case, store_all, None, configs)
    del case


def serial_per_node_us(case):
    """The per-node serial baseline of a tree case: every node's state from its parent's, written (store_all's way
    for a tree)."""
    node_states = torch.empty(case.nodes, HV, V, K, dtype=case.pool.dtype, device="cuda")
    return graph_time_us([
        lambda: serial_tree_triton(case.q, case.k, case.v, case.g, case.beta, case.pool, case.slot_sets[0],
                                   case.parents, case.cu_nodes, node_states=node_states, o=case.o)], min_calls=8)


def tree_case(widths, batch, dtype_name):
    """The tree [widths] with its root node (vLLM verifies root + N), `batch` copies."""
    return Case(DraftTree.from_widths(list(widths)).with_root().parents, False, batch, STATE_DTYPES[dtype_name])


def measure_tree(widths, batch, dtype_name, records, hbm):
    case = tree_case(widths, batch, dtype_name)
    sb = case.state_bytes
    times, moved, configs = time_ours(case, dtype_name)
    io = input_bytes(case)
    times["ancestor table (once per step, all layers)"] = graph_time_us([case.ancestor_table])
    moved["ancestor table (once per step, all layers)"] = case.nodes * case.max_depth * 4
    if case.nodes * sb <= SERIAL_NODE_STATE_LIMIT:
        times["serial per-node"] = serial_per_node_us(case)
        moved["serial per-node"] = 2 * case.nodes * sb + io
    emit(records, "tree", str(list(widths)), case.nodes, batch, dtype_name, times, moved, hbm, case, None,
         times.get("serial per-node"), configs)
    del case


def emit(records, kind, shape, nodes, batch, dtype_name, times, moved, hbm, case, store_all, serial, configs):
    bound_us = 2 * batch * case.state_bytes / hbm * 1e6
    for op, us in times.items():
        records.append(dict(
            kind=kind, shape=shape, nodes=nodes, batch=batch, state=dtype_name, op=op, us=round(us, 2),
            eff_TBps=round(moved[op] / (us * 1e-6) / 1e12, 3), hbm_bound_us=round(bound_us, 2),
            x_hbm_bound=round(us / bound_us, 3),
            store_all_over_ours=round(store_all / us, 3) if store_all else None,
            serial_over_ours=round(serial / us, 3) if serial else None,
            slot_sets=case.sets, config=configs.get(op),
        ))
        print(f"{kind:5} {shape:13} B={batch:<4} {dtype_name} {op:31} {us:9.2f} us  "
              f"{moved[op] / (us * 1e-6) / 1e12:5.2f} TB/s  x_bound {us / bound_us:5.2f}"
              + (f"  store_all/ours {store_all / us:5.2f}" if store_all else "")
              + (f"  serial/ours {serial / us:5.2f}" if serial else ""), flush=True)


def tune(records):
    """Fastest verify, fused and commit launch configurations at B=64, chain T=4 and trees [4,2,2] / [4,4,2,2]."""
    for (kind, dtype_name), shape in (
        (("chain", "bf16"), [1] * 4), (("chain", "fp32"), [1] * 4),
        (("tree", "bf16"), [4, 2, 2]), (("tree", "fp32"), [4, 2, 2]),
        (("large", "bf16"), [4, 4, 2, 2]), (("large", "fp32"), [4, 4, 2, 2]),
    ):
        parents = DraftTree.from_widths(shape).parents if kind == "chain" else \
            DraftTree.from_widths(shape).with_root().parents
        case = Case(parents, kind == "chain", 64, STATE_DTYPES[dtype_name])
        sets = range(case.sets)
        if kind == "large":
            candidates = grid((16, 32), (32,), (8, 16), (None,))
        elif kind == "tree":
            candidates = grid((32, 64), (32, 64), (4, 8), (None, 128))
        else:
            candidates = grid((64, 128), (64, 128), (4, 8), (None, 128))
        results = [(timed(lambda: [case.verify(s, c) for s in sets]), c) for c in candidates]
        best = min(results, key=lambda r: r[0])[1]
        config = dict(best, solve="substitution")
        results.append((timed(lambda: [case.verify(s, config) for s in sets]), config))
        records += [dict(tune="verify", kind=kind, state=dtype_name, us=us, config=c) for us, c in results]
        if dtype_name == "fp32":  # reported, not chosen: tf32x3 trades fp32 accuracy (~1e-6) for ~1e-5
            config = dict(best, precision="tf32x3")
            records.append(dict(tune="verify", kind=kind, state=dtype_name, config=config,
                                us=timed(lambda: [case.verify(s, config) for s in sets])))
        fastest_us, TUNED["verify", kind, dtype_name] = min(results, key=lambda r: r[0])
        print(f"tune verify {kind} {dtype_name}: {TUNED['verify', kind, dtype_name]} {fastest_us:.2f} us", flush=True)
        if kind == "chain":
            for op, make, candidates in (
                ("fused", case.fused, grid((32, 64), (64, 128), (4, 8), (None, 128))),
                ("commit", case.commit, grid((64, 128), (64, 128), (4, 8), (None, 128))),
            ):
                results = [(timed(lambda: [make(s, c) for s in sets]), c) for c in candidates]
                records += [dict(tune=op, kind=kind, state=dtype_name, us=us, config=c) for us, c in results]
                key = (op, "fused" if op == "fused" else kind, dtype_name)
                fastest_us, TUNED[key] = min(results, key=lambda r: r[0])
                print(f"tune {op} {dtype_name}: {TUNED[key]} {fastest_us:.2f} us", flush=True)
        del case


def grid(block_v, block_k, num_warps, max_registers):
    return [dict(block_v=bv, block_k=bk, num_warps=w, max_registers=r)
            for bv in block_v for bk in block_k for w in num_warps for r in max_registers]


def timed(make_calls):
    try:
        return graph_time_us(make_calls())
    except Exception as error:  # a configuration that does not compile or launch is simply not a candidate
        print(f"  skipped: {type(error).__name__}: {str(error)[:120]}", flush=True)
        return float("inf")


def markdown(records, facts, hbm, command):
    lines = [
        f"# GDN kernel benchmark ({facts['name']})", "",
        f"Command: `{command}`", "",
        f"Device: {facts['name']}, {facts['sms']} SMs, L2 {facts['l2_bytes']} B, nvidia-smi `{facts['nvidia_smi']}`; "
        f"torch {facts['torch']}, triton {facts['triton']}, CUDA {facts['cuda']}.",
        f"Copy bandwidth (read + write) measured in this run: {hbm / 1e12:.2f} TB/s.", "",
        "Per GDN layer, H=16, HV=32, K=V=128; bf16 q/k/v, fp32 g/beta. Times: median over CUDA-graph replays, state "
        "slots cycled over 256 MiB. `x bound`: time over the HBM bound (one state read + one write per request). "
        "`store_all/ours`: vLLM's `fused_sigmoid_gating_delta_rule_update` (store_all, Triton path) time over ours. "
        "`serial/ours`: per-node serial tree kernel time over ours.", "",
        "| kind | shape | B | state | op | us | TB/s | x bound | store_all/ours | serial/ours |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in records:
        if "op" not in r:
            continue
        lines.append(
            f"| {r['kind']} | {r['shape']} | {r['batch']} | {r['state']} | {r['op']} | {r['us']} | {r['eff_TBps']} | "
            f"{r['x_hbm_bound']} | {r['store_all_over_ours'] or ''} | {r['serial_over_ours'] or ''} |")
    return "\n".join(lines) + "\n"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(ROOT / "bench" / "results"))
    parser.add_argument("--tune", action="store_true", help="pick launch configurations by measurement first")
    parser.add_argument("--batches", type=int, nargs="*", default=list(BATCHES))
    parser.add_argument("--chains", type=int, nargs="*", default=list(CHAINS))
    parser.add_argument("--trees", nargs="*", default=[",".join(map(str, t)) for t in TREES])
    parser.add_argument("--states", nargs="*", default=list(STATE_DTYPES))
    parser.add_argument("--name", default="kernels")
    args = parser.parse_args()
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    command = "python3 bench/kernels.py " + " ".join(sys.argv[1:])
    started = time.time()
    torch.backends.cuda.matmul.allow_tf32 = False
    facts = device_facts()
    hbm = copy_bandwidth()
    print(json.dumps(facts), f"\ncopy bandwidth {hbm / 1e12:.3f} TB/s", flush=True)
    records = []

    def save():  # after every case, so a run cut short still leaves its results
        result = dict(command=command, device=facts, copy_bandwidth_Bps=hbm, seconds=round(time.time() - started, 1),
                      tuned={"/".join(k): v for k, v in TUNED.items()}, records=records)
        (out / f"{args.name}.json").write_text(json.dumps(result, indent=1))
        (out / f"{args.name}.md").write_text(markdown(records, facts, hbm, command))

    with torch.inference_mode():
        if args.tune:
            tune(records)
        for dtype_name in args.states:
            for batch in args.batches:
                for tokens in args.chains:
                    measure_chain(tokens, batch, dtype_name, records, hbm)
                    torch.cuda.empty_cache()
                    save()
                for widths in args.trees:
                    measure_tree(tuple(int(w) for w in widths.split(",")), batch, dtype_name, records, hbm)
                    torch.cuda.empty_cache()
                    save()
    save()
    print(f"done in {time.time() - started:.0f} s -> {out}/{args.name}.json, .md")


if __name__ == "__main__":
    main()
