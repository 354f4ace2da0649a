"""Compile the gated GDN step kernel for sm_90 without a GPU (Triton's offline compiler + its bundled ptxas) and
report what decides its speed: registers, spills/stack, shared memory, layout conversions in the loop (TTGIR), and
the SASS instruction mix (FFMA, shuffles, shared-memory traffic, global load/store widths).

    python3 bench/compile_report.py [--dump DIR]
"""

import argparse
import collections
import json
import pathlib
import re
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from vllm_treewy.kernels.triton.gated import _gated_step_kernel  # noqa: E402

BIN = pathlib.Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
PTRS = ["qkv", "a", "b", "A_log", "dt_bias", "z", "norm_weight", "state", "state_indices", "ancestors", "cu_nodes",
        "out", "f_k", "f_kscale", "f_u", "f_g", "p_k", "p_kscale", "p_u", "p_g", "p_ancestors", "p_cu_nodes",
        "p_accepted"]
PTR_TYPES = {"qkv": "*bf16", "a": "*bf16", "b": "*bf16", "A_log": "*fp32", "dt_bias": "*fp32", "z": "*bf16",
             "norm_weight": "*bf16", "state_indices": "*i32", "ancestors": "*i32", "cu_nodes": "*i32",
             "out": "*bf16", "f_k": "*bf16", "f_kscale": "*fp32", "f_u": "*fp32", "f_g": "*fp32",
             "p_k": "*bf16", "p_kscale": "*fp32", "p_u": "*fp32", "p_g": "*fp32", "p_ancestors": "*i32",
             "p_cu_nodes": "*i32", "p_accepted": "*i32"}
INTS = ["stride_qkv", "stride_a", "stride_b", "stride_z", "stride_zh", "stride_out", "stride_outh", "stride_slot",
        "stride_head", "stride_v"]


def compile_variant(state_dtype, tokens, block_k, num_warps, pending=True, verify=True, maxnreg=None, prefetch=4,
                    row_sums=False, late=False):
    sig = {name: PTR_TYPES.get(name, "*fp32") for name in PTRS}
    sig["state"] = "*fp32" if state_dtype == "fp32" else "*bf16"
    sig.update({name: "i64" for name in INTS})
    sig.update(scale="fp32", eps="fp32")
    const = dict(H=16, HV=32, K=128, V=128, BT=max(2, triton.next_power_of_2(tokens)), BK=block_k, PREFETCH=prefetch, ROW_SUMS=row_sums, LATE_NODE_TERMS=late,
                 MAX_ANC=tokens - 1, IS_CHAIN=True, ACT="silu", DO_VERIFY=verify, HAS_PENDING=pending,
                 P_BP=max(2, triton.next_power_of_2(tokens)), P_MAX_ANC=tokens - 1, P_IS_CHAIN=True)
    for name in const:
        sig[name] = "constexpr"
    options = dict(num_warps=num_warps, num_stages=1)
    if maxnreg:
        options["maxnreg"] = maxnreg
    # what the JIT's specialisation gives at run time: pointers and the (multiple-of-16) strides divisible by 16
    names = _gated_step_kernel.arg_names
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in PTRS + INTS}
    return triton.compile(ASTSource(fn=_gated_step_kernel, signature=sig, constexprs=const, attrs=attrs),
                          target=GPUTarget("cuda", 90, 32), options=options)


def analyse(compiled):
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        usage = subprocess.run([str(BIN / "cuobjdump"), "--dump-resource-usage", f.name], capture_output=True,
                               text=True).stdout
        sass = subprocess.run([str(BIN / "cuobjdump"), "--dump-sass", f.name], capture_output=True, text=True).stdout
    regs = re.search(r"REG:(\d+)", usage)
    stack = re.search(r"STACK:(\d+)", usage)
    shared = re.search(r"SHARED:(\d+)", usage)
    local = re.search(r"LOCAL:(\d+)", usage)
    ops = collections.Counter()
    for line in sass.splitlines():
        m = re.match(r"\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]+)", line)
        if m:
            ops[m.group(1)] += 1
    ttgir = compiled.asm["ttgir"]
    keys = ("FFMA", "FMUL", "FADD", "SHFL.BFLY", "STS", "LDS", "BAR.SYNC", "LDG.E.128", "LDG.E.64", "LDG.E",
            "STG.E.128", "STG.E.64", "STG.E", "LDL", "STL", "MUFU.EX2", "HMMA")
    mix = {k: sum(v for op, v in ops.items() if op == k or op.startswith(k + ".") and k in ("STS", "LDS"))
           for k in keys}
    return dict(regs=int(regs.group(1)) if regs else None, stack=int(stack.group(1)) if stack else None,
                shared=int(shared.group(1)) if shared else None, local=int(local.group(1)) if local else None,
                convert_layout=ttgir.count("ttg.convert_layout"), local_alloc=ttgir.count("ttg.local_alloc"),
                sass_total=sum(ops.values()), mix=mix)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dump")
    parser.add_argument("--states", nargs="*", default=["fp32", "bf16"])
    parser.add_argument("--tokens", type=int, nargs="*", default=[4])
    parser.add_argument("--block-k", type=int, nargs="*", default=[16, 32, 64])
    parser.add_argument("--warps", type=int, nargs="*", default=[4, 8])
    parser.add_argument("--modes", nargs="*", default=["fused", "verify", "commit"])
    parser.add_argument("--prefetch", type=int, nargs="*", default=[4])
    parser.add_argument("--maxnreg", type=int, nargs="*", default=[0])
    parser.add_argument("--row-sums", action="store_true")
    parser.add_argument("--late", action="store_true", help="node terms after the state loop")
    args = parser.parse_args()
    results = []
    for state in args.states:
        for tokens in args.tokens:
            for mode in args.modes:
                for bk in args.block_k:
                    for w, pf, mr in [(w, pf, mr) for w in args.warps for pf in args.prefetch for mr in args.maxnreg]:
                        c = compile_variant(state, tokens, bk, w, pending=mode != "verify", verify=mode != "commit",
                                            prefetch=pf, maxnreg=mr, row_sums=args.row_sums, late=args.late)
                        r = dict(state=state, tokens=tokens, mode=mode, block_k=bk, num_warps=w, prefetch=pf, maxnreg=mr,
                                 row_sums=args.row_sums, late=args.late,
                                 **analyse(c))
                        results.append(r)
                        print(json.dumps(r), flush=True)
                        if args.dump:
                            d = pathlib.Path(args.dump)
                            d.mkdir(parents=True, exist_ok=True)
                            stem = f"{state}_T{tokens}_{mode}_bk{bk}_w{w}_p{pf}"
                            (d / f"{stem}.ttgir").write_text(c.asm["ttgir"])
                            (d / f"{stem}.ptx").write_text(c.asm["ptx"])


if __name__ == "__main__":
    main()
