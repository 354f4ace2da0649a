"""Admission on draft trees (`vllm_plugin/trees/admission.py`): each runner refuses the sampling parameters its tree
path does not make exact, with a VLLMValidationError naming them; on the V1 runner, a thinking-token budget and
structured outputs (`v1.runner.REFUSED_ON_V1_TREES`), on V2 also penalties and bad words
(`v2.runner.REFUSED_ON_V2_TREES`).

Why V1 refuses the thinking budget, on vLLM's real `Sampler` and `ThinkingBudgetStateHolder`: greedy requests on a
point-mass "model" (each think token's successor) with budgets 0 .. 5 and a prompt that opens a thinking section;
plain decoding (vLLM's tracker outside speculation, token by token) forces the end-of-thinking token once the budget
is spent. A tree step must emit the same tokens or be refused (`v1.sampler.refuse_thinking_budget`); with the
refusal planted away, vLLM's tracker reads the tree as a chain and the tree rows emit thinking tokens past the
budget, on the one-call path and on the level path alike (the level path as a budget alone reached it before: vLLM's
`spec_token_ids`, the drafts in node order, and the tracker's state advanced once per level).

Why V1 refuses structured outputs, on vLLM's real `StructuredOutputManager` with a toy grammar whose every path of
the tree is valid: the scheduler validates a row's drafts as a chain in node order (`validate_tokens`: it keeps them
up to the first node that does not follow its predecessor, a partial tree) and fills bitmask row i from the grammar
advanced over drafts 0 .. i - 1 (`grammar_bitmask`), which `apply_grammar_bitmask` puts on logits row i (a tree's
node i, whose path is not those drafts). The scheduler side cannot be made right from the runner, so the request is
refused at admission (a planted admission without it fails), and a grammar bitmask that reaches the V1 tree runner
raises before vLLM applies it (`v1.runner._refusing_grammar_on_trees`).
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from vllm_treewy.spec_decode.tree_sampling import sampled_tree_acceptance_reference
from vllm_treewy.tree import DraftTree
from vllm_treewy.vllm_plugin.trees import admission
from vllm_treewy.vllm_plugin.v1 import runner as v1_runner
from vllm_treewy.vllm_plugin.v1 import sampler as v1_sampler
from vllm_treewy.vllm_plugin.trees.step import find_tree_step

TREE = DraftTree.from_widths([2, 2, 1])
N = TREE.num_nodes


def tree_spec(widths=(2, 2, 1)):
    return SimpleNamespace(is_draft_tree=True, draft_tree=DraftTree.from_widths(list(widths)),
                           draft_tree_widths=list(widths))


# -- admission ---------------------------------------------------------------------------------------------------------
def _settings():
    from vllm.sampling_params import StructuredOutputsParams

    return {"repetition_penalty": 1.2, "frequency_penalty": 0.5, "presence_penalty": 0.5, "bad_words": ["a b c"],
            "thinking_token_budget": 16, "structured_outputs": StructuredOutputsParams(choice=["yes", "no"])}


REFUSED = {"v1": {"thinking_token_budget", "structured_outputs"},
           "v2": {"repetition_penalty", "frequency_penalty", "presence_penalty", "bad_words", "thinking_token_budget",
                  "structured_outputs"}}


@pytest.mark.parametrize("runner", ["v1", "v2"])
def test_each_runner_refuses_its_parameters_on_trees_and_nothing_on_chains(runner):
    from vllm import SamplingParams

    v2 = runner == "v2"
    assert admission.tree_refusal(SamplingParams(temperature=0.8), tree_spec(), v2) is None
    assert admission.tree_refusal(SamplingParams(temperature=0.8, min_p=0.1, top_k=3, logit_bias={3: 1.0}),
                                       tree_spec(), v2) is None  # per-row parameters: exact on a tree
    for field, value in _settings().items():
        refusal = admission.tree_refusal(SamplingParams(**{field: value}), tree_spec(), v2)
        assert (refusal is not None) == (field in REFUSED[runner]), field
        if refusal is not None:
            message, parameter = refusal
            assert parameter == field and field in message and "_backend" not in message
            assert ("Model Runner V2" if v2 else "the V1 model runner") in message
            assert message.endswith(admission.ALTERNATIVES[field] + ".")
        assert admission.tree_refusal(SamplingParams(**{field: value}), None, v2) is None  # chains: vLLM's
        chain = SimpleNamespace(is_draft_tree=False, draft_tree=None, draft_tree_widths=[1, 1, 1])
        assert admission.tree_refusal(SamplingParams(**{field: value}), chain, v2) is None


def test_a_refusal_shows_what_the_user_sent_and_one_alternative_that_works_for_every_parameter():
    """Structured outputs as the user's fields (response_format arrives as them), never the params' private state; a
    thinking budget is not sent to a chain without a reasoning parser (vLLM refuses it there too); several refused
    parameters with different alternatives get the one that works for all (send the request without them)."""
    from vllm import SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    message, _ = admission.tree_refusal(SamplingParams(structured_outputs=StructuredOutputsParams(json_object=True)),
                                        tree_spec(), False)
    assert message.startswith("structured outputs (response_format / structured_outputs: json_object=True)")
    assert "StructuredOutputsParams" not in message and "MTP chain" in message
    message, _ = admission.tree_refusal(SamplingParams(thinking_token_budget=4), tree_spec(), False)
    assert "--reasoning-parser" in message and "without thinking_token_budget" in message
    message, parameter = admission.tree_refusal(SamplingParams(presence_penalty=0.5, thinking_token_budget=4),
                                                tree_spec(), True)
    assert parameter == "presence_penalty"
    assert message.endswith("Instead, send the request without presence_penalty, thinking_token_budget."), message


def test_the_lists_are_the_runners_own():
    from vllm_treewy.vllm_plugin.v2 import runner as v2_runner

    assert {name for name, _ in admission.REFUSED_ON_V1_TREES} == REFUSED["v1"]
    assert {name for name, _ in admission.REFUSED_ON_V2_TREES} == REFUSED["v2"]


@pytest.mark.parametrize("runner", ["v1", "v2"])
def test_vllms_validate_params_refuses_a_grammar_request_on_trees(runner):
    """Through the installed wrapper of vLLM's `InputProcessor._validate_params` (what `register()` installs on this
    platform): a grammar request, and a thinking budget, are refused with the parameter named before vLLM's own
    checks run; a plain request reaches vLLM's checks."""
    from vllm import SamplingParams
    from vllm.exceptions import VLLMValidationError
    from vllm.sampling_params import StructuredOutputsParams
    from vllm.v1.engine.input_processor import InputProcessor

    from vllm_treewy.vllm_plugin import register

    register()
    processor = SimpleNamespace(vllm_config=SimpleNamespace(use_v2_model_runner=runner == "v2"),
                                speculative_config=tree_spec())
    for field, value in (("structured_outputs", StructuredOutputsParams(json={"type": "object"})),
                         ("thinking_token_budget", 8)):
        with pytest.raises(VLLMValidationError, match=field) as refused:
            InputProcessor._validate_params(processor, SamplingParams(**{field: value}), ("generate",))
        assert refused.value.parameter == field
    with pytest.raises(AttributeError):  # admitted: vLLM's own checks run (and need a real processor)
        InputProcessor._validate_params(processor, SamplingParams(temperature=0.5), ("generate",))


