"""Sampled tree acceptance emits the target's distribution exactly (`spec_decode.tree_sampling`), on a model whose
probabilities are known.

The "model": a vocabulary of VOCAB tokens and a seeded table of logits for the next token given the last one; the
sampling distribution p(. | last) is that row through temperature and top-p (vLLM's rule, `sampling_distribution`).
Drafts are deterministic: at every node the tree's children carry the top tokens of a different, seeded *draft*
table (correlated with the target's, so drafts are accepted often but not always). A trial starts at a root token
and runs speculative steps (`sampled_tree_acceptance` over a batch of TRIALS requests at once, `sample_rows` drawing
with `torch.multinomial` from the row's known distribution and a seeded generator), each step re-rooted at the
previous step's bonus, until EMITTED tokens are out. Their joint distribution is known exactly:
p(y1 | root) p(y2 | y1) p(y3 | y2) (VOCAB ** 3 cells). Pearson's chi-square against it, cells of expectation < 5
pooled into one, and no token of probability 0 ever emitted.

Both ways of drawing run: level by level (`sampled_tree_acceptance`, one draw per request and level at its current
node) and every node at once (`sampled_tree_acceptance_of_draws`: one independent draw at every verified token in
one call, the walk reading those at the nodes it visits), as the adapter's two sampling paths do.

Threshold: p > P_MIN = 1e-3 for each of the module's exactness checks (22 of them: with an exact sampler the chance
that any fails is below 2.2 %, Bonferroni; every generator is seeded, so the verdict is fixed). The planted bugs
(first child accepted whenever p(c) > 0; a child drawn from its parent's distribution; one draw reused at every
level; with every node's draw at once: the walk reading the draw of the node's parent instead of the node's, or the
root's draw at every node) reach p < 1e-50 with the same trials.
"""

from __future__ import annotations

import pytest
import torch

from tests.chi_square import chi2_sf
from vllm_treewy.spec_decode.acceptance import (
    UniformWalkTables,
    greedy_tree_acceptance,
    uniform_tree_acceptance,
    verified_block_offsets,
    walk_tree,
)
from vllm_treewy.spec_decode.tree_sampling import (
    sampled_tree_acceptance,
    sampled_tree_acceptance_of_draws,
    sampled_tree_acceptance_reference,
)
from vllm_treewy.tree import DraftTree, node_requests, pack_trees

VOCAB = 7
EMITTED = 3
TRIALS = 20_000
REFERENCE_TRIALS = 3_000
P_MIN = 1e-3
MODEL_SEED, DRAFT_SEED = 1234, 5678
SETTINGS = {"t1.0": (1.0, 1.0), "t0.7-p0.9": (0.7, 0.9)}
TREES = {  # parent arrays
    "2x1x1": DraftTree.from_widths([2, 1, 1]).parents,
    "2x2x1": DraftTree.from_widths([2, 2, 1]).parents,
    "3x2": DraftTree.from_widths([3, 2]).parents,
    "chain3": DraftTree.from_widths([1, 1, 1]).parents,
    "4": DraftTree.from_widths([4]).parents,  # depth 1: the root's top 4, every node a leaf
    "irregular": (-1, -1, 0, 0, 0, 1, 2, 5),  # 2 children at the root, 3 and 1 below, a leaf at depth 3
}


# -- the known model ---------------------------------------------------------------------------------------------
def sampling_distribution(logits: torch.Tensor, temperature: float, top_p: float, top_k: int = 0) -> torch.Tensor:
    """Rows of logits -> sampling probabilities as vLLM's rule gives them, float64: logits / T; top-k (ties at the
    k-th value kept; 0: off); top-p over the renormalised rest (ascending sort, drop cumulative probability
    <= 1 - top_p, always keep the largest)."""
    z = logits.double() / temperature
    if 0 < top_k < z.shape[-1]:
        kth = z.sort(dim=-1, descending=True).values[..., top_k - 1 : top_k]
        z = z.masked_fill(z < kth, float("-inf"))
    p = torch.softmax(z, dim=-1)
    if top_p >= 1.0:
        return p
    sorted_p, order = p.sort(dim=-1)
    dropped = sorted_p.cumsum(-1) <= 1 - top_p
    dropped[..., -1] = False
    p = p.scatter(-1, order, sorted_p.masked_fill(dropped, 0.0))
    return p / p.sum(-1, keepdim=True)


