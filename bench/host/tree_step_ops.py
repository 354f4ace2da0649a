"""Device ops and host time per engine step in the MTP draft tree's own host phases, on vLLM's CPU backend: the tree
sampling (`sample_with_trees`) and the drafting levels outside the head's forward (`_forward_level` with
`_run_head` not counted: on CUDA the head runs in vLLM's graphs).

The drafting levels' blocks that every level shares (`_level_blocks`, once per step) are counted apart where they
exist. One engine (the fixture's blurred-MTP variant, reconstruct, `--widths`, eager) generates `--max-tokens`
tokens for `--batch` prompts per sampling setting after a warm-up, twice: once under `step_ops.StepOps` (aten ops
that would launch device work, views and allocations excluded; host syncs named), once timed with `perf_counter`
around the same calls (no dispatch mode). Settings: `greedy`; `t0.8-p0.95` (temperature 0.8, top-p 0.95,
unseeded: the batch needs no path on the host); `seeded` (the same with a seed per request: the level-by-level
path).

    python bench/host/tree_step_ops.py --batch 1 --max-tokens 32 [--widths 2 2 1]

On CPU an op's cost is its compute, not a launch: the host ms here say little about the H200, the op counts do
(`bench/results/mtp_tree_host_profile/`: 15-40 us of host time per op outside the graphs there).
"""

from __future__ import annotations

import argparse
import collections
import tempfile
import time
from pathlib import Path

from torch.utils._python_dispatch import _disable_current_modes

from bench.host.step_ops import StepOps

PHASES = {"sampling": "tree sampling (sample_with_trees)", "level": "drafting level outside the head",
          "blocks": "drafting levels' shared blocks"}  # the last: TreeMtpProposer._level_blocks, where it exists


class Timed:
    """Host seconds and calls per phase."""

    def __init__(self):
        self.seconds = collections.Counter()
        self.calls = collections.Counter()

    def timing(self, function, what: str):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                self.seconds[what] += time.perf_counter() - start
                self.calls[what] += 1

        return timed


def _params(setting: str, max_tokens: int, index: int):
    from vllm import SamplingParams

    if setting == "greedy":
        return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False)
    seed = 1000 + index if setting == "seeded" else None
    return SamplingParams(temperature=0.8, top_p=0.95, seed=seed, max_tokens=max_tokens, ignore_eos=True,
                          detokenize=False)


def measure(args) -> dict:
    from transformers import AutoTokenizer

    from vllm_treewy.fixture import blurred_mtp_variant, build_fixture, fixture_prompts
    from vllm_treewy.vllm_plugin.v1 import runner as tree_runner
    from vllm_treewy.vllm_plugin.v1.proposer import TreeMtpProposer
    from vllm_treewy.vllm_plugin.testing.equivalence import engine

    root = Path(tempfile.mkdtemp())
    model = str(blurred_mtp_variant(build_fixture(root / "fixture"), root / "blurred"))
    prompts = [{"prompt_token_ids": p} for p in fixture_prompts(AutoTokenizer.from_pretrained(model), args.batch)]
    spec = {"method": "mtp", "num_speculative_tokens": len(args.widths), "draft_tree_widths": args.widths,
            "mamba_state_commit": "reconstruct"}
    originals = {"sampling": tree_runner.sample_with_trees, "level": TreeMtpProposer._forward_level,
                 "head": TreeMtpProposer._run_head, "blocks": getattr(TreeMtpProposer, "_level_blocks", None)}

    def head_uncounted(self, kwargs):
        with _disable_current_modes():
            return originals["head"](self, kwargs)

    results = {}
    try:
        TreeMtpProposer._run_head = head_uncounted
        with engine(model, speculative_config=spec, max_num_seqs=args.batch) as llm:
            for setting in ("greedy", "t0.8-p0.95", "seeded"):
                params = [_params(setting, args.max_tokens, i) for i in range(args.batch)]
                llm.generate(prompts, [_params(setting, 8, i) for i in range(args.batch)], use_tqdm=False)  # warm-up
                ops = StepOps(tuple(PHASES))
                tree_runner.sample_with_trees = ops.counting(originals["sampling"], "sampling")
                TreeMtpProposer._forward_level = ops.counting(originals["level"], "level")
                if originals["blocks"] is not None:
                    TreeMtpProposer._level_blocks = ops.counting(originals["blocks"], "blocks")
                llm.generate(prompts, params, use_tqdm=False)
                timed = Timed()
                tree_runner.sample_with_trees = timed.timing(originals["sampling"], "sampling")
                TreeMtpProposer._forward_level = timed.timing(originals["level"], "level")
                if originals["blocks"] is not None:
                    TreeMtpProposer._level_blocks = timed.timing(originals["blocks"], "blocks")
                for _ in range(args.repeats):
                    llm.generate(prompts, params, use_tqdm=False)
                tree_runner.sample_with_trees = originals["sampling"]
                TreeMtpProposer._forward_level = originals["level"]
                if originals["blocks"] is not None:
                    TreeMtpProposer._level_blocks = originals["blocks"]
                steps = max(ops.calls["sampling"], 1)  # one tree sampling per engine step with tree rows
                timed_steps = max(timed.calls["sampling"], 1)
                results[setting] = {
                    what: {"ops_per_step": sum(ops.ops[what].values()) / steps,
                           "calls_per_step": ops.calls[what] / steps,
                           "host_ms_per_step": 1e3 * timed.seconds[what] / timed_steps,
                           "by_op": {n: c / steps for n, c in ops.ops[what].most_common()}}
                    for what in PHASES}
                results[setting]["steps"] = steps
    finally:
        tree_runner.sample_with_trees = originals["sampling"]
        TreeMtpProposer._forward_level, TreeMtpProposer._run_head = originals["level"], originals["head"]
        if originals["blocks"] is not None:
            TreeMtpProposer._level_blocks = originals["blocks"]
    return results


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--widths", type=int, nargs="+", default=[2, 2, 1])
    parser.add_argument("--repeats", type=int, default=3, help="timed generates per setting")
    parser.add_argument("--by-op", action="store_true", help="also print the ops by name")
    args = parser.parse_args(argv)

    import vllm_treewy.vllm_plugin as plugin

    plugin.register()
    results = measure(args)
    print(f"\ntree {args.widths}, batch {args.batch}: per engine step with tree rows")
    print(f"{'setting':<12}{'phase':<36}{'ops':>8}{'calls':>7}{'host ms':>9}")
    for setting, phases in results.items():
        for what, label in PHASES.items():
            r = phases[what]
            print(f"{setting:<12}{label:<36}{r['ops_per_step']:8.1f}{r['calls_per_step']:7.1f}"
                  f"{r['host_ms_per_step']:9.2f}")
            if args.by_op:
                for name, count in r["by_op"].items():
                    print(f"{'':<16}{name:<40}{count:6.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
