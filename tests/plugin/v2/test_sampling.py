"""Draft trees on Model Runner V2 sample exactly: the adapter's sampling path (`v2.runner`, hook 3) with vLLM
V2's real `Sampler` emits the model's distribution, on CPU.

What runs: the runner hooks as installed (`_finding_tree_rows` around V2's `prepare_attn`: the tree rows, the depth
positions written into V2's positions; `_sampling_trees` around V2's `sample`: `sample_tree_step`, i.e. ONE call of
V2's `Sampler.sample` over every logits row, then `accept_tree_rows`, main's walk over those draws), on vLLM's own
`Sampler` built as V2's runner builds it (`RequestState`, `SamplingStates` through `Sampler.add_request` with unseeded
`SamplingParams`: each request's seed drawn by V2 from numpy's stream, seeded here), logits processors, temperature,
top-k/top-p (vLLM's CPU path, `apply_top_k_top_p_pytorch`; a GPU runs its Triton twin), and Gumbel-max noise keyed by
(request seed, position, token). Runner plumbing only is faked: a SimpleNamespace runner, V2's InputBatch fields
as V2 lays them out (tree rows of 1 + N tokens, positions num_computed + i before the hook, every token a logits
row, rows in a fresh random batch order each step through `idx_mapping`), the model's `compute_logits`, no KV
layers (nothing to compact) and no GDN groups. No UVA on CPU: vLLM's own fallback (`NonUvaBuffer`).

V2's Triton kernels on CPU. vLLM's CPU wheel swaps Triton for a placeholder, so V2's sampler kernels
(`gumbel._temperature_kernel`, `gumbel._gumbel_sample_kernel`, `input_batch._get_num_sampled_and_rejected_kernel`)
run only in Triton's interpreter (`tests/plugin/vllm_interpreted.load_vllm_module`, a fresh copy on the real
Triton). They do run there, but at ~13 ms per logits row (the interpreter's per-op Python overhead, per program;
2 cores), so 20k trials of 3 steps x 11 rows would take hours. Hence two layers:

(i) `test_twins_are_v2s_interpreted_kernels`: one tree step of V2's real sampler with the INTERPRETED kernels and the
    same step with the numpy twins below (the murmur3 noise, V2's fp32 uniform and Gumbel transform, the argmax;
    `logits / T`; the chunked-prefill count): every draw of every row and every output field equal, at both
    settings (T 0.7 with top-p masks -inf logits; random int64 seeds, negative ones included).
(ii) The statistics on the twins (everything else V2's real code): TRIALS requests, each starting at a root token
    (every token equally often) and a position, run speculative steps (each step's bonus the next root, its
    position the root's + the tokens emitted) until EMITTED tokens are out. The "model": logits a seeded table
    of the last token (`tests/spec_decode/test_tree_sampling`'s, VOCAB 7), so p(. | context) = that row through
    T / top-k / top-p, exactly; drafts deterministic, the top tokens of a correlated seeded draft table (accepted
    about half the time). The emitted triples' joint law is p(y1 | root) p(y2 | y1) p(y3 | y2); Pearson
    chi-square against it (cells of expectation < 5 pooled, `joint_test`), and no token of probability 0.
    EMITTED 3 spans 1-3 steps, so the noise across steps is judged too: a step's nodes off the walk draw with
    noise of positions the next step's root reuses (exact only because a step's stopping depth depends on the
    noise up to it: the argument of `v2.runner`'s hook 3).

Threshold: each exactness p-value > P_MIN = 1e-3 (6 of them: trees [2,2,1] and [2,1] x 3 settings; with an exact
sampler the chance any fails is < 0.6 %, Bonferroni), every generator and numpy's stream seeded, so the verdict is
fixed. Planted bugs must reach p < P_MIN (or an impossible token): `parents-draw` (the walk reads, at each node, the
draw at the node's parent), `root-position` (every node drawn with the root's position: one noise vector reused at
every depth), `chain-positions` (the depth positions not written: V2's num_computed + block index, siblings at
different positions, a step's walk reusing the next step's noise).

Figures (2026-12-04, 2 shared cores): exact path p = 0.12 / 0.56 / 0.71 ([2,2,1] at T 1.0 / T 0.7 top-p 0.9 /
T 0.7 top-k 4 top-p 0.9) and 0.46 / 0.67 / 0.22 ([2,1]), no impossible token; planted bugs (PLANTED_TRIALS = 5000,
[2,2,1], T 1.0) parents-draw chi2 10560 and root-position 6661 (p = 0 in float64), chain-positions 592 on 166 dof
(p = 4e-49). The module takes 25-35 s (the interpreted step ~2.4 s per setting, each 20k-trial run 2-3 s).
"""

