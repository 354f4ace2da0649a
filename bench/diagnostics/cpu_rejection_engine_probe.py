"""What temperature / top-p vLLM's rejection sampler really applies to the target rows in a CPU engine (issue 33).

The engine-level companion of `cpu_rejection_sampling.py`: one in-process engine (VLLM_ENABLE_V1_MULTIPROCESSING=0)
on the CPU fixture with vLLM's own MTP chain (k = 3, store_all), a few requests at temperature 0.8 / top-p 0.95.
`vllm.v1.sample.rejection_sampler.expand_batch_to_tokens` is wrapped (its result passed on unchanged) to record, for
every speculative step, the per-request values it was given and the per-token values `apply_sampling_constraints`
then divides the target logits by (temperature) and thresholds them with (top-p). With `--fix` the CPU override
`vllm.utils.cpu_triton_utils._expand_kernel_impl` is replaced first by the in-place torch version from
`cpu_rejection_sampling.py` (the worker registers the overrides from that module attribute at start-up).

    python3 bench/diagnostics/cpu_rejection_engine_probe.py          # about 1-2 min on 2 cores
    python3 bench/diagnostics/cpu_rejection_engine_probe.py --fix
    python3 bench/diagnostics/cpu_rejection_engine_probe.py --homogeneity 600     # about 1 min on 2 cores
    python3 bench/diagnostics/cpu_rejection_engine_probe.py --homogeneity 600 --temperature 1.0 --top-p 1.0 \
        --strategy reconstruct

`--homogeneity N` instead runs issue 33's test: one fixture prompt (40 tokens), N unseeded requests of 3 tokens
(default temperature 0.8 / top-p 0.95), in three engines one after another (no speculation; MTP k = 3 (store_all or --strategy) as installed; the same
with the fixed expand), and a chi-square test of homogeneity of each spec engine against no speculation on the 1st,
2nd and 3rd emitted tokens (tokens whose two-engine count is below 10 pooled into one cell).
"""

import argparse
import os
import sys
import tempfile

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))

import torch  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--fix", action="store_true")
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=12)
    ap.add_argument("--homogeneity", type=int, default=0)
    ap.add_argument("--temperature", type=float, default=0.8, help="--homogeneity only")
    ap.add_argument("--top-p", type=float, default=0.95, help="--homogeneity only")
    ap.add_argument("--strategy", default="store_all", help="--homogeneity only: mamba_state_commit")
    args = ap.parse_args()
    if args.homogeneity:
        return homogeneity(args.homogeneity, args.temperature, args.top_p, args.strategy)

    import vllm.utils.cpu_triton_utils as cpu_tl
    import vllm.v1.sample.rejection_sampler as rs

    if args.fix:
        from cpu_rejection_sampling import fixed_expand_kernel_impl

        cpu_tl._expand_kernel_impl = fixed_expand_kernel_impl

    records = []
    original = rs.expand_batch_to_tokens

    def recording(x, cu, n, replace_from=0, replace_to=0):
        out = original(x, cu, n, replace_from=replace_from, replace_to=replace_to)
        records.append((x.clone(), cu.clone(), out.clone(), replace_to))
        return out

    rs.expand_batch_to_tokens = recording

    from transformers import AutoTokenizer
    from vllm import SamplingParams

    from vllm_treewy.fixture import build_fixture, fixture_prompts
    from vllm_treewy.vllm_plugin.testing.equivalence import engine

    model = str(build_fixture(tempfile.mkdtemp()))
    prompts = fixture_prompts(AutoTokenizer.from_pretrained(model), args.requests)
    spec = {"method": "mtp", "num_speculative_tokens": 3, "mamba_state_commit": "store_all"}
    with engine(model, max_num_seqs=4, speculative_config=spec) as llm:
        params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=args.tokens, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    print("expand =", "fixed" if args.fix else "vllm (as installed)", "| outputs:",
          [len(o.outputs[0].token_ids) for o in outs], "tokens")
    temps = [r for r in records if r[3] == 1]
    tops = [r for r in records if r[3] != 1]
    print(f"speculative steps: {len(temps)} (temperature expansions), {len(tops)} top-p expansions")
    for label, rows in (("temperature", temps), ("top_p", tops)):
        allv = torch.cat([r[2].float() for r in rows]) if rows else torch.empty(0)
        want = torch.cat([torch.repeat_interleave(r[0].float(), torch.diff(r[1].long(), prepend=torch.zeros(1, dtype=torch.long)))
                          for r in rows]) if rows else torch.empty(0)
        wrong = (allv != want).sum().item() if rows else 0
        print(f"  {label}: {allv.numel()} per-token values, {wrong} differ from the request's value"
              f" (request values {sorted(set(round(v, 4) for r in rows for v in r[0].tolist()))})")
        for r in rows[:5]:
            print(f"    given {[round(v, 4) for v in r[0].tolist()]} cu {r[1].tolist()} -> used {[f'{v:.4g}' for v in r[2].tolist()]}")
    return 0