def model_logits() -> torch.Tensor:
    return 1.5 * torch.randn(VOCAB, VOCAB, generator=torch.Generator().manual_seed(MODEL_SEED), dtype=torch.float64)


def draft_ranking(target_logits: torch.Tensor) -> torch.Tensor:
    """``[VOCAB, VOCAB]``: row t = the draft's tokens after t, best first (the target's logits plus seeded noise)."""
    noise = torch.randn(VOCAB, VOCAB, generator=torch.Generator().manual_seed(DRAFT_SEED), dtype=torch.float64)
    return (target_logits + 1.5 * noise).argsort(dim=-1, descending=True)


def sibling_ranks(parents) -> list[int]:
    seen: dict[int, int] = {}
    ranks = []
    for parent in parents:
        ranks.append(seen.get(parent, 0))
        seen[parent] = ranks[-1] + 1
    return ranks


def draft_tokens_for(parents, roots: torch.Tensor, ranking: torch.Tensor) -> torch.Tensor:
    """``[B, N]`` deterministic drafts below each root: node n carries the draft's choice number (n's rank among
    its siblings) after its parent's token."""
    ranks = sibling_ranks(parents)
    tokens = torch.empty(roots.numel(), len(parents), dtype=torch.long)
    for n, parent in enumerate(parents):
        above = roots if parent < 0 else tokens[:, parent]
        tokens[:, n] = ranking[above, ranks[n]]
    return tokens


# -- every node's draw at once -------------------------------------------------------------------------------------
def node_draws_of(parents, cu_nodes, sample_rows) -> torch.Tensor:
    """``[B, 1 + N]``: one draw at every verified token of the packed uniform trees, in one call of ``sample_rows``
    (independent draws, as one sampler call over every logits row makes them)."""
    num_requests = cu_nodes.numel() - 1
    block_len = 1 + parents.numel() // max(num_requests, 1)
    return sample_rows(0, torch.arange(num_requests * block_len)).view(num_requests, block_len)


def every_node_at_once(parents, cu_nodes, draft_tokens, max_depth, sample_rows, reading=None):
    """``sampled_tree_acceptance``'s signature over ``sampled_tree_acceptance_of_draws`` (every request drafts the
    same tree): the draws at every node first, then the walk. ``reading(tree_parents, draws)`` plants a bug: the
    draws the walk is given instead."""
    num_requests = cu_nodes.numel() - 1
    tree_parents = tuple(parents.view(num_requests, -1)[0].tolist())
    draws = node_draws_of(parents, cu_nodes, sample_rows)
    if reading is not None:
        draws = reading(tree_parents, draws)
    return sampled_tree_acceptance_of_draws(UniformWalkTables.of(tree_parents, "cpu"),
                                            draft_tokens.view(num_requests, -1), draws)


PATHS = {"levels": sampled_tree_acceptance, "every-node": every_node_at_once}


# -- speculative steps over a batch of trials --------------------------------------------------------------------
def run_trials(parents, probs: torch.Tensor, ranking: torch.Tensor, roots: torch.Tensor, seed: int,
               acceptance=sampled_tree_acceptance) -> torch.Tensor:
    """``[B, EMITTED]`` tokens emitted from each root by speculative steps until EMITTED are out."""
    generator = torch.Generator().manual_seed(seed)
    num_trials = roots.numel()
    packed = pack_trees([parents] * num_trials)
    emitted = torch.full((num_trials, EMITTED), -1, dtype=torch.long)
    count = torch.zeros(num_trials, dtype=torch.long)
    root = roots.clone()
    for _ in range(EMITTED):  # every step emits at least one token
        drafts = draft_tokens_for(parents, root, ranking)
        verified = torch.cat([root[:, None], drafts], dim=1).view(-1)  # packed verified blocks' tokens

        def sample_rows(level: int, rows: torch.Tensor, verified=verified) -> torch.Tensor:
            return torch.multinomial(probs[verified[rows]], 1, generator=generator).view(-1)

        sample_rows.probs_at = lambda rows, verified=verified: probs[verified[rows]]  # for a planted bug only

        result = acceptance(packed.parents, packed.cu_nodes, drafts.view(-1), packed.max_depth, sample_rows)
        path = torch.where(result.accepted_nodes >= 0, drafts.gather(1, result.accepted_nodes.clamp(min=0)), -1)
        step = torch.cat([path, torch.full_like(path[:, :1], -1)], dim=1)
        step.scatter_(1, result.num_accepted[:, None], result.bonus_tokens[:, None])
        for j in range(step.shape[1]):
            place = (count < EMITTED) & (step[:, j] >= 0)
            emitted[place, count[place]] = step[place, j]
            count = count + place.long()
        root = result.bonus_tokens
    assert bool((count == EMITTED).all())
    return emitted


