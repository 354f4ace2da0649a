"""Why vLLM 0.32's speculative sampling on the CPU backend does not emit the target distribution (issue 33).

No engine: known target logits go through vLLM's own `RejectionSampler.forward` (the entry the V1 runner's `_sample`
calls with MTP drafts: draft_probs=None, drafts = deterministic tokens), after the CPU platform's Triton overrides are
registered exactly as `WorkerWrapperBase.init_worker` does (`current_platform.register_triton_kernel_overrides()`).
Many requests per call (all with the same logits), several calls, global torch seed fixed; per position j the
emitted token, among trials whose first j emitted tokens were the drafts, is tested (chi-square goodness of fit) against
the exact processed target p_j (float64 here: temperature, top-k, top-p by vLLM's rule); p_k is the bonus row. The
emitted length is tested against its exact law (prod_{i<j} p_i(d_i) * (1 - p_j(d_j))).

Three variants of the one kernel that goes wrong:
  vllm      as installed. `expand_batch_to_tokens` (rejection_sampler.py) calls the `expand_kernel` override
            `vllm.utils.cpu_triton_utils._expand_kernel_impl`, which hands `_ensure_int64(output)` -- for the float32
            temperature / top-p and the int32 top-k a *new* int64 tensor -- to the C++ op and never copies it back,
            and reads the float inputs as int64 (0.8 -> 0). `apply_sampling_constraints` then divides the target rows
            by uninitialized memory and applies top-k/top-p thresholds read from uninitialized memory.
  fixed     `_expand_kernel_impl` replaced by a torch implementation that writes into `output` in place, then the
            overrides registered again (what a plugin can do); nothing else changed.
Part A prints `expand_batch_to_tokens` on a float32 temperature, a float32 top-p and an int32 top-k, before and after.
Part C: a greedy request in the same step as a sampled one (not all_greedy, so the expansion runs for it too) must
emit exactly the argmax chain; the garbage temperature (negative values flip the argmax) and top-k/top-p break it.

    python3 bench/diagnostics/cpu_rejection_sampling.py            # ~1-2 min on 2 cores
    python3 bench/diagnostics/cpu_rejection_sampling.py --trials 20000 --calls 10

Pass rule (stated threshold): every chi-square p-value > 1e-3 and no token of probability 0 emitted.
"""

import argparse
import os
import sys
import warnings

os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
warnings.filterwarnings("ignore")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from scipy.stats import chi2  # noqa: E402

from vllm.platforms import current_platform  # noqa: E402

current_platform.register_triton_kernel_overrides()  # as the worker does before any sampling

import vllm.utils.cpu_triton_utils as cpu_tl  # noqa: E402
import vllm.v1.sample.rejection_sampler as rs  # noqa: E402
from vllm.v1.sample.logits_processor import LogitsProcessors  # noqa: E402
from vllm.v1.sample.metadata import SamplingMetadata  # noqa: E402
from vllm.v1.sample.sampler import Sampler  # noqa: E402
from vllm.v1.spec_decode.metadata import SpecDecodeMetadata  # noqa: E402

P_THRESHOLD = 1e-3
ORIGINAL_EXPAND_IMPL = cpu_tl._expand_kernel_impl


def fixed_expand_kernel_impl(output, input_val, cu_num_tokens, replace_from, replace_to, MAX_NUM_TOKENS=None):
    """expand_kernel's contract: output[cu[i-1]:cu[i]] = input[i] (replace_from -> replace_to), any dtype, in place."""
    cu = cu_num_tokens.to(torch.long)
    counts = torch.diff(cu, prepend=cu.new_zeros(1))
    values = input_val.masked_fill(input_val == replace_from, replace_to)
    n = int(cu[-1]) if cu.numel() else 0
    output[:n].copy_(torch.repeat_interleave(values, counts, output_size=n))


def use_expand(impl) -> None:
    cpu_tl._expand_kernel_impl = impl
    current_platform.register_triton_kernel_overrides()  # re-reads cpu_tl._expand_kernel_impl


