"""The soak's request mix: a seeded random sequence of requests of named kinds, each with what the server must answer.

A `Planned` request is an OpenAI API call (completions or chat, its arguments), what the client does to it (read it
whole, stream it, drop the stream after a few chunks, or abort it before the answer) and what the answer must be:
`ok` (200, checked against its parameters), `refused` (a 4xx whose message names `param`) or `either` (accepted or
refused as the engine's configuration decides: the tree path's refusals, vLLM's own; a 4xx must still name `param`).
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass, field

# Relative weights of the kinds in the mix.
WEIGHTS = {
    "greedy": 8, "sampled": 6, "seeded": 4, "n_best": 3, "logprobs": 3, "chat_logprobs": 2, "stop": 3,
    "penalties": 3, "min_tokens": 3, "structured_outputs": 2, "response_format": 2, "thinking_budget": 2,
    "long_prompt": 4, "too_long_prompt": 1, "max_tokens_1": 3, "empty_prompt": 1, "empty_chat": 1, "chat": 4,
    "bad_temperature": 1, "bad_top_p": 1, "bad_n": 1, "bad_max_tokens": 1, "bad_logprobs": 1, "bad_model": 1,
}  # fmt: skip
# Kinds whose answer is a generation the client can drop or abort.
ABORTABLE = {"greedy", "sampled", "seeded", "n_best", "logprobs", "stop", "min_tokens", "long_prompt", "chat",
             "max_tokens_1"}
# What the tree path and vLLM may refuse, by kind: the parameter a refusal must name.
EITHER = {"penalties": "penalty", "structured_outputs": "structured_outputs", "response_format": "response_format",
          "thinking_budget": "thinking_token_budget", "empty_prompt": "prompt", "empty_chat": "messages"}
REFUSED = {"too_long_prompt": "context length", "bad_temperature": "temperature", "bad_top_p": "top_p",
           "bad_n": "n", "bad_max_tokens": "max_tokens", "bad_logprobs": "logprobs", "bad_model": "model"}


@dataclass
class Planned:
    index: int
    kind: str
    endpoint: str  # "completions" or "chat"
    args: dict
    expect: str  # "ok", "refused" or "either"
    param: str | None = None  # what a refusal's message must name
    action: str = "read"  # "read", "stream", "disconnect" (drop the stream after `after_chunks`), "abort"
    after_chunks: int = 0
    abort_after_s: float = 0.0
    checks: dict = field(default_factory=dict)  # what an accepted answer must show


@dataclass(frozen=True)
class MixContext:
    model: str
    prompts: list  # token-id prompts (the fixture's)
    max_model_len: int
    max_tokens: int  # the mix's largest max_tokens
    p_disconnect: float
    p_abort: float
    skip_kinds: tuple[str, ...] = ()  # kinds left out of the mix (e.g. where a site lacks a grammar backend)


def _prompt(rng: random.Random, ctx: MixContext) -> list[int]:
    return list(rng.choice(ctx.prompts))


def _long_prompt(rng: random.Random, ctx: MixContext, length: int) -> list[int]:
    tokens: list[int] = []
    while len(tokens) < length:
        tokens += rng.choice(ctx.prompts)
    return tokens[:length]


def _text(rng: random.Random) -> str:
    return rng.choice(["Simple is better than complex.", "Beautiful is better than ugly.",
                       "Errors should never pass silently.", "Now is better than never."])


def plan_request(index: int, kind: str, rng: random.Random, ctx: MixContext) -> Planned:
    m = rng.randint(2, ctx.max_tokens)
    base = {"model": ctx.model, "max_tokens": m}
    completion = {**base, "prompt": _prompt(rng, ctx)}
    chat = {**base, "messages": [{"role": "user", "content": _text(rng)}]}
    p = Planned(index, kind, "completions", completion, "ok", checks={"max_tokens": m})
    if kind == "greedy":
        p.args.update(temperature=0)
    elif kind == "sampled":
        p.args.update(temperature=0.8, top_p=0.9, extra_body={"top_k": 20})
    elif kind == "seeded":
        p.args.update(temperature=1.0, seed=rng.randint(0, 2**31 - 1))
    elif kind == "n_best":
        n = rng.randint(2, 4)
        p.args.update(temperature=0.8, n=n)
        p.checks["n"] = n
    elif kind == "logprobs":
        p.args.update(temperature=0.7, logprobs=3)
        p.checks["logprobs"] = True
    elif kind == "chat_logprobs":
        p = Planned(index, kind, "chat", {**chat, "temperature": 0.7, "logprobs": True, "top_logprobs": 2}, "ok",
                    checks={"max_tokens": m, "logprobs": True})
    elif kind == "stop":
        p.args.update(temperature=0.5, stop=[".", " is"])
    elif kind == "penalties":
        p.args.update(temperature=0.8, presence_penalty=0.5, frequency_penalty=0.3,
                      extra_body={"repetition_penalty": 1.1})
    elif kind == "min_tokens":
        p.args.update(temperature=0.8, max_tokens=max(m, 4), extra_body={"min_tokens": 3})
        p.checks.update(max_tokens=max(m, 4), min_tokens=3)
    elif kind == "structured_outputs":
        p = Planned(index, kind, "chat", {**chat, "extra_body": {"structured_outputs": {"choice": ["yes", "no"]}}},
                    "either", checks={"max_tokens": m})
    elif kind == "response_format":
        p = Planned(index, kind, "chat", {**chat, "max_tokens": max(m, 8), "response_format": {"type": "json_object"}},
                    "either", checks={"max_tokens": max(m, 8)})
    elif kind == "thinking_budget":
        p = Planned(index, kind, "chat", {**chat, "extra_body": {"thinking_token_budget": 4}}, "either",
                    checks={"max_tokens": m})
    elif kind == "long_prompt":
        # Up to max_model_len, often a few tokens short of a block boundary that decoding then crosses: where a full
        # KV cache makes vLLM preempt.
        p.args["prompt"] = _long_prompt(rng, ctx, ctx.max_model_len - ctx.max_tokens - rng.randint(12, 72))
        p.args.update(temperature=rng.choice([0, 0.8]))
    elif kind == "too_long_prompt":
        p.args["prompt"] = _long_prompt(rng, ctx, ctx.max_model_len + rng.randint(1, 32))
    elif kind == "max_tokens_1":
        p.args.update(max_tokens=1, temperature=rng.choice([0, 1.0]))
        p.checks["max_tokens"] = 1
    elif kind == "empty_prompt":
        p.args["prompt"] = ""
    elif kind == "empty_chat":
        p = Planned(index, kind, "chat", {**chat, "messages": [{"role": "user", "content": ""}]}, "either",
                    checks={"max_tokens": m})
    elif kind == "chat":
        p = Planned(index, kind, "chat", {**chat, "temperature": rng.choice([0, 0.7])}, "ok", checks={"max_tokens": m})
    elif kind == "bad_temperature":
        p.args.update(temperature=-1.0)
    elif kind == "bad_top_p":
        p.args.update(top_p=1.5)
    elif kind == "bad_n":
        p.args.update(n=0)
    elif kind == "bad_max_tokens":
        p.args.update(max_tokens=-1)
    elif kind == "bad_logprobs":
        p.args.update(logprobs=1000)
    elif kind == "bad_model":
        p.args.update(model="no-such-model")
    else:
        raise ValueError(f"unknown request kind {kind!r}")
    if kind in EITHER:
        p.expect, p.param = "either", EITHER[kind]
    elif kind in REFUSED:
        p.expect, p.param = "refused", REFUSED[kind]
    if kind in ABORTABLE:
        draw = rng.random()
        if draw < ctx.p_disconnect:
            p.action, p.after_chunks = "disconnect", rng.randint(1, 3)
        elif draw < ctx.p_disconnect + ctx.p_abort:
            p.action, p.abort_after_s = "abort", rng.uniform(0.0, 0.5)
        elif draw < 0.5 + (ctx.p_disconnect + ctx.p_abort) / 2:
            p.action = "stream"
    return p


def plan(num_requests: int, seed: int, ctx: MixContext) -> Iterator[Planned]:
    """The seeded sequence of `num_requests` requests, made as they are sent (a long soak's plan is never held)."""
    rng = random.Random(seed)
    kinds = [k for k in WEIGHTS if k not in ctx.skip_kinds]
    weights = [WEIGHTS[k] for k in kinds]
    for i in range(num_requests):
        yield plan_request(i, rng.choices(kinds, weights)[0], rng, ctx)