def run_reference_trials(parents, probs: torch.Tensor, ranking: torch.Tensor, roots: torch.Tensor, seed: int
                         ) -> torch.Tensor:
    """The same with `sampled_tree_acceptance_reference`, one trial and one step at a time."""
    generator = torch.Generator().manual_seed(seed)
    out = []
    for root in roots.tolist():
        tokens: list[int] = []
        while len(tokens) < EMITTED:
            drafts = draft_tokens_for(parents, torch.tensor([root]), ranking)[0].tolist()

            def distribution_at(path_tokens, root=root):
                return probs[path_tokens[-1] if path_tokens else root]

            path, bonus = sampled_tree_acceptance_reference(parents, drafts, distribution_at, generator)
            tokens += [drafts[n] for n in path] + [bonus]
            root = bonus
        out.append(tokens[:EMITTED])
    return torch.tensor(out)


# -- the judge ---------------------------------------------------------------------------------------------------
def expected_counts(probs: torch.Tensor, roots: torch.Tensor) -> torch.Tensor:
    """Expected counts of every emitted tuple, exact: sum over roots of p(y1 | root) p(y2 | y1) p(y3 | y2)."""
    start = torch.bincount(roots, minlength=VOCAB).double()
    joint = start @ probs  # [y1]
    for _ in range(EMITTED - 1):
        last = torch.arange(joint.numel()) % VOCAB  # the tuple's last token
        joint = (joint[:, None] * probs[last]).flatten()
    return joint


def joint_test(emitted: torch.Tensor, probs: torch.Tensor, roots: torch.Tensor) -> tuple[float, int, float, int]:
    """(statistic, dof, p-value, emitted tuples of probability 0) against the exact joint law."""
    index = torch.zeros(emitted.shape[0], dtype=torch.long)
    for j in range(EMITTED):
        index = index * VOCAB + emitted[:, j]
    observed = torch.bincount(index, minlength=VOCAB ** EMITTED).double()
    expected = expected_counts(probs, roots)
    impossible = int(observed[expected == 0].sum())
    big = expected >= 5
    o = torch.cat([observed[big], observed[~big].sum()[None]])
    e = torch.cat([expected[big], expected[~big].sum()[None]])
    keep = e > 0
    o, e = o[keep], e[keep]
    stat = float(((o - e) ** 2 / e).sum())
    dof = int(keep.sum()) - 1
    return stat, dof, chi2_sf(stat, dof), impossible


def case(setting: str):
    logits = model_logits()
    probs = sampling_distribution(logits, *SETTINGS[setting])
    return probs, draft_ranking(logits)


def _seed(tree: str, setting: str) -> int:
    return 1000 * list(TREES).index(tree) + list(SETTINGS).index(setting)


def roots_for(num_trials: int) -> torch.Tensor:
    return torch.arange(num_trials) % VOCAB  # every root token, equally often


# -- tests -------------------------------------------------------------------------------------------------------
def test_the_model_rejects_drafts_often():
    """The drafts are the target's argmax about half the time: acceptance is partial, and both the accepted and
    the rejected branches of the rule are exercised (a test with drafts always right would be blind)."""
    logits = model_logits()
    ranking = draft_ranking(logits)
    probs = sampling_distribution(logits, 1.0, 1.0)
    first_choice_right = (ranking[:, 0] == probs.argmax(-1)).double().mean()
    assert 0.2 < first_choice_right < 0.9, first_choice_right
    top2_mass = probs.gather(1, ranking[:, :2]).sum(-1)
    assert 0.2 < float(top2_mass.mean()) < 0.8, top2_mass
    assert int((sampling_distribution(logits, 0.7, 0.9) == 0).sum()) > 0  # top-p removes tokens


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("setting", SETTINGS)
@pytest.mark.parametrize("tree", TREES)
def test_emitted_tokens_follow_the_target_exactly(tree, setting, path):
    probs, ranking = case(setting)
    roots = roots_for(TRIALS)
    emitted = run_trials(TREES[tree], probs, ranking, roots, seed=_seed(tree, setting), acceptance=PATHS[path])
    stat, dof, p, impossible = joint_test(emitted, probs, roots)
    print(f"{tree} {setting} {path}: chi2={stat:.1f} dof={dof} p={p:.3g}")
    assert impossible == 0 and p > P_MIN, (f"{tree} {setting} {path}: chi2={stat:.1f} dof={dof} p={p:.2e}, "
                                           f"{impossible} impossible")