from __future__ import annotations

import contextlib
import functools
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from tests.spec_decode.test_tree_sampling import (
    EMITTED,
    VOCAB,
    draft_ranking,
    draft_tokens_for,
    joint_test,
    model_logits,
    parents_draw,
    roots_for,
    sampling_distribution,
)
from vllm_treewy.kernels.bookkeeping import dispatch
from vllm_treewy.tree import DraftTree
from vllm_treewy.vllm_plugin.v2 import runner as v2_tree_runner
from vllm_treewy.vllm_plugin.trees.step import TreeConstants
from vllm_treewy.vllm_plugin.v2 import run_state as v2_run_state
from vllm_treewy.vllm_plugin.v2 import acceptance as v2_acceptance

TRIALS = 20_000
P_MIN = 1e-3
PROMPT_LEN = 12
SETTINGS = {"t1.0": (1.0, 0, 1.0), "t0.7-p0.9": (0.7, 0, 0.9), "t0.7-k4-p0.9": (0.7, 4, 0.9)}  # (T, top_k, top_p)
TREES = {"2x2x1": [2, 2, 1], "2x1": [2, 1]}
NUMPY_SEED = 2026  # V2 draws unseeded requests' seeds from numpy's global stream
CPU = torch.device("cpu")


# -- the exact law ------------------------------------------------------------------------------------------------
def model_table() -> torch.Tensor:
    """`[VOCAB, VOCAB]` float32 logits of the next token given the last one (what the sampler sees)."""
    return model_logits().float()


# -- numpy twins of V2's sampler kernels (checked equal to the interpreted kernels by test (i)) --------------------
_M32 = np.uint64(0xFFFFFFFF)


def _u32(x):
    return np.asarray(x, dtype=np.uint64) & _M32


def _rotl32(h, shift):
    return ((h << np.uint64(shift)) | (h >> np.uint64(32 - shift))) & _M32


def _mix(h, key):
    key = (key * np.uint64(0xCC9E2D51)) & _M32
    key = _rotl32(key, 15)
    key = (key * np.uint64(0x1B873593)) & _M32
    h = h ^ key
    h = _rotl32(h, 13)
    return (h * np.uint64(5) + np.uint64(0xE6546B64)) & _M32


def _fmix32(h):
    h = h ^ (h >> np.uint64(16))
    h = (h * np.uint64(0x85EBCA6B)) & _M32
    h = h ^ (h >> np.uint64(13))
    h = (h * np.uint64(0xC2B2AE35)) & _M32
    return h ^ (h >> np.uint64(16))


def murmur3_uniform32(seed: np.ndarray, pos: np.ndarray, offset: np.ndarray) -> np.ndarray:
    """`gumbel.murmur3_uniform32` for seeds / positions `[n, 1]` (int64) and token offsets `[1, V]`: float32."""
    seed, pos = np.asarray(seed, dtype=np.int64), np.asarray(pos, dtype=np.int64)
    h = np.zeros(np.broadcast_shapes(seed.shape, offset.shape), dtype=np.uint64)
    h = _mix(h, _u32(seed & 0xFFFFFFFF))
    h = _mix(h, _u32((seed >> 32) & 0xFFFFFFFF))
    h = _mix(h, _u32(pos & 0xFFFFFFFF))
    h = _mix(h, _u32(offset))
    r = _fmix32(h ^ np.uint64(16))
    hi16 = (r >> np.uint64(16)).astype(np.int32).astype(np.float32)
    lo16 = (r & np.uint64(0xFFFF)).astype(np.int32).astype(np.float32)
    return hi16 * np.float32(1.52587890625e-05) + (lo16 + np.float32(0.5)) * np.float32(2.3283064365386963e-10)


