"""Drives a planned mix through the `openai` client (async, bounded concurrency) and judges each answer.

Each request ends as one `Outcome`: `ok` (a 200 that shows its parameters: n choices, at most max_tokens tokens, at
least min_tokens, logprobs when asked), `refused` (a 4xx; `reason` is its message, `names_param` whether the message
names the parameter the plan expects), `disconnected` / `aborted` (the client dropped the stream after a few chunks,
or cancelled the call before the answer: the server must free the request), or `failed` (anything else: a 5xx, a
connection error, an answer that contradicts its parameters, or a 4xx where none was expected).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable
from dataclasses import dataclass

import httpx
import openai

from bench.soak.mix import Planned

CLIENT_TIMEOUT_S = 300
KEEPALIVE_EXPIRY_S = 2  # below vLLM's HTTP keep-alive timeout (5 s)


@dataclass
class Outcome:
    index: int
    kind: str
    action: str
    result: str  # ok, refused, disconnected, aborted, failed
    status: int | None = None
    reason: str = ""
    names_param: bool | None = None
    latency_s: float = 0.0


def _choices_text(response, endpoint: str) -> list:
    return [c.text if endpoint == "completions" else c.message.content for c in response.choices]


def judge_answer(p: Planned, response) -> str:
    """'' when a whole answer shows its parameters, else what is wrong."""
    n = p.checks.get("n", 1)
    if len(response.choices) != n:
        return f"{len(response.choices)} choices for n={n}"
    tokens = response.usage.completion_tokens
    if tokens > n * p.checks["max_tokens"]:
        return f"{tokens} completion tokens over n * max_tokens = {n * p.checks['max_tokens']}"
    if "min_tokens" in p.checks and tokens < n * p.checks["min_tokens"]:
        return f"{tokens} completion tokens under min_tokens={p.checks['min_tokens']}"
    if p.checks.get("logprobs") and any(c.logprobs is None for c in response.choices):
        return "no logprobs"
    if any(c.finish_reason not in ("stop", "length") for c in response.choices):
        return f"finish reasons {[c.finish_reason for c in response.choices]}"
    return ""


def _create(client: openai.AsyncOpenAI, p: Planned, stream: bool):
    api = client.completions if p.endpoint == "completions" else client.chat.completions
    return api.create(**p.args, stream=stream)


async def run_one(client: openai.AsyncOpenAI, p: Planned) -> Outcome:
    start = time.monotonic()
    out = Outcome(p.index, p.kind, p.action, "failed")
    try:
        if p.action == "abort":
            try:
                response = await asyncio.wait_for(_create(client, p, stream=False), timeout=p.abort_after_s)
            except TimeoutError:
                out.result = "aborted"
            else:  # answered before the client gave up
                problem = judge_answer(p, response)
                out.result, out.status, out.reason = ("ok", 200, "") if not problem else ("failed", 200, problem)
        elif p.action in ("stream", "disconnect"):
            stream = await _create(client, p, stream=True)
            chunks = 0
            async for _ in stream:
                chunks += 1
                if p.action == "disconnect" and chunks >= p.after_chunks:
                    await stream.close()
                    out.result = "disconnected"
                    break
            else:
                out.result, out.status = "ok", 200
        else:
            response = await _create(client, p, stream=False)
            problem = judge_answer(p, response)
            out.result, out.status, out.reason = ("ok", 200, "") if not problem else ("failed", 200, problem)
    except openai.APIStatusError as e:
        out.status = e.status_code
        message = e.message if isinstance(e.message, str) else str(e.message)
        out.reason = message
        if 400 <= e.status_code < 500:
            out.result = "refused"
            out.names_param = p.param is not None and p.param.lower() in message.lower()
    except (openai.APIConnectionError, httpx.HTTPError) as e:
        out.reason = f"{type(e).__name__}: {e}"
    out.latency_s = time.monotonic() - start
    if out.result == "refused" and p.expect == "ok":
        out.result = "failed"
    if out.result in ("ok", "disconnected", "aborted") and p.expect == "refused":
        out.result, out.reason = "failed", f"accepted, expected a 4xx naming {p.param}"
    return out


async def drive(base_url: str, planned: Iterable[Planned], concurrency: int, duration_s: float) -> list[Outcome]:
    """Runs `planned` in order with at most `concurrency` in flight; stops starting new ones after `duration_s`."""
    # idle connections are dropped before the server's keep-alive timeout (uvicorn's, VLLM_HTTP_TIMEOUT_KEEP_ALIVE,
    # 5 s) can close one under a request the client is sending on it: that race is the client's, not the server's
    limits = httpx.Limits(max_connections=concurrency + 8, max_keepalive_connections=concurrency + 8,
                          keepalive_expiry=KEEPALIVE_EXPIRY_S)
    async with httpx.AsyncClient(limits=limits, timeout=CLIENT_TIMEOUT_S) as http_client:
        client = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0,
                                    timeout=CLIENT_TIMEOUT_S, http_client=http_client)
        gate = asyncio.Semaphore(concurrency)
        deadline = time.monotonic() + duration_s
        tasks = []

        async def gated(p: Planned) -> Outcome:
            try:
                return await run_one(client, p)
            finally:
                gate.release()

        for p in planned:
            await gate.acquire()
            if time.monotonic() > deadline:
                gate.release()
                break
            tasks.append(asyncio.create_task(gated(p)))
        return list(await asyncio.gather(*tasks))


async def greedy_tokens(base_url: str, model: str, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Each prompt's greedy completion token ids, one request at a time (the batch holds it alone)."""
    async with openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0,
                                  timeout=CLIENT_TIMEOUT_S) as client:
        out = []
        for prompt in prompts:
            response = await client.completions.create(
                model=model, prompt=prompt, max_tokens=max_tokens, temperature=0,
                extra_body={"ignore_eos": True, "return_token_ids": True})
            out.append(list(response.choices[0].token_ids))
        return out
