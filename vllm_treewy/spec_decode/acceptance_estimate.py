"""Per-request acceptance estimates for choosing, every step, between a draft tree and the chain of its depth.

What the scheduler sees of a step, per request: which shape its drafts had (the tree, or a chain of k <= D drafts: a
chain may be cut shorter by the step's token budget) and how many drafts were accepted (m). It does not see which
sibling rank was accepted. So the estimate is of *continuations*: per shape and depth d = 1 .. D, the probability
that the walk, having reached depth d - 1's accepted node (the root for d = 1), accepts a node at depth d. A step of
depth k (the tree: D; a chain: k) that accepted m drafts is a trial at depths 1 .. min(m + 1, k) and a continue at
depths 1 .. m: depth m + 1 was tried and failed, unless the step had no depth m + 1.

Ranks are identified through the two shapes. Under the synthetic acceptance model (`synthetic_acceptance`: per depth a
rank-0 rate r_d and one rate s_d for every later sibling) a chain continues at depth d with c_chain = r_d, and a tree
whose nodes of depth d - 1 have w_d children with

    1 - c_tree = (1 - c_chain) (1 - s_d) ** (w_d - 1),

so the two shapes' continuations give both rates, and either shape's continuation gives the other's for a known s_d.
Where w_d = 1 the tree's depth-d node is its parent's rank-0 child and both shapes continue alike: their counts pool.
The expected acceptance length of a shape (the bonus token included) is ``1 + sum_d prod_{j <= d} c_j`` for its
continuations: every node of one tree depth has the same subtree below it, so the walk continues from depth d
whichever rank it took there. This is ``1 + synthetic_acceptance.expected_accepted_nodes`` for both shapes.

Counts. Per row (a request; the scheduler maps request ids to rows and calls ``reset`` when it reuses one) and per
shape and depth: decayed trials n and misses (trials that did not continue). Each observation first decays that row's
counts of both shapes by ``2 ** (-1 / half_life)``: after ``half_life`` further steps of the row an observation weighs
half, so a request whose acceptance changes is followed within a computable number of its steps (``steps_to_move``).
The same observations also go into an engine-wide pool, decayed ``2 ** (-1 / engine_half_life)`` per observation
(the observations of one ``observe`` call count as simultaneous: the pool decays by the call's count of them, then
adds each at weight 1). The pool is every row's prior, so a new request starts at what the engine has seen.

Estimates (``continuation``). With p = ``prior_weight`` pseudo-trials (> 0, so no denominator is ever 0), a row's
continuation of a shape is the Beta posterior mean ``(k + p * prior) / (n + p)`` (k = n - misses). The prior of a
shape is the engine pool's estimate of that shape, moved towards what the row's counts of the *other* shape imply for
it through the relation above (weight n_other / (n_other + p)), with s_d the pooled sibling rate: a batch runs one
shape for long stretches, and the shape it does not run must follow the row through the one it does. The pool's own
estimates are made the same way with a neutral prior (rank-0 rate ``NEUTRAL_RANK0_RATE``): a shape the pool has
(almost) no trials of is derived from the other shape. A tree continues at least as often as the chain (its rank-0
path is the chain), so the tree's estimate is never below the chain's. Every estimate lies in [0, 1].

The pooled sibling rate. In misses the relation is a product: a tree misses at depth d ``keep_d = (1 - s_d) ** (w_d
- 1)`` times as often as the chain. Each observation is compared with the same row's record of the other shape, at
the same exposure: a tree step adds its misses, weighted by the row's chain trials n as ``n / (n + p)``, to a tree
side, and its trials times the row's chain misses over ``n + p`` to a chain side; a chain step the other way round.
Summed engine-wide with the pool's decay, ``keep = (tree side + p * keep_0) / (chain side + p)``, keep_0 from
``default_sibling_rate`` (0.3: EAGLE-style heads report a second candidate accepted 0.2 - 0.5 of the time) until the
evidence outweighs it. Comparing within rows keeps the requests' differing acceptance, and the different times each
shape ran at, out of it: the pool's tree counts and chain counts come from different requests at different times (the
batch runs the chain while its requests are code-like, the tree while prose-like), and their ratio would say so. At
depths with w_d = 1 no data identifies s_d and it stays the default.

Arrays: ``rows`` int64 row indices, unique within one call, in [0, max_rows); estimates are float64, axis -2 indexed
by shape (``TREE`` = 0, ``CHAIN`` = 1), axis -1 by depth - 1. ``rates`` is laid out as the synthetic sampler's: axis
-2 is (rank 0, later sibling). Nothing here imports vllm; the per-step calls are vectorised over rows.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

TREE, CHAIN = 0, 1  # the shapes, axis -2 of a continuation array
DEFAULT_SIBLING_RATE = 0.3  # EAGLE-style heads: a second candidate accepted 0.2 - 0.5 of the time
NEUTRAL_RANK0_RATE = 0.5  # the rank-0 rate assumed where nothing has been observed (a fresh engine)
_TRIALS, _MISSES = 0, 1  # axis 1 of the counts
_LOG_FLOOR = 1e-300  # floor of 1 - c under a log, and of keep (a divisor)


def steps_to_move(half_life: float, fraction: float) -> int:
    """The number of a row's steps after which the observations from before a change weigh at most ``1 - fraction``
    of its depth-1 counts: ``ceil(half_life * log2(1 / (1 - fraction)))`` (one step is one depth-1 trial, and in
    steady state old trials weigh ``2 ** (-n / half_life)`` after n steps). Its depth-1 continuation, of both shapes,
    has then moved ``fraction`` of the way from the old value to the new (less the prior's pull, ``prior_weight``
    pseudo-trials against the ``1 / (1 - 2 ** (-1 / half_life))`` ~ 1.44 ``half_life`` trials of steady state).
    Deeper depths follow as fast in trials but get a trial only when the walk reaches them."""
    if not 0.0 <= fraction < 1.0:
        raise ValueError(f"fraction = {fraction}: expected 0 <= fraction < 1")
    return math.ceil(half_life * math.log2(1.0 / (1.0 - fraction)) - 1e-9)


def tree_continuation(rank0: np.ndarray, sibling: np.ndarray, widths: Sequence[int]) -> np.ndarray:
    """``[..., D]``: the tree's continuation per depth from the rank-0 and sibling rates ``[..., D]``:
    ``1 - (1 - rank0) * (1 - sibling) ** (w_d - 1)``."""
    exponent = np.asarray(widths, dtype=np.float64) - 1.0
    return 1.0 - (1.0 - rank0) * (1.0 - sibling) ** exponent


def continuations_of_rates(rates: np.ndarray, widths: Sequence[int]) -> np.ndarray:
    """``[..., 2, D]`` continuations (TREE, CHAIN) of the synthetic rates ``[..., 2, D]`` (rank 0, later sibling)."""
    rates = np.asarray(rates, dtype=np.float64)
    rank0, sibling = rates[..., 0, :], rates[..., 1, :]
    return np.stack([tree_continuation(rank0, sibling, widths), rank0], axis=-2)


def implied_sibling_rate(tree: np.ndarray, chain: np.ndarray, widths: Sequence[int],
                         fallback: np.ndarray | float) -> np.ndarray:
    """``[..., D]``: the sibling rate for which a chain continuing at ``chain`` makes the tree continue at ``tree``
    (``1 - ((1 - tree) / (1 - chain)) ** (1 / (w_d - 1))``, 0 where the tree continues no more than the chain),
    ``fallback`` at depths with w_d = 1 (no sibling there) or where the chain always continues (nothing to tell)."""
    exponent = np.asarray(widths, dtype=np.float64) - 1.0
    log_ratio = np.log(np.maximum(1.0 - tree, _LOG_FLOOR)) - np.log(np.maximum(1.0 - chain, _LOG_FLOOR))
    implied = -np.expm1(np.minimum(log_ratio, 0.0) / np.maximum(exponent, 1.0))
    identified = (exponent > 0) & (1.0 - chain > 1e-12)
    return np.clip(np.where(identified, implied, fallback), 0.0, 1.0)


def expected_lengths(continuations: np.ndarray) -> np.ndarray:
    """``[..., S]``: ``1 + sum_d prod_{j <= d} c_j`` of continuations ``[..., S, D]``: the mean acceptance length,
    the bonus token included."""
    return 1.0 + np.cumprod(continuations, axis=-1).sum(axis=-1)


def step_counts(shape: int, step_depth: int, num_accepted: int, depth: int) -> np.ndarray:
    """``[2 (trials, misses), D]``: what one step adds at each depth (module docstring): a trial at depths 1 ..
    min(m + 1, k), a miss at depth m + 1 if k > m, for a step of depth k (``depth`` for the tree) that accepted m
    (at most k)."""
    step_depth = depth if shape == TREE else min(step_depth, depth)
    accepted = min(num_accepted, step_depth)
    levels = np.arange(depth)
    return np.stack([levels < min(accepted + 1, step_depth), (levels == accepted) & (accepted < step_depth)]).astype(
        np.float64)


def _misses(counts: np.ndarray, weighted_prior: np.ndarray, keep_factor: np.ndarray, transfer: np.ndarray,
            prior_weight: float) -> np.ndarray:
    """``[2 (shapes), D, R]`` posterior misses (1 - continuation) from decayed ``counts [2 (trials, misses),
    2 (shapes), D, R]`` (at depths with w_d = 1 both shapes hold the pooled counts), ``weighted_prior [2, D, 1]``
    (``prior_weight`` times the prior's misses per shape), ``keep_factor [2, D, 1]`` (``(1 - s) ** (w - 1)`` and its
    inverse: a chain's miss times the first is the tree's, a tree's times the second the chain's) and ``transfer
    [D, 1]`` (0 where w_d = 1: the pooled counts are not transferred to themselves). Module docstring; in misses the
    relation is a product."""
    trials, misses = counts
    denominator = trials + prior_weight
    own = (misses + weighted_prior) / denominator
    transferred = np.minimum(own[::-1] * keep_factor, 1.0)  # the other shape's misses, as this shape's
    other_trials = trials[::-1] * transfer
    shape_prior = (other_trials * transferred + weighted_prior) / (other_trials + prior_weight)
    result = (misses + prior_weight * shape_prior) / denominator
    np.minimum(result[TREE], result[CHAIN], out=result[TREE])  # the tree contains the chain
    return result


class AcceptanceTable:
    """Decayed acceptance counts per request row and engine-wide, and the continuations, rates and expected lengths
    they give (module docstring).

    ``widths``: the tree's widths w_1 .. w_D (the chain is the tree's depth D); ``max_rows``: rows the scheduler may
    use; ``half_life``: a row's steps after which an observation weighs half; ``prior_weight``: pseudo-trials of the
    prior (> 0); ``engine_half_life``: observations (row steps, all rows together) after which one weighs half in the
    engine pool; ``default_sibling_rate``: the sibling rate assumed until the pool identifies one.
    """

    def __init__(self, widths: Sequence[int], max_rows: int, half_life: float, prior_weight: float = 2.0,
                 engine_half_life: float = 4096.0, default_sibling_rate: float = DEFAULT_SIBLING_RATE):
        widths = tuple(int(w) for w in widths)
        if not widths or min(widths) < 1:
            raise ValueError(f"widths = {widths}: expected positive widths, at least one depth")
        if max_rows < 1 or half_life <= 0 or engine_half_life <= 0 or prior_weight <= 0:
            raise ValueError("max_rows >= 1, half_life > 0, engine_half_life > 0 and prior_weight > 0 expected")
        if not 0.0 <= default_sibling_rate < 1.0:
            raise ValueError(f"default_sibling_rate = {default_sibling_rate}: expected in [0, 1)")
        self.widths = widths
        self.depth = depth = len(widths)
        self.max_rows = max_rows
        self.half_life = float(half_life)
        self.engine_half_life = float(engine_half_life)
        self.prior_weight = float(prior_weight)
        self.default_sibling_rate = float(default_sibling_rate)
        self._row_decay = 2.0 ** (-1.0 / half_life)
        self._engine_decay = 2.0 ** (-1.0 / engine_half_life)
        self._transfer = np.array([[1.0 if w > 1 else 0.0] for w in widths])  # [D, 1]
        self._default_keep = [(1.0 - default_sibling_rate) ** (w - 1) for w in widths]
        # What a step adds to a row's counts [2 (shapes), 2 (trials, misses), D], per outcome: the tree's by m,
        # the chain's by k * (D + 1) + m; where w_d = 1 an observation counts for both shapes
        self._adds = []
        for shape, outcomes in ((TREE, [(depth, m) for m in range(depth + 1)]),
                                (CHAIN, [(k, m) for k in range(depth + 1) for m in range(depth + 1)])):
            adds = np.zeros((len(outcomes), 2, 2, depth))
            for index, (k, m) in enumerate(outcomes):
                counts = step_counts(shape, k, m, depth)
                adds[index, shape] = counts
                adds[index, 1 - shape] = counts * (1.0 - self._transfer[:, 0])
            self._adds.append(adds)
        self._counts = np.zeros((max_rows, 2, 2, depth))  # row, shape, (trials, misses), depth
        self._pool = np.zeros((2, 2, depth))  # shape, (trials, misses), depth
        self._ones = np.ones(max_rows)
        self._keep_evidence = np.zeros((2, depth))  # (tree side, chain side): their ratio is keep
        self._engine: _EngineEstimates | None = None  # cached until the next observe

    def observe(self, rows: np.ndarray, shape: int, num_drafts: np.ndarray, num_accepted: np.ndarray) -> np.ndarray:
        """One step of ``rows`` (unique) that drafted ``shape``: ``num_drafts [R]`` drafts each (read for CHAIN only:
        a chain of k <= D drafts has depth k; a tree is verified whole, depth D) and ``num_accepted [R]`` of them
        accepted. A row with no drafts (depth 0) is not an observation: its counts do not decay. Returns the step's
        own counts of ``shape`` summed over the rows, ``[2 (trials, misses), D]`` (undecayed, for counters)."""
        rows = np.asarray(rows)
        outcomes = np.asarray(num_accepted)
        if shape == CHAIN:
            step_depth = np.asarray(num_drafts)
            if not step_depth.all():
                drafted = step_depth > 0
                rows, outcomes, step_depth = rows[drafted], outcomes[drafted], step_depth[drafted]
            outcomes = step_depth * (self.depth + 1) + np.minimum(outcomes, step_depth)
        elif shape != TREE:
            raise ValueError(f"shape = {shape}: expected TREE ({TREE}) or CHAIN ({CHAIN})")
        adds = self._adds[shape]
        step = adds.take(outcomes, axis=0)  # [R, shape, (trials, misses), D]
        record = self._counts.take(rows, axis=0)
        # the step against the row's record of the other shape (the pooled sibling rate: module docstring): per
        # depth, (sum of the step's misses x n / (n + p), sum of its trials x f / (n + p)) for the record's trials n
        # and misses f
        other = record[:, 1 - shape]
        products = step[:, shape, ::-1] * (other / (other[:, :1] + self.prior_weight))
        sides = (self._ones[:len(rows)] @ products.reshape(len(rows), 2 * self.depth)).reshape(2, self.depth)
        engine_decay = self._engine_decay ** len(rows)
        self._keep_evidence *= engine_decay
        self._keep_evidence += sides if shape == TREE else sides[::-1]  # (tree side, chain side)
        self._counts[rows] = record * self._row_decay + step
        added = (np.bincount(outcomes, minlength=len(adds)) @ adds.reshape(len(adds), -1)).reshape(self._pool.shape)
        self._pool *= engine_decay
        self._pool += added
        self._engine = None
        return added[shape]

    def reset(self, rows: np.ndarray) -> None:
        """Forget ``rows`` (reused by new requests): they start again at the engine pool's estimates."""
        self._counts[np.asarray(rows)] = 0.0

    def continuation(self, rows: np.ndarray) -> np.ndarray:
        """``[R, 2, D]`` float64: per row, shape (TREE, CHAIN) and depth, the posterior continuation."""
        return np.clip(1.0 - self._row_misses(rows).transpose(2, 0, 1), 0.0, 1.0)  # in [0, 1] but for rounding

    def rates(self, rows: np.ndarray) -> np.ndarray:
        """``[R, 2, D]`` float64 in the synthetic sampler's layout: axis 1 is (rank 0 = the chain's continuation,
        later sibling = the rate the two shapes' continuations imply; the pooled one at depths with w_d = 1)."""
        continuation = self.continuation(rows)
        sibling = implied_sibling_rate(continuation[:, TREE], continuation[:, CHAIN], self.widths,
                                       self.pooled_sibling_rate())
        return np.stack([continuation[:, CHAIN], sibling], axis=1)

    def expected_length(self, rows: np.ndarray) -> np.ndarray:
        """``[R, 2]`` float64: per row, the expected acceptance length (bonus included) of the tree and the chain."""
        return self._lengths(rows).T

    def total_expected_length(self, rows: np.ndarray) -> np.ndarray:
        """``[2]`` float64: ``expected_length(rows)`` summed over the rows, the batch's expected tokens a step of the
        tree and of the chain."""
        return self._lengths(rows).sum(axis=1)

    def _lengths(self, rows: np.ndarray) -> np.ndarray:
        """``[2, R]`` expected lengths."""
        continuation = 1.0 - self._row_misses(rows)  # [2, D, R]
        reached = continuation[:, 0]
        length = 1.0 + reached
        for depth in range(1, self.depth):  # cumprod along a short axis costs more than D products
            reached = reached * continuation[:, depth]
            length += reached
        return length

    def pooled_sibling_rate(self) -> np.ndarray:
        """``[D]``: the engine-wide sibling rate the shapes' estimates are related through (the default at depths
        with w_d = 1)."""
        keep = self._engine_estimates().keep_factor[0, :, 0]
        exponent = np.maximum(np.array(self.widths) - 1.0, 1.0)
        return np.where(self._transfer[:, 0] > 0, -np.expm1(np.log(keep) / exponent), self.default_sibling_rate)

    def engine_continuation(self) -> np.ndarray:
        """``[2, D]``: the engine pool's continuations, every fresh row's prior."""
        return np.clip(1.0 - self._engine_estimates().weighted_prior[:, :, 0] / self.prior_weight, 0.0, 1.0)

    def _row_misses(self, rows: np.ndarray) -> np.ndarray:
        """``[2, D, R]`` posterior misses."""
        engine = self._engine_estimates()
        counts = np.ascontiguousarray(self._counts.take(np.asarray(rows), axis=0).transpose(2, 1, 3, 0))
        return _misses(counts, engine.weighted_prior, engine.keep_factor, self._transfer, self.prior_weight)

    def _engine_estimates(self) -> _EngineEstimates:
        """The pooled keep factor and the pool's posterior misses: ``_misses``' rule with the neutral prior, in floats
        depth by depth (a handful of numbers, which numpy's calls would cost more than the arithmetic)."""
        if self._engine is not None:
            return self._engine
        p, neutral = self.prior_weight, 1.0 - NEUTRAL_RANK0_RATE
        (tree_side, chain_side), ((tree_trials, tree_misses), (chain_trials, chain_misses)) = (
            self._keep_evidence.tolist(), self._pool.tolist())
        keep, tree, chain = [], [], []
        for d, width in enumerate(self.widths):
            transfer, keep_d = (0.0, 1.0) if width == 1 else (1.0, min(max(
                (tree_side[d] + p * self._default_keep[d]) / (chain_side[d] + p), _LOG_FLOOR), 1.0))
            n_tree, n_chain = tree_trials[d], chain_trials[d]
            prior_tree, prior_chain = p * neutral * keep_d, p * neutral  # weighted, as _misses takes them
            own_tree = (tree_misses[d] + prior_tree) / (n_tree + p)
            own_chain = (chain_misses[d] + prior_chain) / (n_chain + p)
            moved_tree, moved_chain = n_tree * transfer, n_chain * transfer
            tree_prior = (moved_chain * keep_d * own_chain + prior_tree) / (moved_chain + p)
            chain_prior = (moved_tree * min(own_tree / keep_d, 1.0) + prior_chain) / (moved_tree + p)
            chain.append((chain_misses[d] + p * chain_prior) / (n_chain + p))
            tree.append(min((tree_misses[d] + p * tree_prior) / (n_tree + p), chain[-1]))
            keep.append(keep_d)
        self._engine = _EngineEstimates(p * np.array([tree, chain])[..., None],
                                        np.array([keep, [1.0 / k for k in keep]])[..., None])
        return self._engine


class _EngineEstimates(NamedTuple):
    weighted_prior: np.ndarray  # [2, D, 1] prior_weight times the pool's posterior misses: the rows' prior
    keep_factor: np.ndarray  # [2, D, 1] (1 - s) ** (w - 1) for the pooled sibling rate s, and its inverse