def part_a() -> None:
    print("== A. expand_batch_to_tokens on CPU (3 requests with 3, 3, 2 draft tokens) ==")
    print("   kernel behind rs._expand:", type(rs._expand.kernel).__name__, "->", rs._expand.kernel._impl.__module__,
          rs._expand.kernel._impl.__name__)
    cu = torch.tensor([3, 6, 8], dtype=torch.int32)
    cases = [
        ("temperature f32 [0.8,1.0,0.7] (replace 0->1)", torch.tensor([0.8, 1.0, 0.7]), dict(replace_from=0, replace_to=1)),
        ("top_p f32 [0.95,0.9,0.5]", torch.tensor([0.95, 0.9, 0.5]), {}),
        ("top_k i32 [5,8,3]", torch.tensor([5, 8, 3], dtype=torch.int32), {}),
        ("top_k i64 [5,8,3]", torch.tensor([5, 8, 3], dtype=torch.int64), {}),
    ]
    for label, impl in (("vllm", ORIGINAL_EXPAND_IMPL), ("fixed", fixed_expand_kernel_impl)):
        use_expand(impl)
        for name, x, kw in cases:
            out = rs.expand_batch_to_tokens(x, cu, 8, **kw)
            print(f"   {label:5s} {name:46s} -> {out.tolist()}")
    use_expand(ORIGINAL_EXPAND_IMPL)


def processed_probs(logits: np.ndarray, temperature: float, top_k, top_p) -> np.ndarray:
    """vLLM's target distribution in float64: logits / T, top-k, top-p (ascending sort, drop cumsum <= 1 - p, keep 1)."""
    z = logits.astype(np.float64) / temperature
    order = np.argsort(z, kind="stable")  # ascending
    zs = z[order].copy()
    if top_k is not None:
        zs[zs < zs[len(zs) - top_k]] = -np.inf
    if top_p is not None:
        ps = np.exp(zs - zs.max())
        ps /= ps.sum()
        cs = np.cumsum(ps)
        assert np.all(np.abs(cs - (1 - top_p)) > 1e-4), "top-p boundary too close for a float32 comparison"
        mask = cs <= 1 - top_p
        mask[-1] = False
        zs[mask] = -np.inf
    out = np.full_like(z, -np.inf)
    out[order] = zs
    p = np.exp(out - out.max())
    return p / p.sum()


def chisq(observed: np.ndarray, expected: np.ndarray):
    """Chi-square goodness of fit; cells with expected < 5 pooled. Returns (stat, dof, p, impossible_count)."""
    impossible = int(observed[expected == 0].sum())
    keep = expected > 0
    o, e = observed[keep].astype(np.float64), expected[keep]
    big = e >= 5
    o = np.concatenate([o[big], [o[~big].sum()]]) if (~big).any() else o
    e = np.concatenate([e[big], [e[~big].sum()]]) if (~big).any() else e
    if len(e) < 2:
        return 0.0, 0, 1.0, impossible
    stat = float(((o - e) ** 2 / e).sum())
    dof = len(e) - 1
    return stat, dof, float(chi2.sf(stat, dof)), impossible