def _log1p_neg_stable(value: np.ndarray) -> np.ndarray:
    poly = np.full_like(value, np.float32(1.0 / 8.0))
    for c in (7, 6, 5, 4, 3, 2):
        poly = np.float32(1.0 / c) + value * poly
    poly = np.float32(1.0) + value * poly
    series = -value * poly
    with np.errstate(divide="ignore"):
        direct = np.log(np.maximum(np.float32(1.0) - value, np.float32(5.960464477539063e-08)))
    return np.where(value < np.float32(0.25), series, direct)


def gumbel_sample_twin(logits, expanded_idx_mapping, temperature, seed, pos, apply_temperature, is_drafting,
                       logits_cache=None, logits_cache_col=None, use_fp64=False, logits_cache_source=None):
    """`gumbel.gumbel_sample` as V2's `Sampler._sample_random` calls it (the target's noise, fp32, no logits cache)."""
    assert not is_drafting and not use_fp64 and logits_cache is None and logits_cache_source is None
    rows = expanded_idx_mapping.long().numpy()
    x = logits.float().numpy().astype(np.float32)
    temp = temperature.float().numpy()[rows][:, None]
    if apply_temperature:
        x = np.where(temp != 0, x / np.where(temp != 0, temp, np.float32(1)), x).astype(np.float32)
    u = murmur3_uniform32(seed.numpy()[rows][:, None], pos.long().numpy()[:, None], np.arange(x.shape[1])[None, :])
    with np.errstate(divide="ignore"):
        noise = -np.log(-_log1p_neg_stable(u))
    noised = np.where(temp != 0, x + noise, x)
    return torch.from_numpy(noised.argmax(axis=1).astype(np.int64))


def apply_temperature_twin(logits, expanded_idx_mapping, temperature):
    """`gumbel.apply_temperature`: rows whose temperature is not 0 or 1 divided by it, in place (fp32)."""
    temp = temperature[expanded_idx_mapping.long()].to(logits.dtype)[:, None]
    scaled = (temp != 0) & (temp != 1)
    logits.copy_(torch.where(scaled, logits / torch.where(scaled, temp, torch.ones_like(temp)), logits))


def num_sampled_and_rejected_twin(num_sampled, seq_lens, cu_num_logits, idx_mapping, prefill_len):
    """`input_batch.get_num_sampled_and_rejected`: nothing sampled (or rejected) by a request still prefilling."""
    chunked = seq_lens < prefill_len[idx_mapping.long()]
    num_sampled.masked_fill_(chunked, 0)
    num_rejected = (cu_num_logits[1:] - cu_num_logits[:-1]).to(num_sampled.dtype) - num_sampled
    return num_sampled, num_rejected.masked_fill_(chunked, 0)


@contextlib.contextmanager
def v2_kernels(monkeypatch, interpreted: bool):
    """V2's sampler kernels and ours (`kernels.bookkeeping.dispatch`): the interpreted Triton kernels, or their
    twins."""
    import vllm.v1.worker.gpu.input_batch as input_batch
    import vllm.v1.worker.gpu.sample.sampler as sampler
    import vllm.v1.worker.gpu.sample.states as states

    with monkeypatch.context() as m:
        if interpreted:
            from tests.plugin.vllm_interpreted import load_vllm_module

            gumbel = load_vllm_module("vllm.v1.worker.gpu.sample.gumbel")
            batch_kernels = load_vllm_module("vllm.v1.worker.gpu.input_batch")
            m.setattr(sampler, "gumbel_sample", gumbel.gumbel_sample)
            m.setattr(states, "apply_temperature", gumbel.apply_temperature)
            m.setattr(input_batch, "_get_num_sampled_and_rejected_kernel",
                      batch_kernels._get_num_sampled_and_rejected_kernel)
            m.setattr(dispatch, "launches_triton", lambda tensor: True)
        else:
            m.setattr(sampler, "gumbel_sample", gumbel_sample_twin)
            m.setattr(states, "apply_temperature", apply_temperature_twin)
            m.setattr(input_batch, "get_num_sampled_and_rejected", num_sampled_and_rejected_twin)
        yield


# -- V2's sampler and the runner plumbing ---------------------------------------------------------------------------
@functools.cache
def _vllm_config():
    from vllm.config import VllmConfig

    return VllmConfig()


