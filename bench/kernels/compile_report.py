"""Compile the GDN step's production launches for sm_90 without a GPU (Triton's offline compiler and its bundled
ptxas) and report what decides their speed: registers, spills, shared memory, the SASS instruction mix, and a hash
of the SASS instructions (equal hashes: the same machine code, whatever the source looks like).

    python3 bench/kernels/compile_report.py [--states fp32 bf16] [--tokens 2 4 8] [--batches 1 64 256] [--trees 2,2,1]
    python3 bench/kernels/compile_report.py --dump DIR        # also each launch's TTGIR, PTX and SASS

Each row is the step as `gdn_step_triton` launches it for a batch of chains (or trees) at Qwen3.5 GDN dims
(H=16, HV=32, K=V=128, bf16 q/k/v), with the previous step's commit, at the launch table's launch: the arguments
come from `step_launches` (CPU tensors: nothing runs) and are bound by Triton's own binder, so the specialisation
is the one the GPU sees.
"""

import argparse
import collections
import hashlib
import json
import pathlib
import re
import subprocess
import sys
import tempfile

import torch
import triton
from triton import knobs
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.compiler.compiler import make_backend
from triton.runtime.jit import create_function_from_signature

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from vllm_treewy.kernels.factor_rows import slot_factor_width  # noqa: E402
from vllm_treewy.kernels.ancestor_table_torch import ancestor_table_torch  # noqa: E402
from vllm_treewy.kernels.gdn_step_triton.step import step_launches  # noqa: E402
from vllm_treewy.tree import DraftTree, pack_trees  # noqa: E402

BIN = pathlib.Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
TARGET = GPUTarget("cuda", 90, 32)
H, HV, K, V = 16, 32, 128, 128
STATE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def compile_launch(kernel, args, kwargs):
    """One launch compiled for sm_90 as `kernel[grid](*args, **kwargs)` would compile it on an H200 (the same
    options and cache key as the JIT's: the result lands in Triton's cache, `TRITON_CACHE_DIR`, where the GPU's
    run finds it)."""
    kwargs = dict(kwargs, debug=kwargs.get("debug", kernel.debug) or knobs.runtime.debug,
                  instrumentation_mode=knobs.compilation.instrumentation_mode)
    backend = make_backend(TARGET)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound_args, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound_args, specialization, options)
    return triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=TARGET,
                          options=options.__dict__)


def step_case(state_dtype, tokens, batch, widths=None, mode="fused"):
    """`step_launches`' launches for `batch` requests of a chain of `tokens` nodes (or the tree `widths` with its root):
    mode "fused" commits the previous step's last node in the step, "verify" has nothing to commit, "commit" is
    that commit alone (`gdn_commit_triton`)."""
    tree = DraftTree.from_widths(widths).with_root() if widths else DraftTree.from_widths([1] * tokens)
    chain, nodes = not widths, tree.num_nodes
    packed = pack_trees([tree] * batch)
    n = packed.num_nodes
    slots = 4  # the pool's size does not reach the launch's specialisation
    mixed_qkv = torch.zeros(n, 2 * H * K + HV * V, dtype=torch.bfloat16)
    a, b = torch.zeros(n, HV, dtype=torch.bfloat16), torch.zeros(n, HV, dtype=torch.bfloat16)
    A_log, dt_bias = torch.zeros(HV), torch.zeros(HV, dtype=torch.bfloat16)
    z = torch.zeros(n, HV, V, dtype=torch.bfloat16)
    norm_weight = torch.zeros(V, dtype=torch.bfloat16)
    state = torch.zeros(slots, HV, V, K, dtype=state_dtype)
    factors = torch.zeros(slots, nodes, slot_factor_width(HV, K, V))
    state_indices = torch.zeros(batch, dtype=torch.int32)
    commit_nodes = torch.full((batch,), nodes - 1, dtype=torch.int32)
    ancestors = commit_ancestors = None
    if not chain:
        ancestors = ancestor_table_torch(packed.parents, packed.cu_nodes, packed.max_depth)
        one = pack_trees([tree])
        commit_ancestors = ancestor_table_torch(one.parents, one.cu_nodes, one.max_depth)
    out = torch.zeros(n, HV, V, dtype=torch.bfloat16)
    if mode == "commit":
        return step_launches(None, None, None, None, None, None, None, state, state_indices, None, factors,
                             commit_nodes, commit_ancestors, num_key_heads=H, max_nodes=1, scale=None, norm_eps=0.0,
                             activation="silu", ancestors=None, out=None, launch=None)[0]
    if mode == "verify":
        commit_nodes = commit_ancestors = None
    launches, _ = step_launches(
        mixed_qkv, a, b, A_log, dt_bias, z, norm_weight, state, state_indices, packed.cu_nodes, factors,
        commit_nodes, commit_ancestors, num_key_heads=H, max_nodes=nodes, scale=None, norm_eps=1e-6,
        activation="silu", ancestors=ancestors, out=out, launch=None)
    return launches


