"""The soak's parts without a server (`bench/soak`): the seeded mix is reproducible and holds every kind, a
refusal's message is judged by the parameter it names, and the metrics check fails on each inconsistency it looks
for (a planted one each)."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest

from bench.soak import checks, mix, table
from bench.soak.driver import judge_answer
from bench.sweep.metrics import Sample

CTX = mix.MixContext("m", [[1, 2, 3], list(range(40))], 320, 4, 0.15, 0.15)


def test_the_mix_is_seeded_and_holds_every_kind():
    first, again = list(mix.plan(600, 3, CTX)), list(mix.plan(600, 3, CTX))
    assert [(p.kind, p.args, p.action) for p in first] == [(p.kind, p.args, p.action) for p in again]
    assert {p.kind for p in first} == set(mix.WEIGHTS)
    assert {p.action for p in first} == {"read", "stream", "disconnect", "abort"}
    assert all(p.action in ("read", "stream") for p in first if p.kind not in mix.ABORTABLE)
    for p in first:
        assert (p.expect == "ok") == (p.param is None), p
        if p.kind == "long_prompt":
            assert len(p.args["prompt"]) + p.args["max_tokens"] <= CTX.max_model_len
        if p.kind == "too_long_prompt":
            assert len(p.args["prompt"]) > CTX.max_model_len


def test_skipped_kinds_stay_out_of_the_mix():
    ctx = dataclasses.replace(CTX, skip_kinds=("structured_outputs", "response_format"))
    assert {p.kind for p in mix.plan(600, 3, ctx)} == set(mix.WEIGHTS) - {"structured_outputs", "response_format"}


def answer(n=1, tokens=3, finish="length", logprobs=None):
    choice = SimpleNamespace(text="x", finish_reason=finish, logprobs=logprobs)
    return SimpleNamespace(choices=[choice] * n, usage=SimpleNamespace(completion_tokens=tokens))


def test_an_answer_is_held_to_its_parameters():
    planned = mix.Planned(0, "min_tokens", "completions", {}, "ok", checks={"max_tokens": 4, "min_tokens": 3})
    assert judge_answer(planned, answer(tokens=3)) == ""
    assert "under min_tokens" in judge_answer(planned, answer(tokens=2))
    assert "over" in judge_answer(planned, answer(tokens=5))
    assert "choices" in judge_answer(planned, answer(n=2, tokens=6))
    planned.checks = {"max_tokens": 4, "logprobs": True}
    assert judge_answer(planned, answer()) == "no logprobs"


def spec_samples(accepted_per_pos, drafts=10, draft_tokens=100, fallbacks=0.0):
    samples = [Sample(checks.DRAFTS, {}, drafts), Sample(checks.DRAFT_TOKENS, {}, draft_tokens),
               Sample(checks.ACCEPTED, {}, sum(accepted_per_pos))]
    samples += [Sample(checks.PER_POSITION, {"position": str(i)}, v) for i, v in enumerate(accepted_per_pos)]
    return samples + ([Sample(checks.FALLBACKS, {}, fallbacks)] if fallbacks is not None else [])


@pytest.mark.parametrize("per_pos, tree, fallbacks, problem", [
    ([8, 6, 4, 0, 0], True, 0.0, None),
    ([8, 6, 4, 1, 0], True, 0.0, "beyond depth"),
    ([6, 8, 4], False, None, "deeper position"),
    ([8, 6, 4], True, None, "treewy_tree_fallbacks"),
    ([10, 10, 10], False, None, None),
])
def test_the_metrics_check_finds_each_inconsistency(per_pos, tree, fallbacks, problem):
    ok, detail = checks.spec_metrics(spec_samples(per_pos, fallbacks=fallbacks), 3, tree)
    assert ok == (problem is None) and (problem is None or any(problem in p for p in detail["problems"])), detail


def test_more_accepted_than_drafted_fails():
    ok, detail = checks.spec_metrics(spec_samples([10, 10, 10], drafts=10, draft_tokens=20), 3, False)
    assert not ok and "accepted > drafted tokens" in detail["problems"]


def test_the_table_has_a_row_per_kind_and_server():
    summary = {"strategies": [{"strategy": "tree", "by_kind": {"bad_n": 1, "penalties": 2}, "refusals": [
        {"kind": "bad_n", "status": 400, "message": "Error code: 400 - n must be at least 1, got 0.", "count": 1}]}]}
    assert table.rows([summary]) == [
        (table.SENT["penalties"], "[2,2,1] tree (CPU, V1 runner)", "200", "accepted"),
        (table.SENT["bad_n"], "[2,2,1] tree (CPU, V1 runner)", "400", "n must be at least 1, got 0.")]


def test_the_servers_are_the_readmes_commands():
    import json
    from pathlib import Path

    from bench.soak.server import README_SPECS

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    for spec in README_SPECS.values():
        assert json.dumps(spec, separators=(",", ":")) in readme, spec