def v2_sampler(monkeypatch, num_reqs: int, setting: str, num_speculative_steps: int):
    """vLLM V2's `Sampler` as `GPUModelRunner` builds it, every request added with the setting's unseeded
    `SamplingParams` (V2 draws the seeds from numpy's stream: seeded here, restored after)."""
    import vllm.v1.worker.gpu.buffer_utils as buffer_utils
    from vllm.sampling_params import SamplingParams
    from vllm.v1.worker.gpu.sample.sampler import Sampler
    from vllm.v1.worker.gpu.states import RequestState

    monkeypatch.setattr(buffer_utils, "is_uva_available", lambda: False)  # CPU: vLLM's NonUvaBuffer fallback
    req_states = RequestState(num_reqs, PROMPT_LEN + 64, num_reqs * (1 + num_speculative_steps),
                              num_speculative_steps, VOCAB, CPU)
    sampler = Sampler(_vllm_config(), num_reqs, VOCAB, CPU, req_states, num_speculative_tokens=num_speculative_steps)
    temperature, top_k, top_p = SETTINGS[setting]
    saved = np.random.get_state()
    np.random.seed(NUMPY_SEED + list(SETTINGS).index(setting))
    try:
        for i in range(num_reqs):
            sampler.add_request(i, SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p))
    finally:
        np.random.set_state(saved)
    sampler.apply_staged_writes()
    req_states.prefill_len.np[:num_reqs] = PROMPT_LEN
    req_states.prefill_len.copy_to_uva()
    return sampler


class KnownModel:
    """`compute_logits` of the "model": the hidden state of a token is its id, the logits its row of the table."""

    def __init__(self, table: torch.Tensor):
        self.table = table

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.table[hidden_states[:, 0].long()]


def v2_runner(sampler, tree: DraftTree, table: torch.Tensor):
    constants = TreeConstants.of(tree, torch.device("cpu"))  # the speculator's, as V2's decode steps use them
    speculator = SimpleNamespace(tree_state=v2_run_state.TreeRunStateV2(tree), tree_constants=lambda t: constants)
    return SimpleNamespace(
        sampler=sampler, model=KnownModel(table), num_speculative_steps=tree.num_nodes,
        speculator=speculator, speculative_config=None,
        batch_sharder=None, rejection_sampler=None,
        compilation_config=SimpleNamespace(static_forward_context={}),
        kv_cache_config=SimpleNamespace(kv_cache_groups=[]), cache_config=SimpleNamespace(mamba_cache_mode="none"))


def v2_tree_batch(roots: torch.Tensor, drafts: torch.Tensor, root_positions: torch.Tensor, idx_mapping: torch.Tensor):
    """V2's InputBatch fields for a decode step of tree rows: batch position b is request `idx_mapping[b]`, whose
    `roots`, `drafts [R, N]`, `root_positions` are indexed by request; positions num_computed + i (V2's, before the
    hook); every verified token a logits row."""
    order = idx_mapping.long()
    num_reqs, num_nodes = drafts.shape
    block_len = 1 + num_nodes
    qsl = np.arange(num_reqs + 1, dtype=np.int32) * block_len
    positions = (root_positions[order][:, None] + torch.arange(block_len)).reshape(-1)
    seq_lens = (root_positions[order] + block_len).int()
    return SimpleNamespace(
        num_reqs=num_reqs, idx_mapping=idx_mapping.int(), idx_mapping_np=idx_mapping.numpy().astype(np.int32),
        expanded_idx_mapping=idx_mapping.int().repeat_interleave(block_len),
        expanded_local_pos=torch.arange(block_len, dtype=torch.int32).repeat(num_reqs),
        num_draft_tokens_per_req=np.full(num_reqs, num_nodes, dtype=np.int32),
        is_prefilling_np=np.zeros(num_reqs, dtype=bool), prefill_runs_as_decode_np=None,
        query_start_loc_np=qsl, query_start_loc=torch.from_numpy(qsl),
        input_ids=torch.cat([roots[order][:, None], drafts[order]], dim=1).reshape(-1).int(),
        positions=positions, logits_indices=torch.arange(num_reqs * block_len),
        cu_num_logits=torch.from_numpy(qsl), cu_num_logits_np=qsl,
        seq_lens=seq_lens, seq_lens_cpu_upper_bound=seq_lens.clone())