@pytest.mark.parametrize("setting", SETTINGS)
def test_reference_follows_the_target_exactly(setting):
    probs, ranking = case(setting)
    roots = roots_for(REFERENCE_TRIALS)
    emitted = run_reference_trials(TREES["2x2x1"], probs, ranking, roots, seed=7)
    stat, dof, p, impossible = joint_test(emitted, probs, roots)
    print(f"reference {setting}: chi2={stat:.1f} dof={dof} p={p:.3g}")
    assert impossible == 0 and p > P_MIN, f"reference {setting}: chi2={stat:.1f} dof={dof} p={p:.2e}, {impossible}"


# Planted bugs: each replaces `sampled_tree_acceptance` in the same trials.
def _first_child(parents, cu_nodes, current):
    num_nodes = parents.numel()
    request_of_node = node_requests(cu_nodes.long(), num_nodes)
    is_child = parents.long() == current[request_of_node]
    return torch.full_like(current, num_nodes).scatter_reduce(
        0, request_of_node, torch.where(is_child, torch.arange(num_nodes), num_nodes), reduce="amin")


def accepts_first_child(parents, cu_nodes, draft_tokens, max_depth, sample_rows):
    """Accepts the first child whenever its probability is > 0 (else draws)."""
    block_start = verified_block_offsets(cu_nodes)[:-1]

    def draw_at(level, current):
        drawn = sample_rows(level, block_start + 1 + current)
        first = _first_child(parents, cu_nodes, current)
        has_child = first < parents.numel()
        child_token = draft_tokens[first.clamp(max=parents.numel() - 1)]
        p_child = sample_rows.probs_at(block_start + 1 + current).gather(1, child_token[:, None]).view(-1)
        return torch.where(has_child & (p_child > 0), child_token, drawn)

    return walk_tree(parents, cu_nodes, draft_tokens, max_depth, draw_at)


def parents_distribution_at_children(parents, cu_nodes, draft_tokens, max_depth, sample_rows):
    """Draws at a node from its parent's row (the root's at the root)."""
    block_start = verified_block_offsets(cu_nodes)[:-1]
    local_parents = parents.long()

    def draw_at(level, current):
        node = (cu_nodes[:-1].long() + current).clamp(min=0)
        parent = torch.where(current >= 0, local_parents[node.clamp(max=max(parents.numel() - 1, 0))], -1)
        return sample_rows(level, block_start + 1 + parent)

    return walk_tree(parents, cu_nodes, draft_tokens, max_depth, draw_at)


def one_draw_for_all_levels(parents, cu_nodes, draft_tokens, max_depth, sample_rows):
    """Draws once per step (from the right rows) and answers every level with the first level's draw."""
    block_start = verified_block_offsets(cu_nodes)[:-1]
    first: list[torch.Tensor] = []

    def draw_at(level, current):
        drawn = sample_rows(level, block_start + 1 + current)
        if not first:
            first.append(drawn)
        return first[0]

    return walk_tree(parents, cu_nodes, draft_tokens, max_depth, draw_at)


def parents_draw(tree_parents, draws):
    """Every node's draw replaced by its parent's (the root keeps its own): the walk reads, at a node, the draw made
    at its parent."""
    return draws[:, [0] + [parent + 1 for parent in tree_parents]]


def roots_draw(tree_parents, draws):
    """The root's draw at every node."""
    return draws[:, :1].expand_as(draws)


PLANTED = {"first-child": accepts_first_child, "parent-distribution": parents_distribution_at_children,
           "one-draw": one_draw_for_all_levels,
           "every-node-parents-draw": lambda *a: every_node_at_once(*a, reading=parents_draw),
           "every-node-roots-draw": lambda *a: every_node_at_once(*a, reading=roots_draw)}


