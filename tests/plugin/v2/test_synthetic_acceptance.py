"""Synthetic tree acceptance on Model Runner V2's path, on CPU (seconds): the per-slot rates (`trees.synthetic`) read
once per request from its extra_args by the add_requests hook, refused at admission where the engine cannot take them,
and the real post-sampler body (`v2.acceptance.accept_and_commit_tree_rows`: walk, output rows, K/V compaction, GDN
counts) with the synthetic decision: per-request classes in one batch accept at their own rates, the bonus is V2's
draw, and the graphed body (`v2.accept_graphs`, its replay a stand-in running the captured body) equals the eager one
under the same random stream."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest
import torch
from vllm.sampling_params import SamplingParams

from tests.plugin.v2.test_accept_graphs import NUM_STATES, World, graphs_of, uniform_step
from tests.spec_decode.test_synthetic_acceptance import frequency_test
from vllm_treewy.tree import DraftTree
from vllm_treewy.vllm_plugin.trees.admission import synthetic_rates_refusal
from vllm_treewy.vllm_plugin.trees.synthetic import FIRST_CHILD_KEY, SIBLING_KEY, SyntheticTreeRates
from vllm_treewy.vllm_plugin.v2 import runner as v2_runner
from vllm_treewy.vllm_plugin.v2.acceptance import accept_and_commit_tree_rows
from vllm_treewy.vllm_plugin.v2.accepted_counts import CountedGroups

TREE = DraftTree.from_widths([2, 2, 1])
CODE = [[0.917, 0.913, 0.774], [0.4] * 3]
PROSE = [[0.55] * 3, [0.2] * 3]


def engine_spec(**extra):
    return SimpleNamespace(**{"is_draft_tree": True, "draft_tree": TREE, "draft_tree_widths": [2, 2, 1],
                              "draft_tree_depth": 3, "rejection_sample_method": "synthetic", FIRST_CHILD_KEY: CODE[0],
                              SIBLING_KEY: CODE[1], **extra})


def test_slots_take_the_requests_rates_over_the_engines():
    rates = SyntheticTreeRates.of(engine_spec(), NUM_STATES, "cpu")
    rates.add_request(3, {FIRST_CHILD_KEY: PROSE[0], SIBLING_KEY: PROSE[1]})
    rates.add_request(5, {SIBLING_KEY: [0.3, 0.3, 0.3]})  # only siblings: rank 0 stays the engine's
    rates.add_request(7, None)
    got = rates.by_slot[torch.tensor([3, 5, 7])]
    assert torch.allclose(got, torch.tensor([PROSE, [CODE[0], [0.3] * 3], CODE]))
    assert SyntheticTreeRates.of(engine_spec(rejection_sample_method="standard"), 4, "cpu") is None


def test_add_requests_hook_reads_each_new_request_once():
    spec = engine_spec()
    state = SimpleNamespace(synthetic=SyntheticTreeRates.of(spec, NUM_STATES, "cpu"))
    added = []
    runner = SimpleNamespace(speculator=SimpleNamespace(tree_state=state),
                             req_states=SimpleNamespace(req_id_to_index={"a": 2, "b": 9}))
    hook = v2_runner._adding_synthetic_rates(lambda self, out: added.append(out))
    new = [SimpleNamespace(req_id="a", sampling_params=SamplingParams(extra_args={FIRST_CHILD_KEY: PROSE[0]})),
           SimpleNamespace(req_id="b", sampling_params=SamplingParams())]
    hook(runner, SimpleNamespace(scheduled_new_reqs=new))
    assert len(added) == 1
    assert state.synthetic.by_slot[torch.tensor([2])][0, 0].tolist() == pytest.approx(PROSE[0])
    assert torch.allclose(state.synthetic.by_slot[torch.tensor([9])][0], torch.tensor(CODE))


@pytest.mark.parametrize("extra_args,spec,match", [
    ({FIRST_CHILD_KEY: [0.5, 0.5]}, engine_spec(), r"extra_args\['synthetic_tree_acceptance_rates'\] must be a list "
                                                   r"of 3 probabilities"),
    ({SIBLING_KEY: [0.5, 1.5, 0.5]}, engine_spec(), r"entries must be in \[0, 1\]"),
    ({SIBLING_KEY: [0.2] * 3}, engine_spec(**{FIRST_CHILD_KEY: None}), r"need an engine with "
                                                                        r"rejection_sample_method='synthetic'"),
])
def test_admission_refuses_rates_the_engine_cannot_take(extra_args, spec, match):
    message, parameter = synthetic_rates_refusal(SamplingParams(extra_args=extra_args), spec)
    assert parameter == "extra_args"
    assert re.search(match, message), message
    assert synthetic_rates_refusal(SamplingParams(extra_args={FIRST_CHILD_KEY: PROSE[0]}), engine_spec()) is None
    assert synthetic_rates_refusal(SamplingParams(), engine_spec(**{FIRST_CHILD_KEY: None})) is None


def test_the_body_accepts_each_request_at_its_rates_and_graphs_equal_eager():
    num_reqs, steps = 8, 400
    gen = torch.Generator().manual_seed(5)
    eager = World(seed=1)
    graphed = eager.clone()
    graphs = graphs_of(graphed, TREE, [num_reqs])
    rates = SyntheticTreeRates.of(engine_spec(), NUM_STATES, "cpu")
    graphs.synthetic = rates
    accepted = {0: [], 1: []}
    for index in range(steps):
        step, batch, draws = uniform_step(TREE, num_reqs, gen)
        for row, slot in enumerate(batch.idx_mapping.tolist()):  # classes alternate by batch row
            rates.add_request(slot, dict(zip((FIRST_CHILD_KEY, SIBLING_KEY), (CODE, PROSE)[row % 2])))
        step.attention_layers = eager.recorded_layers(batch.idx_mapping)
        torch.manual_seed(index)
        want = accept_and_commit_tree_rows(step, draws, batch.cu_num_logits, batch.input_ids, TREE.num_nodes,
                                           batch.idx_mapping, CountedGroups(eager.gdn_groups), rates)
        step.attention_layers = graphed.recorded_layers(batch.idx_mapping)
        torch.manual_seed(index)
        got = graphs.replay(step, draws, batch)
        for name in ("sampled", "num_sampled", "chain_rows"):
            assert torch.equal(getattr(got, name), getattr(want, name)), name
        assert all(torch.equal(a, b) for a, b in zip(got.acceptance, want.acceptance))
        assert all(torch.equal(a, b) for a, b in zip(graphed.state(), eager.state()))
        # the emitted rows: the accepted path's drafts, then V2's draw at the last accepted node
        block_len = 1 + TREE.num_nodes
        for r in range(num_reqs):
            path = [n for n in want.acceptance.accepted_nodes[r].tolist() if n >= 0]
            drafts = batch.input_ids[r * block_len + 1: (r + 1) * block_len].long()
            bonus = draws[r * block_len + (path[-1] + 1 if path else 0)]
            assert want.sampled[r, : len(path) + 1].tolist() == [int(drafts[n]) for n in path] + [int(bonus)]
        for row in range(num_reqs):
            accepted[row % 2].append(want.acceptance.accepted_nodes[row])
    for cls, class_rates in ((0, CODE), (1, PROSE)):
        _, _, p_value, frequencies = frequency_test(TREE.parents, torch.stack(accepted[cls]), class_rates)
        assert p_value > 1e-3, frequencies