def run_v2_step(runner, batch):
    """V2's calls of one step through the adapter's hooks: prepare_attn (tree rows, depth positions), then sample."""
    prepare_attn = v2_tree_runner._finding_tree_rows(lambda self, input_batch: None)
    prepare_attn(runner, batch)
    hidden_states = batch.input_ids.float()[:, None]

    def plain_sample(*args, **kwargs):
        raise AssertionError("a step of tree rows took V2's own sample")

    return v2_tree_runner._sampling_trees(plain_sample)(runner, hidden_states, batch, None)


def run_trials(runner, tree: DraftTree, ranking: torch.Tensor, roots: torch.Tensor, seed: int) -> torch.Tensor:
    """`[TRIALS, EMITTED]` tokens emitted by V2 speculative steps from each request's root, every request a tree
    row in every step (a fresh batch order each step)."""
    generator = torch.Generator().manual_seed(seed)
    num_trials = roots.numel()
    emitted = torch.full((num_trials, EMITTED), -1, dtype=torch.long)
    count = torch.zeros(num_trials, dtype=torch.long)
    root = roots.clone()
    root_positions = PROMPT_LEN + torch.randint(0, 16, (num_trials,), generator=generator)
    for _ in range(EMITTED):  # every step emits at least one token
        drafts = draft_tokens_for(tree.parents, root, ranking)
        idx_mapping = torch.randperm(num_trials, generator=generator)
        output, num_sampled, num_rejected = run_v2_step(runner, v2_tree_batch(root, drafts, root_positions,
                                                                               idx_mapping))
        order = idx_mapping.long()
        step = torch.full_like(output.sampled_token_ids, -1)
        step[order] = output.sampled_token_ids.long()
        sampled = torch.zeros(num_trials, dtype=torch.long)
        sampled[order] = num_sampled.long()
        assert bool((num_rejected.long() + num_sampled.long() == 1 + tree.num_nodes).all())
        for j in range(step.shape[1]):
            place = (count < EMITTED) & (j < sampled)
            emitted[place, count[place]] = step[place, j]
            count = count + place.long()
        root = step.gather(1, (sampled - 1)[:, None]).view(-1)  # the bonus: the next step's root
        root_positions = root_positions + sampled
    assert bool((count == EMITTED).all())
    return emitted


def judged_run(monkeypatch, tree_name: str, setting: str, seed: int, trials: int = TRIALS):
    tree = DraftTree.from_widths(TREES[tree_name])
    table = model_table()
    temperature, top_k, top_p = SETTINGS[setting]
    probs = sampling_distribution(table, temperature, top_p, top_k=top_k)
    roots = roots_for(trials)
    sampler = v2_sampler(monkeypatch, trials, setting, tree.num_nodes)
    with v2_kernels(monkeypatch, interpreted=False):
        emitted = run_trials(v2_runner(sampler, tree, table), tree, draft_ranking(model_logits()), roots, seed)
    return joint_test(emitted, probs, roots)


# -- tests ----------------------------------------------------------------------------------------------------------
def test_the_law_is_vllms_rule():
    """The judge's law is vLLM's: `sampling_distribution` keeps exactly the tokens V2's CPU top-k/top-p keeps
    (`apply_top_k_top_p`) on the model's rows, and the settings remove tokens (so an impossible token can show)."""
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p

    table = model_table()
    for temperature, top_k, top_p in SETTINGS.values():
        scaled = table / temperature
        kept = apply_top_k_top_p(scaled.clone(), torch.full((VOCAB,), top_k or VOCAB),
                                 torch.full((VOCAB,), top_p)).isfinite()
        assert torch.equal(kept, sampling_distribution(table, temperature, top_p, top_k=top_k) > 0)
    assert int((sampling_distribution(table, 0.7, 0.9) == 0).sum()) > 0