def test_the_wrapper_calls_vllm_only_for_admitted_requests():
    from vllm import SamplingParams
    from vllm.exceptions import VLLMValidationError

    calls = []

    class Processor:
        vllm_config = SimpleNamespace(use_v2_model_runner=False)
        speculative_config = tree_spec()

        def _validate_params(self, params, supported_tasks):
            calls.append(params)

    validate = admission._refusing_tree_params(Processor._validate_params)
    validate(Processor(), SamplingParams(repetition_penalty=1.1, bad_words=["x"]), ("generate",))  # exact on V1
    with pytest.raises(VLLMValidationError, match="thinking_token_budget"):
        validate(Processor(), SamplingParams(thinking_token_budget=4), ("generate",))
    Processor.vllm_config = SimpleNamespace(use_v2_model_runner=True)
    with pytest.raises(VLLMValidationError, match="repetition_penalty"):
        validate(Processor(), SamplingParams(repetition_penalty=1.1), ("generate",))
    assert len(calls) == 1


# -- a grammar bitmask on the V1 tree runner ---------------------------------------------------------------------------
class FakeRunner:
    """What `_refusing_grammar_on_trees` reads of vLLM's GPUModelRunner: its drafter's tree state."""

    def __init__(self, tree: bool):
        self.drafter = SimpleNamespace(tree_state=object() if tree else None)
        self.speculative_config = tree_spec() if tree else SimpleNamespace(is_draft_tree=False)

    def sample_tokens(self, grammar_output):
        self.applied = grammar_output  # stands for vLLM's apply_grammar_bitmask + sampling
        return "sampled"


