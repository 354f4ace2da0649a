"""Launch-configuration sweep of our verify, fused verify+commit and commit kernels on CUDA (bf16 state, H=16, HV=32,
K=V=128), the measurements behind the wrappers' VERIFY_CONFIGS / COMMIT_CONFIGS and their small-batch tables.

    python3 bench/launch_sweep.py wide small --out bench/results

wide: B=64 chain T=4 over tiles x ptxas register caps (then the two fastest again at B=256), trees [4,2,2] and
[4,4,2,2] at B=64; small: narrow against wide tiles at B=1, 8, 16. Timing as in bench/kernels.py.
"""

import argparse
import itertools
import json
import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from bench.kernels import STATE_DTYPES, Case, graph_time_us  # noqa: E402

from vllm_treewy.tree import DraftTree  # noqa: E402

OPS = ("verify", "fused", "commit")


def make_case(shape, batch, dtype_name):
    if isinstance(shape, int):
        return Case(DraftTree.from_widths([1] * shape).parents, True, batch, STATE_DTYPES[dtype_name])
    return Case(DraftTree.from_widths(list(shape)).with_root().parents, False, batch, STATE_DTYPES[dtype_name])


def configs(block_v, block_k, num_warps, max_registers):
    return [dict(block_v=bv, block_k=bk, num_warps=w, max_registers=r)
            for bv, bk, w, r in itertools.product(block_v, block_k, num_warps, max_registers)]


def sweep(records, shape, batch, op, candidates, dtype_name="bf16"):
    """Time every candidate of one op on one case; a candidate that does not compile or launch is reported, skipped."""
    case = make_case(shape, batch, dtype_name)
    make = {"verify": case.verify, "fused": case.fused, "commit": case.commit}[op]
    found = []
    for config in candidates:
        try:
            us = graph_time_us([make(s, config) for s in range(case.sets)])
        except Exception as error:
            print(f"skipped {config}: {type(error).__name__}: {str(error)[:100]}", flush=True)
            continue
        moved = (1 if op == "verify" else 2) * batch * case.state_bytes
        found.append(dict(shape=str(shape), batch=batch, state=dtype_name, op=op, **config, us=round(us, 2),
                          state_TBps=round(moved / us / 1e6, 3)))
        print(found[-1], flush=True)
    records += found
    del case
    torch.cuda.empty_cache()
    return sorted(found, key=lambda r: r["us"])


def launch_keys(record):
    return {k: record[k] for k in ("block_v", "block_k", "num_warps", "max_registers")}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("modes", nargs="+", choices=("wide", "small"))
    parser.add_argument("--out", default=str(pathlib.Path(__file__).resolve().parent / "results"))
    args = parser.parse_args()
    records = []
    caps = (None, 128, 96)
    with torch.inference_mode():
        if "wide" in args.modes:
            tiles = {"verify": ((64, 128), (64, 128)), "fused": ((32, 64), (64, 128)), "commit": ((64, 128), (64, 128))}
            for op in OPS:
                block_v, block_k = tiles[op]
                best = sweep(records, 4, 64, op, configs(block_v, block_k, (4,), caps)
                             + configs(block_v[-1:], (128,), (8,), (None,)))
                sweep(records, 4, 256, op, [launch_keys(r) for r in best[:2]])
            sweep(records, (4, 2, 2), 64, "verify", configs((32, 64), (32, 64), (4,), (None, 128))
                  + configs((32, 64), (64,), (8,), (None,)))
            sweep(records, (4, 4, 2, 2), 64, "verify", configs((16, 32), (32,), (8,), (None, 128)))
        if "small" in args.modes:
            for op in OPS:
                sweep(records, 4, 1, op, configs((16, 32, 64), (128,), (2, 4), (None,)))
            narrow = dict(block_k=128, num_warps=4, max_registers=None)
            wide = {"verify": dict(block_v=128, block_k=128, num_warps=4, max_registers=128),
                    "fused": dict(block_v=64, block_k=128, num_warps=4, max_registers=128),
                    "commit": dict(block_v=128, block_k=64, num_warps=4, max_registers=128)}
            for op in OPS:
                for batch in (8, 16):
                    sweep(records, 4, batch, op, [dict(narrow, block_v=16 if op == "commit" else 32), wide[op]])
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "launch_sweep.json").write_text(json.dumps(dict(command="python3 bench/launch_sweep.py " + " ".join(
        sys.argv[1:]), records=records), indent=1))


if __name__ == "__main__":
    main()