def cuobjdump(compiled, flag):
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        return subprocess.run([str(BIN / "cuobjdump"), flag, f.name], capture_output=True, text=True).stdout


def analyse(compiled):
    usage = cuobjdump(compiled, "--dump-resource-usage")
    sass = cuobjdump(compiled, "--dump-sass")
    instructions = []
    for line in sass.splitlines():
        m = re.match(r"\s+/\*[0-9a-f]+\*/\s+(.*?);", line)
        if m:
            instructions.append(m.group(1).strip())
    ops = collections.Counter(re.match(r"(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", i).group(1) for i in instructions)
    field = {name: re.search(name + r":(\d+)", usage) for name in ("REG", "STACK", "SHARED", "LOCAL")}
    keys = ("FFMA", "SHFL.BFLY", "LDG.E", "LDG.E.128", "STG.E", "STG.E.128", "LDS", "STS", "BAR.SYNC", "HMMA",
            "HGMMA", "LDL", "STL")
    return dict(**{k.lower(): int(m.group(1)) if m else None for k, m in field.items()},
                sass_total=len(instructions),
                sass_sha=hashlib.sha256("\n".join(instructions).encode()).hexdigest()[:16],
                mix={k: sum(v for op, v in ops.items() if op == k or op.startswith(k + ".")) for k in keys})


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dump")
    parser.add_argument("--states", nargs="*", default=["fp32", "bf16"])
    parser.add_argument("--tokens", type=int, nargs="*", default=[2, 4, 8])
    parser.add_argument("--batches", type=int, nargs="*", default=[1, 64, 256])
    parser.add_argument("--trees", nargs="*", default=["2,2,1", "4,2,2"])
    parser.add_argument("--tree-batches", type=int, nargs="*", default=[64])
    parser.add_argument("--modes", nargs="*", default=["fused"],
                        help="fused: with the previous step's commit; verify: nothing to commit; commit: alone")
    args = parser.parse_args()
    cases = [(state, T, B, None) for state in args.states for T in args.tokens for B in args.batches]
    cases += [(state, None, B, [int(w) for w in widths.split(",")]) for state in args.states
              for widths in args.trees for B in args.tree_batches]
    for (state, T, B, widths), mode in [(case, mode) for case in cases for mode in args.modes]:
        for kernel, grid, kernel_args, kernel_kwargs in step_case(STATE_DTYPES[state], T, B, widths, mode):
            compiled = compile_launch(kernel, kernel_args, kernel_kwargs)
            row = dict(state=state, T=T, B=B, tree=widths, mode=mode, kernel=kernel.fn.__name__, grid=list(grid),
                       num_warps=kernel_kwargs.get("num_warps"), **analyse(compiled))
            print(json.dumps(row), flush=True)
            if args.dump:
                d = pathlib.Path(args.dump)
                d.mkdir(parents=True, exist_ok=True)
                stem = f"{state}_{'T%d' % T if T else 'tree' + ''.join(map(str, widths))}_B{B}_{mode}_{kernel.fn.__name__}"
                (d / f"{stem}.ttgir").write_text(compiled.asm["ttgir"])
                (d / f"{stem}.ptx").write_text(compiled.asm["ptx"])
                (d / f"{stem}.sass").write_text(cuobjdump(compiled, "--dump-sass"))


if __name__ == "__main__":
    main()