def test_a_grammar_bitmask_never_reaches_tree_rows_on_v1():
    grammar = SimpleNamespace(structured_output_request_ids=["r0"], grammar_bitmask=np.zeros((4, 1), np.int32))
    sample_tokens = v1_runner._refusing_grammar_on_trees(FakeRunner.sample_tokens)
    tree, chain = FakeRunner(tree=True), FakeRunner(tree=False)
    assert sample_tokens(tree, None) == "sampled" and tree.applied is None
    with pytest.raises(NotImplementedError, match="structured outputs"):
        sample_tokens(tree, grammar)
    assert tree.applied is None  # vLLM's masking never ran on the tree rows
    assert sample_tokens(chain, grammar) == "sampled" and chain.applied is grammar  # chains: vLLM's


def test_the_grammar_guard_wraps_vllms_sample_tokens():
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from vllm_treewy.vllm_plugin import register

    register()
    assert getattr(GPUModelRunner.sample_tokens, "_treewy__refusing_grammar_on_trees", False)


# -- a thinking-token budget on V1 tree rows ---------------------------------------------------------------------------
VOCAB = 7
THINK_START, THINK_END = 5, 6
PROMPT = [1, 2, THINK_START]  # opens a thinking section: every output token counts against the budget
BUDGETS = [0, 1, 2, 3, 4, 5]  # forced end of thinking at output position 0 .. 5: before, inside and past the tree
NEVER = 4  # a token no row draws here: the bad word that sends a batch down the level path


def successor(token: int) -> int:
    return (token + 1) % THINK_START if token != THINK_END else 0


def model_table() -> torch.Tensor:
    """`[VOCAB, VOCAB]` logits after each token: its successor 200, the rest 0 (a point mass in float32)."""
    table = torch.zeros(VOCAB, VOCAB)
    for token in range(VOCAB):
        table[token, successor(token)] = 200.0
    return table


def budget_holder(num_spec_tokens: int, outputs: list[list[int]]):
    """vLLM's tracker holding one request per budget, as the persistent batch adds them (output lists by
    reference)."""
    from vllm.sampling_params import SamplingParams
    from vllm.v1.sample.logits_processor.interface import BatchUpdate
    from vllm.v1.sample.thinking_budget_state import ThinkingBudgetStateHolder

    holder = ThinkingBudgetStateHolder(
        SimpleNamespace(reasoning_start_token_ids=[THINK_START], reasoning_end_token_ids=[THINK_END]),
        len(outputs), num_spec_tokens, torch.device("cpu"), False)
    holder.sync_batch(BatchUpdate(batch_size=len(outputs), removed=[], moved=[], added=[
        (i, SamplingParams(thinking_token_budget=budget), list(PROMPT), outputs[i])
        for i, budget in enumerate(BUDGETS[: len(outputs)])]))
    return holder


def greedy_metadata(outputs, holder, spec_token_ids):
    from vllm.v1.sample.logits_processor import LogitsProcessors
    from vllm.v1.sample.metadata import SamplingMetadata

    n = len(outputs)
    return SamplingMetadata(
        temperature=None, all_greedy=True, all_random=False, top_p=None, top_k=None, generators={},
        max_num_logprobs=None, no_penalties=True, prompt_token_ids=None, frequency_penalties=torch.zeros(n),
        presence_penalties=torch.zeros(n), repetition_penalties=torch.ones(n), output_token_ids=outputs,
        allowed_token_ids_mask=None, bad_words_token_ids={}, logitsprocs=LogitsProcessors([]),
        spec_token_ids=spec_token_ids, thinking_budget_state_holder=holder)


def plain_decoding(length: int) -> list[list[int]]:
    """Each request's first `length` tokens without speculation: vLLM's sampler and tracker, one token a step."""
    from vllm.v1.sample.sampler import Sampler

    outputs = [[] for _ in BUDGETS]
    holder, table = budget_holder(0, outputs), model_table()
    for _ in range(length):
        last = [output[-1] if output else PROMPT[-1] for output in outputs]
        drawn = Sampler()(table[torch.tensor(last)], greedy_metadata(outputs, holder, [[] for _ in outputs]))
        for output, token in zip(outputs, drawn.sampled_token_ids.view(-1).tolist()):
            output.append(token)
    return outputs


def drafts_below(root: int) -> list[int]:
    """Node tokens: a first child carries its parent's successor, a second child the end of thinking (so the tree
    holds the forced token where plain decoding forces it, whatever the budget)."""
    tokens, seen = [], {}
    for parent in TREE.parents:
        rank = seen.get(parent, 0)
        seen[parent] = rank + 1
        tokens.append(successor(root if parent < 0 else tokens[parent]) if rank == 0 else THINK_END)
    return tokens


