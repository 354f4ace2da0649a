"""Admission of requests on draft trees: the sampling parameters a runner's tree path does not make exact are refused
when the request arrives, with a VLLMValidationError naming them, instead of being sampled with the wrong context.

One mechanism for both runners (INPUT_PROCESSOR_VALIDATE_PARAMS wraps vLLM's `InputProcessor._validate_params`, in
the front end, before the request reaches the engine); each runner has its own list, below:
`REFUSED_ON_V1_TREES` (the V1 runner, `v1.runner`: vLLM's CPU backend, or CUDA with VLLM_USE_V2_MODEL_RUNNER=0)
and `REFUSED_ON_V2_TREES` (Model Runner V2, `v2.runner`). The runner is the one
`vllm_config.use_v2_model_runner` picks, as the engine does. Chains (no tree) are left to vLLM. Requests whose
extra_args set synthetic tree acceptance rates (`trees.synthetic`) are refused unless the engine is a synthetic tree
one and the rates are one probability per depth (`synthetic_rates_refusal`).
"""

from __future__ import annotations

import functools

from vllm.exceptions import VLLMValidationError

from vllm_treewy.vllm_plugin.config import draft_tree_of
from vllm_treewy.vllm_plugin.patch_points import INPUT_PROCESSOR_VALIDATE_PARAMS
from vllm_treewy.vllm_plugin.trees.synthetic import FIRST_CHILD_KEY, RATE_KEYS, request_rates


# What the V1 tree path does not make exact, as (name, neutral value); refused at admission:
# - thinking_token_budget: vLLM's `ThinkingBudgetStateHolder` counts a row's context as its committed output plus
#   `spec_token_ids` (a tree row's drafts in node order) and advances its state machine on every sampler call (the
#   level path calls it once per level), so a node's forced end-of-thinking lands at the wrong depth or not at all;
# - structured_outputs: the scheduler validates a row's drafts as a chain in node order (keeping them up to the
#   first node that does not follow its predecessor: a partial tree, which `find_tree_step` raises on) and fills the
#   grammar bitmask of draft position i from the grammar advanced over drafts 0 .. i - 1, which
#   `apply_grammar_bitmask` puts on the logits row of node i, not of its path.
# Penalties, bad words and seeds are exact on V1 (the level path hands vLLM each node's path).
REFUSED_ON_V1_TREES = (("thinking_token_budget", None), ("structured_outputs", None))


# What V2's tree path does not make exact (`v2.runner`'s docstring, 3.): its penalties and bad-words matching read a
# tree row's drafts in node order, its thinking-token budget counts a node's context as the root plus its place in
# node order, and a grammar's state follows one path. Refused at admission, as (name, neutral value).
REFUSED_ON_V2_TREES = (("repetition_penalty", 1.0), ("frequency_penalty", 0.0), ("presence_penalty", 0.0),
                       ("bad_words", None), ("thinking_token_budget", None), ("structured_outputs", None))


def refused_params(params, refused: tuple[tuple[str, object], ...]) -> list[str]:
    """The names of the parameters of `refused` ((name, neutral value) pairs) that `params` sets."""
    return [name for name, neutral in refused if getattr(params, name, neutral) not in (neutral, [])]


# What a refused request can do instead, per parameter: on the request, and on the server. Each alternative runs: a
# chain (the same --speculative-config without draft_tree_widths) applies vLLM's grammar to its drafts, vLLM's
# thinking budget needs a reasoning parser on any engine (vLLM refuses the budget without one), and the V1 runner's
# tree path samples penalties and bad words along each node's path.
_CHAIN = "serve an MTP chain (the same --speculative-config without draft_tree_widths)"
ALTERNATIVES = {
    "structured_outputs": f"send the request without response_format / structured_outputs, or {_CHAIN}, where vLLM "
                          "applies the grammar to the drafts",
    "thinking_token_budget": "send the request without thinking_token_budget (max_tokens bounds the whole answer), or "
                             f"{_CHAIN} with a reasoning parser (--reasoning-parser, e.g. qwen3 for Qwen3.5), which "
                             "vLLM's thinking budget needs",
}
_ON_V1 = ("send the request without them, or serve the tree on the V1 runner (VLLM_USE_V2_MODEL_RUNNER=0), where "
          "penalties and bad words are exact on trees")