def _generate(engine, model, kwargs, prompt, n, params):
    # In a function: no reference to the LLM may outlive `engine`'s teardown, or its later destruction tears down
    # the next engine's distributed state.
    with engine(model, **kwargs) as llm:
        return llm.generate([{"prompt_token_ids": prompt}] * n, params, use_tqdm=False)


def homogeneity(n: int, temperature: float, top_p: float, strategy: str) -> int:
    import numpy as np
    import vllm.utils.cpu_triton_utils as cpu_tl
    from scipy.stats import chi2_contingency
    from transformers import AutoTokenizer
    from vllm import SamplingParams

    from cpu_rejection_sampling import fixed_expand_kernel_impl
    from vllm_treewy.fixture import build_fixture, fixture_prompts
    from vllm_treewy.vllm_plugin.testing.equivalence import engine

    model = str(build_fixture(tempfile.mkdtemp()))
    prompt = fixture_prompts(AutoTokenizer.from_pretrained(model), 2)[1]  # 40 tokens
    original_impl = cpu_tl._expand_kernel_impl
    spec = {"method": "mtp", "num_speculative_tokens": 3, "mamba_state_commit": strategy}
    params = SamplingParams(temperature=temperature, top_p=top_p, max_tokens=3, ignore_eos=True)
    print(f"prompt of {len(prompt)} tokens, temperature {temperature}, top-p {top_p}, mamba_state_commit {strategy}")
    runs = {}
    for name, spec_config, impl in (("mtp-k3 vllm", spec, original_impl),
                                    ("mtp-k3 fixed", spec, fixed_expand_kernel_impl), ("no-spec", None, original_impl)):
        cpu_tl._expand_kernel_impl = impl  # read by the worker's register_triton_kernel_overrides at start-up
        kwargs = dict(max_num_seqs=16)
        if spec_config:
            kwargs["speculative_config"] = spec_config
        outs = _generate(engine, model, kwargs, prompt, n, params)
        runs[name] = np.array([list(o.outputs[0].token_ids) for o in outs])
        print(f"{name}: {n} samples, distinct tokens per position "
              f"{[len(set(runs[name][:, j].tolist())) for j in range(3)]}", flush=True)
    cpu_tl._expand_kernel_impl = original_impl
    ref = runs["no-spec"]
    for name in ("mtp-k3 vllm", "mtp-k3 fixed"):
        for j in range(3):
            a, b = ref[:, j], runs[name][:, j]
            tokens = sorted(set(a.tolist()) | set(b.tolist()))
            ca = np.array([(a == t).sum() for t in tokens])
            cb = np.array([(b == t).sum() for t in tokens])
            big = (ca + cb) >= 10
            table = np.array([np.append(ca[big], ca[~big].sum()), np.append(cb[big], cb[~big].sum())])
            table = table[:, table.sum(0) > 0]
            stat, p, dof, _ = chi2_contingency(table)
            print(f"  {name} vs no-spec, emitted token {j + 1}: chi2={stat:.1f} dof={dof} p={p:.2e}"
                  f" (cells {table.shape[1]})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