def run_case(name, logits_np, drafts, temperature, top_k, top_p, trials_per_call, calls, seeded, seed):
    k = len(drafts)
    vocab = logits_np.shape[1]
    exact = [processed_probs(logits_np[j], temperature, top_k, top_p) for j in range(k + 1)]
    B = trials_per_call
    logits = torch.tensor(np.tile(logits_np, (B, 1)), dtype=torch.float32)  # rows: req0 d0..d_{k-1} bonus, req1 ...
    num_draft = [k] * B
    cu_draft = torch.arange(1, B + 1, dtype=torch.int32) * k
    cu_sampled = torch.arange(1, B + 1, dtype=torch.int32) * (k + 1)
    row = torch.arange(B * (k + 1), dtype=torch.int32).view(B, k + 1)
    meta = SpecDecodeMetadata(
        draft_token_ids=torch.tensor(drafts * B, dtype=torch.int32),
        num_draft_tokens=num_draft,
        cu_num_draft_tokens=cu_draft,
        cu_num_sampled_tokens=cu_sampled,
        target_logits_indices=row[:, :k].reshape(-1).contiguous(),
        bonus_logits_indices=row[:, k].contiguous(),
        logits_indices=row.reshape(-1).contiguous(),
    )
    sampler = rs.RejectionSampler(Sampler())
    torch.manual_seed(seed)
    outs = []
    used_temps = []
    orig_expand = rs.expand_batch_to_tokens

    def recording_expand(x, cu, n, replace_from=0, replace_to=0):
        out = orig_expand(x, cu, n, replace_from=replace_from, replace_to=replace_to)
        if replace_to == 1:  # the temperature call
            used_temps.append(out.clone())
        return out

    rs.expand_batch_to_tokens = recording_expand
    try:
        for c in range(calls):
            gens = {}
            if seeded:
                for i in range(B):
                    g = torch.Generator()
                    g.manual_seed(seed * 1_000_003 + c * B + i)
                    gens[i] = g
            md = SamplingMetadata(
                temperature=torch.full((B,), temperature, dtype=torch.float32),
                all_greedy=False,
                all_random=True,
                top_p=None if top_p is None else torch.full((B,), top_p, dtype=torch.float32),
                top_k=None if top_k is None else torch.full((B,), top_k, dtype=torch.int32),
                generators=gens,
                max_num_logprobs=None,
                no_penalties=True,
                prompt_token_ids=None,
                frequency_penalties=torch.zeros(B),
                presence_penalties=torch.zeros(B),
                repetition_penalties=torch.ones(B),
                output_token_ids=[[] for _ in range(B)],
                allowed_token_ids_mask=None,
                bad_words_token_ids={},
                logitsprocs=LogitsProcessors(),
            )
            try:
                out = sampler(meta, None, logits.clone(), md).sampled_token_ids
            except Exception as e:  # garbage top-k indexes past the vocabulary
                print(f"-- {name}: call {c} raised {type(e).__name__}: {e}  FAIL")
                return False
            outs.append(out.numpy().copy())
    finally:
        rs.expand_batch_to_tokens = orig_expand
    out = np.concatenate(outs)  # [trials, k+1], -1 = placeholder
    temps = torch.cat(used_temps)
    print(f"-- {name}: T={temperature} top_k={top_k} top_p={top_p} seeded={seeded} trials={len(out)} drafts={drafts}")
    print(f"   temperature the target rows were divided by: min {temps.min().item():.4g} max {temps.max().item():.4g}"
          f" share != {temperature}: {(temps != temperature).float().mean().item():.3f}")
    ok = True
    lengths = (out >= 0).sum(1)
    assert ((out >= 0) == (np.arange(k + 1)[None, :] < lengths[:, None])).all(), "tokens after a placeholder"
    for j in range(k + 1):
        tok = out[lengths > j, j]
        obs = np.bincount(tok, minlength=vocab)
        exp = exact[j] * len(tok)
        stat, dof, p, imp = chisq(obs, exp)
        fail = p <= P_THRESHOLD or imp > 0
        ok &= not fail
        label = "bonus" if j == k else f"pos {j}"
        top = np.argsort(-exact[j])[:4]
        freq = ", ".join(f"{t}:{obs[t] / len(tok):.3f}/{exact[j][t]:.3f}" for t in top)
        print(f"   {label}: n={len(tok):6d} chi2={stat:9.1f} dof={dof:2d} p={p:.2e} impossible={imp:5d}"
              f"  {'FAIL' if fail else 'ok'}   freq/exact (top tokens) {freq}")
        if j < k:
            # A rejection at j emits a recovered token, which is never the draft: the chain stopping on the draft
            # is an event of probability 0.
            stop_on_draft = int(((lengths == j + 1) & (out[:, j] == drafts[j])).sum())
            if stop_on_draft:
                ok = False
                print(f"          chain stopped at pos {j} on the draft token itself (probability 0): {stop_on_draft}"
                      "  FAIL")
    # emitted length
    acc = [exact[j][drafts[j]] for j in range(k)]
    law = [np.prod(acc[:j]) * (1 - acc[j]) for j in range(k)] + [np.prod(acc)]
    obs = np.bincount(lengths - 1, minlength=k + 1)
    stat, dof, p, imp = chisq(obs, np.array(law) * len(out))
    fail = p <= P_THRESHOLD
    ok &= not fail
    print(f"   length 1..{k + 1}: observed {[round(float(x) / len(out), 4) for x in obs]}"
          f" exact {[round(float(x), 4) for x in law]}"
          f" chi2={stat:.1f} p={p:.2e} {'FAIL' if fail else 'ok'}")
    return ok