@pytest.mark.parametrize("setting", SETTINGS)
@pytest.mark.parametrize("bug", PLANTED)
def test_planted_bug_fails(bug, setting):
    probs, ranking = case(setting)
    roots = roots_for(TRIALS)
    parents = TREES["2x2x1"]
    emitted = run_trials(parents, probs, ranking, roots, seed=11, acceptance=PLANTED[bug])
    stat, dof, p, impossible = joint_test(emitted, probs, roots)
    assert p < P_MIN or impossible > 0, f"{bug} {setting} passed: chi2={stat:.1f} dof={dof} p={p:.2e}"
    print(f"{bug} {setting}: chi2={stat:.1f} dof={dof} p={p:.2e} impossible={impossible}")


def test_greedy_is_greedy_tree_acceptance():
    """Point masses at random argmaxes: the sampled walk is `greedy_tree_acceptance`, every field, on random trees
    (siblings with repeated tokens included) packed in batches."""
    generator = torch.Generator().manual_seed(99)
    trees = list(TREES.values()) + [(), (-1,), (-1, -1, -1, -1)]
    for trial in range(200):
        batch = [trees[int(i)] for i in torch.randint(len(trees), (int(torch.randint(1, 6, (1,), generator=generator)),),
                                                       generator=generator)]
        packed = pack_trees(batch)
        vocab = int(torch.randint(2, 5, (1,), generator=generator))
        drafts = torch.randint(vocab, (packed.num_nodes,), generator=generator)
        argmax = torch.randint(vocab, (packed.num_nodes + len(batch),), generator=generator)
        point_masses = torch.nn.functional.one_hot(argmax, vocab).double()
        depth = packed.max_depth + int(trial % 3 == 0)  # a bound above the depth too

        def sample_rows(level, rows):
            return torch.multinomial(point_masses[rows], 1, generator=generator).view(-1)

        sampled = sampled_tree_acceptance(packed.parents, packed.cu_nodes, drafts, depth, sample_rows)
        greedy = greedy_tree_acceptance(packed.parents, packed.cu_nodes, drafts, argmax, depth)
        for name, a, b in zip(greedy._fields, sampled, greedy):
            assert torch.equal(a, b), (trial, name, batch, a, b)


def test_uniform_walk_is_greedy_tree_acceptance():
    """``uniform_tree_acceptance`` (every request the same tree, the tokens at every node given at once, a fixed
    number of ops) returns ``greedy_tree_acceptance``'s result, every field and dtype, on random tokens over small
    vocabularies (siblings with equal tokens, matches at several depths), for every tree of the module and more."""
    generator = torch.Generator().manual_seed(98)
    trees = [*TREES.values(), (-1,), (-1, -1, -1, -1), DraftTree.from_widths([3, 2, 2]).parents,
             DraftTree.from_widths([4, 2]).parents]
    for trial in range(600):
        parents = trees[trial % len(trees)]
        num_requests = int(torch.randint(1, 6, (1,), generator=generator))
        packed = pack_trees([parents] * num_requests)
        vocab = int(torch.randint(2, 4, (1,), generator=generator))
        drafts = torch.randint(vocab, (num_requests, len(parents)), generator=generator)
        tokens = torch.randint(vocab, (num_requests, 1 + len(parents)), generator=generator)
        greedy = greedy_tree_acceptance(packed.parents, packed.cu_nodes, drafts.view(-1), tokens.view(-1),
                                        packed.max_depth)
        uniform = uniform_tree_acceptance(UniformWalkTables.of(parents, "cpu"), drafts, tokens)
        for name, a, b in zip(greedy._fields, uniform, greedy):
            assert a.dtype == b.dtype and torch.equal(a, b), (trial, name, parents, drafts, tokens, a, b)


def test_the_judge_has_power():
    """The chi-square of this module tells a temperature 0.9 sampler from a 1.0 one at TRIALS (a bug of the kind
    vLLM's CPU rejection sampler has: the wrong temperature)."""
    logits = model_logits()
    roots = roots_for(TRIALS)
    generator = torch.Generator().manual_seed(3)
    wrong = sampling_distribution(logits, 0.9, 1.0)
    y = [roots]
    for _ in range(EMITTED):
        y.append(torch.multinomial(wrong[y[-1]], 1, generator=generator).view(-1))
    _, _, p, _ = joint_test(torch.stack(y[1:], dim=1), sampling_distribution(logits, 1.0, 1.0), roots)
    print(f"temperature 0.9 judged as 1.0: p={p:.3g}")
    assert p < P_MIN, p
