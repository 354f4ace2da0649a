"""Compile the gated GDN step kernel for sm_90 without a GPU (Triton's offline compiler + its bundled ptxas) and
report what decides its speed: registers, spills/stack, shared memory, layout conversions in the loop (TTGIR), and
the SASS instruction mix (FFMA, shuffles, shared-memory traffic, global load/store widths).

    python3 bench/compile_report.py [--dump DIR]
    python3 bench/compile_report.py --conv-block-nodes 16 4      # the conv step kernel instead, per node block
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

from vllm_treewy.kernels.triton.conv import _conv_step_kernel  # noqa: E402
from vllm_treewy.kernels.triton.gated import _gated_step_kernel, _nodes_block  # noqa: E402

BIN = pathlib.Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
PTR_TYPES = {"qkv": "*bf16", "a": "*bf16", "b": "*bf16", "A_log": "*fp32", "dt_bias": "*fp32", "z": "*bf16",
             "norm_weight": "*bf16", "state_indices": "*i32", "ancestors": "*i32", "cu_nodes": "*i32",
             "out": "*bf16", "factors": "*fp32", "pending_nodes": "*i32", "pending_ancestors": "*i32"}
FLOATS = ("scale", "eps")


def compile_variant(state_dtype, tokens, num_warps, pending=True, verify=True, maxnreg=None, **variant):
    """`variant`: the kernel's launch constexprs beyond the shape ones (BK, PREFETCH, ROW_SUMS, ...; G, value heads
    per program, defaults to 1; STATE_PRODUCTS to "tf32" for bf16 states, "tf32x3" for fp32: `_state_products`)."""
    names = _gated_step_kernel.arg_names
    const = dict(H=16, HV=32, K=128, V=128, PENDING_ROWS=tokens, PENDING_IS_CHAIN=True,
                 MAX_ANC=tokens - 1, IS_CHAIN=True, ACT="silu",
                 DO_VERIFY=verify, HAS_PENDING=pending,
                 G=1, SPLIT_IN_MMA_LAYOUT=False, LAGGED_PRODUCTS=False, STATE_TMA=False, EPILOGUE_IN_MMA_LAYOUT=False,
                 SOLVE_BY_DOTS=False, DOT_PRECISION="tf32" if state_dtype == "bf16" else "tf32x3",
                 STATE_PRODUCTS="tf32" if state_dtype == "bf16" else "tf32x3")  # q/k/v are bf16 here
    const.update(variant)
    # as the launcher pads it (`_nodes_block`), unless the variant names it
    epilogue = const["EPILOGUE_IN_MMA_LAYOUT"] and const.get("STATE_DOT", False)
    const.setdefault("BT", _nodes_block(tokens, epilogue, epilogue and const["SOLVE_BY_DOTS"]))
    sig = {}
    for name in names:
        if name in const:
            sig[name] = "constexpr"
        elif name in FLOATS:
            sig[name] = "fp32"
        elif name.startswith("stride"):
            sig[name] = "i64"
        else:
            sig[name] = PTR_TYPES.get(name, "*fp32")
    sig["state"] = "*fp32" if state_dtype == "fp32" else "*bf16"
    # STATE_TMA: a host-side descriptor over the pool, block [1, 1, V, BK]; else the state pointer again (unused)
    sig["state_desc"] = (f"tensordesc<{state_dtype}[1, 1, {const['V']}, {const['BK']}]>" if const["STATE_TMA"]
                         else sig["state"])
    options = dict(num_warps=num_warps, num_stages=1)
    if maxnreg:
        options["maxnreg"] = maxnreg
    # what the JIT's specialisation gives at run time: pointers and the (multiple-of-16) strides divisible by 16
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
             if sig[n] != "constexpr" and n not in FLOATS and not sig[n].startswith("tensordesc")}
    return triton.compile(ASTSource(fn=_gated_step_kernel, signature=sig, constexprs=const, attrs=attrs),
                          target=GPUTarget("cuda", 90, 32), options=options)


def compile_conv(block_nodes, block_d=256, num_warps=4):
    """The conv step of a bf16 model (Qwen3.5: width 4, silu, no bias) with a pending chain commit."""
    names = _conv_step_kernel.arg_names
    const = dict(W=4, L=3, BL=4, BN=block_nodes, BD=block_d, HAS_BIAS=False, SILU=True, HAS_PENDING=True,
                 PENDING_DEPTH=1, PENDING_IS_CHAIN=True, ROUND_PRODUCTS=True)
    int_arrays = ("state_indices", "parents", "cu_nodes", "pending_nodes", "pending_ancestors")
    sig = {n: "constexpr" if n in const else "i64" if n.startswith("stride") or n == "D" else
           "*i32" if n in int_arrays else "*bf16" for n in names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if sig[n] != "constexpr"}
    return triton.compile(ASTSource(fn=_conv_step_kernel, signature=sig, constexprs=const, attrs=attrs),
                          target=GPUTarget("cuda", 90, 32), options=dict(num_warps=num_warps, num_stages=1))


def cuobjdump(compiled, flag):
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        return subprocess.run([str(BIN / "cuobjdump"), flag, f.name], capture_output=True, text=True).stdout


def analyse(compiled):
    usage = cuobjdump(compiled, "--dump-resource-usage")
    sass = cuobjdump(compiled, "--dump-sass")
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
            "STG.E.128", "STG.E.64", "STG.E", "LDL", "STL", "MUFU.EX2", "HMMA", "HGMMA")
    mix = {k: sum(v for op, v in ops.items() if op == k or op.startswith(k + ".") and k in ("STS", "LDS", "HMMA", "HGMMA"))
           for k in keys}
    loop_ir = _state_loop_ttgir(ttgir)
    return dict(regs=int(regs.group(1)) if regs else None, stack=int(stack.group(1)) if stack else None,
                shared=int(shared.group(1)) if shared else None, dynamic_shared=compiled.metadata.shared,
                local=int(local.group(1)) if local else None,
                convert_layout=ttgir.count("ttg.convert_layout"), local_alloc=ttgir.count("ttg.local_alloc"),
                sass_total=sum(ops.values()), mix=mix,
                loop=dict(convert_layout=loop_ir.count("ttg.convert_layout"),
                          local_alloc=loop_ir.count("ttg.local_alloc"), local_load=loop_ir.count("ttg.local_load"),
                          sass=_state_loop_sass_mix(sass)))


def _state_loop_ttgir(ttgir):
    """The body of the largest scf.for (the state loop: the others are the solve's short one and unrolled ones)."""
    lines = ttgir.splitlines()
    bodies = []
    for start, line in enumerate(lines):
        if "scf.for" in line:
            depth = 0
            for end in range(start, len(lines)):
                depth += lines[end].count("{") - lines[end].count("}")
                if depth <= 0 and end > start:
                    break
            bodies.append("\n".join(lines[start:end + 1]))
    return max(bodies, key=len, default="")


def _state_loop_sass_mix(sass):
    """Shared-memory, global and tensor-core instructions between the target and the source of the largest
    backward branch (the state loop), per thread and iteration."""
    ins = []
    for line in sass.splitlines():
        m = re.match(r"\s+/\*([0-9a-f]+)\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]+)(.*)", line)
        if m:
            ins.append((int(m.group(1), 16), m.group(2), m.group(3)))
    loops = [(int(t.group(1), 16), addr) for addr, op, rest in ins if op.startswith("BRA")
             for t in [re.search(r"0x([0-9a-f]+)", rest)] if t and int(t.group(1), 16) < addr]
    if not loops:
        return {}
    first, last = max(loops, key=lambda loop: loop[1] - loop[0])
    ops = collections.Counter(op for addr, op, _ in ins if first <= addr <= last)
    prefixes = ("STS", "LDS", "STSM", "LDSM", "SHFL", "LDG", "STG", "HGMMA", "BAR", "MEMBAR")
    mix = {op: n for op, n in sorted(ops.items()) if op.startswith(prefixes)}
    return dict(total=sum(ops.values()), **mix)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dump")
    parser.add_argument("--states", nargs="*", default=["fp32", "bf16"])
    parser.add_argument("--tokens", type=int, nargs="*", default=[4])
    parser.add_argument("--warps", type=int, nargs="*", default=[4])
    parser.add_argument("--modes", nargs="*", default=["fused", "verify", "commit"])
    parser.add_argument("--maxnreg", type=int, nargs="*", default=[0])
    parser.add_argument("--variant", type=json.loads, nargs="*", default=[dict(BK=8, PREFETCH=2)],
                        help='constexpr sets as JSON, e.g. \'{"BK": 8, "PREFETCH": 2, "ROW_SUMS": true}\'')
    parser.add_argument("--conv-block-nodes", type=int, nargs="*", default=None)
    args = parser.parse_args()
    if args.conv_block_nodes:
        for block_nodes in args.conv_block_nodes:
            print(json.dumps(dict(kernel="conv_step", block_nodes=block_nodes, **analyse(compile_conv(block_nodes)))))
        return
    for state in args.states:
        for tokens in args.tokens:
            for mode in args.modes:
                for variant in args.variant:
                    for w, mr in [(w, mr) for w in args.warps for mr in args.maxnreg]:
                        c = compile_variant(state, tokens, w, pending=mode != "verify", verify=mode != "commit",
                                            maxnreg=mr, **variant)
                        r = dict(state=state, tokens=tokens, mode=mode, num_warps=w, maxnreg=mr, **variant,
                                 **analyse(c))
                        print(json.dumps(r), flush=True)
                        if args.dump:
                            d = pathlib.Path(args.dump)
                            d.mkdir(parents=True, exist_ok=True)
                            stem = f"{state}_T{tokens}_{mode}_w{w}_" + "_".join(f"{k}{v}" for k, v in variant.items())
                            (d / f"{stem}.ttgir").write_text(c.asm["ttgir"])
                            (d / f"{stem}.ptx").write_text(c.asm["ptx"])
                            (d / f"{stem}.sass").write_text(cuobjdump(c, "--dump-sass"))


if __name__ == "__main__":
    main()