def part_c(logits_np, trials: int) -> dict:
    """Mixed batch: request 0 greedy (temperature 0), request 1 at 0.8 / top-p 0.95. With the drafts equal to the
    target's argmax a greedy request must accept all k drafts and take the bonus row's argmax, every time."""
    k = logits_np.shape[0] - 1
    B = 2
    drafts = [int(np.argmax(logits_np[j])) for j in range(k)]
    logits = torch.tensor(np.tile(logits_np, (B, 1)), dtype=torch.float32)
    row = torch.arange(B * (k + 1), dtype=torch.int32).view(B, k + 1)
    meta = SpecDecodeMetadata(
        draft_token_ids=torch.tensor(drafts * B, dtype=torch.int32), num_draft_tokens=[k] * B,
        cu_num_draft_tokens=torch.arange(1, B + 1, dtype=torch.int32) * k,
        cu_num_sampled_tokens=torch.arange(1, B + 1, dtype=torch.int32) * (k + 1),
        target_logits_indices=row[:, :k].reshape(-1).contiguous(), bonus_logits_indices=row[:, k].contiguous(),
        logits_indices=row.reshape(-1).contiguous())
    want = drafts + [int(np.argmax(logits_np[k]))]
    sampler = rs.RejectionSampler(Sampler())
    results = {}
    for variant, impl in (("vllm", ORIGINAL_EXPAND_IMPL), ("fixed", fixed_expand_kernel_impl)):
        use_expand(impl)
        torch.manual_seed(0)
        wrong = 0
        for _ in range(trials):
            md = SamplingMetadata(
                temperature=torch.tensor([0.0, 0.8]), all_greedy=False, all_random=False,
                top_p=torch.tensor([1.0, 0.95]), top_k=None, generators={}, max_num_logprobs=None,
                no_penalties=True, prompt_token_ids=None, frequency_penalties=torch.zeros(B),
                presence_penalties=torch.zeros(B), repetition_penalties=torch.ones(B),
                output_token_ids=[[] for _ in range(B)], allowed_token_ids_mask=None, bad_words_token_ids={},
                logitsprocs=LogitsProcessors())
            try:
                out = sampler(meta, None, logits.clone(), md).sampled_token_ids[0].tolist()
            except Exception:
                out = None
            wrong += out != want
        results[variant] = wrong
        print(f"   {variant:5s}: greedy request's output != the argmax chain {want} in {wrong} of {trials} calls")
    use_expand(ORIGINAL_EXPAND_IMPL)
    return results


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trials", type=int, default=4000, help="requests per call")
    ap.add_argument("--calls", type=int, default=5)
    ap.add_argument("--vocab", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(1)
    import logging

    logging.getLogger("vllm").setLevel(logging.ERROR)  # the re-registrations' "already registered" warnings
    print("vllm", __import__("vllm").__version__, "| HAS_TRITON", rs.HAS_TRITON if hasattr(rs, "HAS_TRITON") else
          __import__("vllm.triton_utils", fromlist=["HAS_TRITON"]).HAS_TRITON, "| platform", type(current_platform).__name__)
    print("   kernels: random", rs._rejection_random_sample.kernel._impl.__name__,
          "| recovered", rs._sample_recovered_tokens.kernel._impl.__name__,
          "| greedy", rs._rejection_greedy_sample.kernel._impl.__name__)
    part_a()
    rng = np.random.default_rng(args.seed)
    k = 3
    logits_np = (rng.standard_normal((k + 1, args.vocab)) * 1.5).astype(np.float32)
    cases = [
        ("T1", 1.0, None, None, False),
        ("T0.8/p0.95", 0.8, None, 0.95, False),
        ("T0.7/k8/p0.9", 0.7, 8, 0.9, False),
        ("T0.8/p0.95 seeded", 0.8, None, 0.95, True),
    ]
    verdict = {}
    for variant, impl in (("vllm", ORIGINAL_EXPAND_IMPL), ("fixed", fixed_expand_kernel_impl)):
        use_expand(impl)
        print(f"\n== B. RejectionSampler.forward, expand = {variant} ==")
        for name, t, tk, tp, seeded in cases:
            exact_first = [processed_probs(logits_np[j], t, tk, tp) for j in range(k)]
            drafts = [int(np.argmax(p)) for p in exact_first]  # MTP-like deterministic drafts: the target's argmax
            verdict[(variant, name)] = run_case(name, logits_np, drafts, t, tk, tp, args.trials, args.calls, seeded,
                                                args.seed + 1)
    use_expand(ORIGINAL_EXPAND_IMPL)
    print("\n== C. a greedy request batched with a sampled one (temperature 0 and 0.8 in one step) ==")
    for variant, wrong in part_c(logits_np, 500).items():
        verdict[(variant, "greedy in mixed batch")] = wrong == 0
    print("\n== verdict (pass = every p > %g and no impossible token) ==" % P_THRESHOLD)
    for key, ok in verdict.items():
        print(f"   {key[0]:5s} {key[1]:20s} {'PASS' if ok else 'FAIL'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