@pytest.mark.parametrize("setting", ["t1.0", "t0.7-p0.9"])
def test_twins_are_v2s_interpreted_kernels(monkeypatch, setting):
    """One V2 tree step ([2,2,1], 12 requests, 132 logits rows) through the adapter with V2's interpreted Triton
    kernels and with the twins: the same draw at every row, the same output."""
    tree = DraftTree.from_widths([2, 2, 1])
    num_reqs = 12
    table = model_table()
    sampler = v2_sampler(monkeypatch, num_reqs, setting, tree.num_nodes)
    generator = torch.Generator().manual_seed(5)
    roots = torch.randint(0, VOCAB, (num_reqs,), generator=generator)
    drafts = draft_tokens_for(tree.parents, roots, draft_ranking(model_logits()))
    root_positions = PROMPT_LEN + torch.randint(0, 1000, (num_reqs,), generator=generator)
    idx_mapping = torch.randperm(num_reqs, generator=generator)
    draws = []
    accept = v2_acceptance.accept_tree_rows

    def recording(step, row_draws, *args, **kwargs):
        draws.append(row_draws.clone())
        return accept(step, row_draws, *args, **kwargs)

    monkeypatch.setattr(v2_acceptance, "accept_tree_rows", recording)
    outputs = []
    for interpreted in (True, False):
        with v2_kernels(monkeypatch, interpreted):
            runner = v2_runner(sampler, tree, table)
            outputs.append(run_v2_step(runner, v2_tree_batch(roots, drafts, root_positions, idx_mapping)))
    (real, real_sampled, real_rejected), (twin, twin_sampled, twin_rejected) = outputs
    assert draws[0].numel() == num_reqs * (1 + tree.num_nodes) and torch.equal(draws[0], draws[1])
    assert torch.equal(real.sampled_token_ids, twin.sampled_token_ids)
    assert torch.equal(real_sampled, twin_sampled) and torch.equal(real_rejected, twin_rejected)
    assert int(real_sampled.sum()) > num_reqs  # drafts accepted: the walk went below the root
    assert len(set(draws[0].tolist())) > 2


@pytest.mark.parametrize("setting", SETTINGS)
@pytest.mark.parametrize("tree_name", TREES)
def test_v2_tree_sampling_emits_the_models_distribution(monkeypatch, tree_name, setting):
    seed = 100 * list(TREES).index(tree_name) + list(SETTINGS).index(setting)
    stat, dof, p, impossible = judged_run(monkeypatch, tree_name, setting, seed)
    print(f"{tree_name} {setting}: chi2={stat:.1f} dof={dof} p={p:.3g} impossible={impossible}")
    assert impossible == 0 and p > P_MIN, f"{tree_name} {setting}: chi2={stat:.1f} dof={dof} p={p:.2e}, {impossible}"


# Planted bugs, each in the adapter's path on V2's sampler.
def _parents_draw(monkeypatch, tree: DraftTree):
    accept = v2_acceptance.accept_tree_rows

    def planted(step, row_draws, cu_num_logits, *args):
        rows = cu_num_logits.long()[step.request_indices][:, None] + torch.arange(step.block_len)
        draws = row_draws.clone()
        draws[rows] = parents_draw(tree.parents, row_draws[rows])
        return accept(step, draws, cu_num_logits, *args)

    monkeypatch.setattr(v2_acceptance, "accept_tree_rows", planted)


def _root_position(monkeypatch, tree: DraftTree):
    def every_node_at_the_root(positions, step):
        block = step.token_indices.view(step.num_requests, step.block_len)
        positions[block] = positions[block[:, :1]]

    monkeypatch.setattr(v2_tree_runner, "override_positions", every_node_at_the_root)


def _chain_positions(monkeypatch, tree: DraftTree):
    monkeypatch.setattr(v2_tree_runner, "override_positions", lambda positions, step: None)


PLANTED = {"parents-draw": _parents_draw, "root-position": _root_position, "chain-positions": _chain_positions}
PLANTED_TRIALS = 5_000


@pytest.mark.parametrize("bug", PLANTED)
def test_planted_bug_fails(monkeypatch, bug):
    PLANTED[bug](monkeypatch, DraftTree.from_widths(TREES["2x2x1"]))
    stat, dof, p, impossible = judged_run(monkeypatch, "2x2x1", "t1.0", seed=7, trials=PLANTED_TRIALS)
    print(f"{bug}: chi2={stat:.1f} dof={dof} p={p:.2e} impossible={impossible}")
    assert p < P_MIN or impossible > 0, f"{bug} passed: chi2={stat:.1f} dof={dof} p={p:.2e}"