ALTERNATIVES.update(dict.fromkeys(("repetition_penalty", "frequency_penalty", "presence_penalty", "bad_words"), _ON_V1))
# Why each is refused, per parameter (the comments above the lists say how).
REASONS = {
    "structured_outputs": "vLLM's grammar reads a row's drafts as one chain, so a tree node would be masked by the "
                          "grammar after other nodes' drafts",
    "thinking_token_budget": "vLLM's budget tracker counts a row's drafts as one chain, so a node's forced end of "
                             "thinking would land at the wrong depth",
}
REASONS.update(dict.fromkeys(("repetition_penalty", "frequency_penalty", "presence_penalty", "bad_words"),
                             "its penalties and bad words read a row's drafts as one chain, so a node would be "
                             "penalized for other nodes' drafts"))


def describe_setting(params, name: str) -> str:
    """A refused parameter as the user sent it: structured outputs by the public fields set (the OpenAI API's
    response_format arrives as them), never the params object's private state."""
    value = getattr(params, name)
    if name != "structured_outputs":
        return f"{name}={value!r}"
    fields = {f: getattr(value, f) for f in ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
              if getattr(value, f, None) not in (None, False)}
    shown = ", ".join(f"{f}={v!r}" for f, v in fields.items())
    return f"structured outputs (response_format / structured_outputs: {shown})"


def _runner_name(use_v2_model_runner: bool) -> str:
    return "Model Runner V2" if use_v2_model_runner else "the V1 model runner"


def tree_refusal(params, speculative_config, use_v2_model_runner: bool) -> tuple[str, str] | None:
    """`(message, first refused parameter)` when the request is refused on this engine's draft trees; None when
    admitted (or the engine has no tree). The message names each refused parameter as the user sent it, why, and
    what works instead (`ALTERNATIVES`)."""
    tree = draft_tree_of(speculative_config)  # the front end's read: it holds no runner-side object
    if tree is None:
        return None
    used = refused_params(params, REFUSED_ON_V2_TREES if use_v2_model_runner else REFUSED_ON_V1_TREES)
    if not used:
        return None
    widths = getattr(speculative_config, "draft_tree_widths", None)
    settings = ", ".join(describe_setting(params, name) for name in used)
    reasons = "; ".join(dict.fromkeys(REASONS[name] for name in used))
    alternatives = set(ALTERNATIVES[name] for name in used)
    # One alternative where the refused parameters share it; else the one that works for them all.
    instead = alternatives.pop() if len(alternatives) == 1 else f"send the request without {', '.join(used)}"
    return (f"{settings}: not supported with draft_tree_widths={widths} on {_runner_name(use_v2_model_runner)} "
            f"({reasons}). Instead, {instead}.", used[0])


def synthetic_rates_refusal(params, speculative_config) -> tuple[str, str] | None:
    """`(message, parameter)` when the request's extra_args set synthetic tree acceptance rates (`trees.synthetic`)
    that this engine cannot take: it has no synthetic tree acceptance, or they are not one probability per depth."""
    extra_args = getattr(params, "extra_args", None) or {}
    keys = [key for key in RATE_KEYS if key in extra_args]
    if not keys:
        return None
    synthetic_tree = (draft_tree_of(speculative_config) is not None
                      and getattr(speculative_config, FIRST_CHILD_KEY, None) is not None)
    if not synthetic_tree:
        return (f"extra_args[{keys[0]!r}]: synthetic tree acceptance rates need an engine with "
                "rejection_sample_method='synthetic' and draft_tree_widths (a benchmark engine); send the request "
                "without them", "extra_args")
    try:
        request_rates(extra_args, speculative_config.draft_tree_depth)
    except ValueError as error:
        return str(error), "extra_args"
    return None


def _refusing_tree_params(original):
    @functools.wraps(original)
    def validate(self, params, *args, **kwargs):
        if hasattr(params, "repetition_penalty"):  # SamplingParams (pooling requests have none of these)
            refusal = tree_refusal(params, self.speculative_config,
                                   bool(getattr(self.vllm_config, "use_v2_model_runner", False)))
            refusal = refusal or synthetic_rates_refusal(params, self.speculative_config)
            if refusal is not None:
                raise VLLMValidationError(refusal[0], parameter=refusal[1])
        return original(self, params, *args, **kwargs)

    return validate


def install() -> None:
    """Every platform with draft trees (CPU: the V1 runner; CUDA: either runner)."""
    INPUT_PROCESSOR_VALIDATE_PARAMS.wrap(_refusing_tree_params)