ROUTES = ("one-call", "levels", "levels-as-before")


def tree_step_rows(route: str, monkeypatch) -> tuple[list[list[int]] | None, list[list[int]]]:
    """(what one V1 tree step after the first token emits, None when refused; what plain decoding emits there).
    Routes: the one-call path (where a budget alone sends a batch now), the level path with the path on the host
    (a bad word sends the batch there), and the level path with vLLM's `spec_token_ids` (the drafts in node order)
    as a budget alone sent a batch before the refusal."""
    from vllm.v1.sample.sampler import Sampler

    plain = plain_decoding(2 + TREE.max_depth)
    outputs = [[] for _ in BUDGETS]
    holder, table = budget_holder(N, outputs), model_table()
    first = Sampler()(table[torch.full((len(BUDGETS),), PROMPT[-1])],
                      greedy_metadata(outputs, holder, [[] for _ in outputs]))  # the prefill's token
    for output, token in zip(outputs, first.sampled_token_ids.view(-1).tolist()):
        output.append(token)
    assert [output[:1] for output in plain] == outputs

    drafts = [drafts_below(output[-1]) for output in outputs]
    num_drafts = np.full(len(BUDGETS), N)
    query_start_loc = np.concatenate([[0], np.cumsum(num_drafts + 1)])
    step = find_tree_step(TREE, num_drafts, num_drafts, query_start_loc, np.full(len(BUDGETS), 50),
                          torch.device("cpu"))
    spec = SimpleNamespace(cu_num_sampled_tokens=torch.from_numpy(query_start_loc[1:]).int(),
                           draft_token_ids=torch.tensor([t for d in drafts for t in d], dtype=torch.int32))
    tokens = torch.tensor([t for output, d in zip(outputs, drafts) for t in [output[-1], *d]])
    metadata = greedy_metadata(outputs, holder, drafts)  # vLLM's spec_token_ids: each row's drafts, node order
    if route == "levels":
        metadata = dataclasses.replace(metadata, bad_words_token_ids={0: [[NEVER]]})
    if route == "levels-as-before":
        monkeypatch.setattr(v1_sampler, "_needs_level_path", lambda metadata: True)
    assert v1_sampler._needs_level_path(metadata) == route.startswith("levels")

    expected = []
    for output, d, reference in zip(outputs, drafts, plain):
        path, bonus = sampled_tree_acceptance_reference(
            TREE.parents, d, lambda walked: torch.nn.functional.one_hot(
                torch.tensor(reference[1 + len(walked)]), VOCAB).double(), torch.Generator())
        emitted = [d[n] for n in path] + [bonus]
        assert emitted == reference[1: 1 + len(emitted)]
        expected.append(emitted + [-1] * (1 + N - len(emitted)))
    try:
        out, _, _ = v1_sampler.sample_with_trees(table[tokens], spec, step, Sampler(), metadata)
    except NotImplementedError as refused:
        assert "thinking_token_budget" in str(refused)
        return None, expected
    return out.tolist(), expected


def test_the_budgets_force_the_end_of_thinking_at_every_depth_of_the_step():
    """Plain decoding forces the end of thinking at the root, at depths 1, 2 and 3, and past the tree."""
    plain = plain_decoding(2 + TREE.max_depth)
    firsts = {output.index(THINK_END) if THINK_END in output else None for output in plain}
    assert {0, 1, 2, 3, 4, None} <= firsts, plain


@pytest.mark.parametrize("route", ROUTES)
def test_v1_tree_rows_emit_what_plain_decoding_would_or_are_refused(route, monkeypatch):
    got, expected = tree_step_rows(route, monkeypatch)
    assert got is None or got == expected, (got, expected)


@pytest.mark.parametrize("route", ROUTES)
def test_planted_missing_refusal_fails(monkeypatch, route):
    """Without the refusal, vLLM's tracker reads the tree as a chain (on every route): requests emit thinking tokens
    past their budget (the test above would fail)."""
    monkeypatch.setattr(v1_sampler, "refuse_thinking_budget", lambda metadata: None)
    got, expected = tree_step_rows(route, monkeypatch)
    assert got is not None and got != expected
    late = [b for b, g, e in zip(BUDGETS, got, expected) if THINK_END in e[: TREE.max_depth + 1] and g != e]
    assert late, (got, expected)


# -- a grammar on V1 tree rows -----------------------------------------------------------------------------------------
GRAMMAR_VOCAB = 32  # one bitmask word


class DoublingGrammar:
    """A toy `StructuredOutputGrammar`: after token s the grammar allows exactly 2s and 2s + 1 (mod 32), so its
    state is the last token and every node of `doubling_drafts` is allowed after its parent."""

    def __init__(self, root: int):
        self.accepted = [root]

    def allowed(self, state: int) -> set[int]:
        return {(2 * state) % GRAMMAR_VOCAB, (2 * state + 1) % GRAMMAR_VOCAB}

    def accept_tokens(self, request_id, tokens) -> bool:
        for token in tokens:
            if token not in self.allowed(self.accepted[-1]):
                return False
            self.accepted.append(token)
        return True

    def validate_tokens(self, tokens) -> list[int]:
        state, valid = self.accepted[-1], []
        for token in tokens:
            if token not in self.allowed(state):
                break
            valid.append(token)
            state = token
        return valid

    def rollback(self, num_tokens: int) -> None:
        del self.accepted[len(self.accepted) - num_tokens:]

    def fill_bitmask(self, bitmask: torch.Tensor, index: int) -> None:
        bitmask[index] = bitmask_of(self.allowed(self.accepted[-1]))

    def is_terminated(self) -> bool:
        return False

    def reset(self) -> None:
        del self.accepted[1:]


def bitmask_of(tokens: set[int]) -> int:
    word = sum(1 << t for t in tokens)
    return word - (1 << 32) if word >= 1 << 31 else word  # int32


def doubling_drafts(root: int) -> list[int]:
    """Node tokens that follow the grammar on every path: a first child 2s, a second child 2s + 1."""
    tokens, seen = [], {}
    for parent in TREE.parents:
        rank = seen.get(parent, 0)
        seen[parent] = rank + 1
        tokens.append((2 * (root if parent < 0 else tokens[parent]) + rank) % GRAMMAR_VOCAB)
    return tokens


def vllms_grammar_view(root: int, drafts: list[int]) -> tuple[list[int], list[int]]:
    """What vLLM 0.32's structured-output manager makes of a row's drafts: the drafts the scheduler keeps
    (`validate_tokens`, `Scheduler.update_draft_token_ids`) and the bitmask of each verified row, root first
    (`grammar_bitmask`, the rows `apply_grammar_bitmask` puts on the row's logits in order)."""
    import vllm.v1.structured_output as structured_output

    manager = object.__new__(structured_output.StructuredOutputManager)
    manager.vllm_config = SimpleNamespace(num_speculative_tokens=N, scheduler_config=SimpleNamespace(max_num_seqs=1),
                                          model_config=SimpleNamespace(is_diffusion=False))
    manager.backend = SimpleNamespace(allocate_token_bitmask=lambda n: torch.zeros(n, 1, dtype=torch.int32))
    manager.enable_in_reasoning, manager.fill_bitmask_parallel_threshold = True, 128
    manager._grammar_bitmask, manager._full_mask = None, torch.tensor(-1, dtype=torch.int32)
    request = SimpleNamespace(use_structured_output=True,
                              structured_output_request=SimpleNamespace(grammar=DoublingGrammar(root)))
    kept = manager.validate_tokens(request, list(drafts))
    rows = manager.grammar_bitmask({"r": request}, ["r"], {"r": list(drafts)})
    return kept, rows[:, 0].tolist()


def test_v1_tree_rows_get_each_nodes_grammar_or_are_refused():
    """Exact would be: the scheduler keeps every node (each is allowed after its parent) and node i's row is masked
    by the grammar after node i's path. vLLM validates and masks the drafts as a chain in node order: it keeps the
    drafts up to the first node that is not its predecessor's child (a partial tree, which `find_tree_step` raises
    on) and masks a sibling's row by the grammar after its elder sibling. So V1 trees refuse grammar requests."""
    from vllm import SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    root = 3
    drafts = doubling_drafts(root)
    grammar = DoublingGrammar(root)
    per_path = [bitmask_of(grammar.allowed(token)) for token in [root, *drafts]]
    kept, rows = vllms_grammar_view(root, drafts)
    assert kept == drafts[:1] and rows[:2] == per_path[:2] and rows != per_path  # vLLM's chain view
    refusal = admission.tree_refusal(SamplingParams(structured_outputs=StructuredOutputsParams(regex="a+")),
                                          tree_spec(), use_v2_model_runner=False)
    assert refusal is not None or (kept == drafts and rows == per_path)


def test_planted_grammar_admission_fails(monkeypatch):
    monkeypatch.setattr(admission, "REFUSED_ON_V1_TREES", (("thinking_token_budget", None),))
    with pytest.raises(AssertionError):
        test_v1_tree_rows_get_each_nodes_grammar_or_are_refused()
