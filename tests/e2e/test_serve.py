"""`vllm serve` with reconstruct-on-commit: the OpenAI-compatible server answers completions and chat
completions on the fixture model, its greedy completions are tie-aware equivalent to the no-speculation engine's,
and it exposes vLLM's spec-decode metrics; a bad config stops it at start-up.

The server is a real `vllm serve` subprocess (front end plus a separate engine core process, so the plugin is
loaded and the config unpickled the way a deployment does it), on 127.0.0.1 only, in its own process group,
which is always torn down.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from bench.soak.server import http as soak_http
from bench.soak.server import running_server

pytestmark = pytest.mark.e2e

HOST = "127.0.0.1"
STARTUP_TIMEOUT_S = 240
BAD_CONFIG_TIMEOUT_S = 180
REQUEST_TIMEOUT_S = 120
METRICS_TIMEOUT_S = 30
LOG_TAIL_CHARS = 6000
# Prompts whose greedy continuation on the fixture does not start with end-of-text (some do: "... Explicit is
# better than" ends after 2 tokens with empty text), checked with the no-speculation engine.
COMPLETION_PROMPT = "Beautiful is better than ugly."
CHAT_MESSAGE = "Simple is better than complex."
RECONSTRUCT_K3 = {"method": "mtp", "num_speculative_tokens": 3, "mamba_state_commit": "reconstruct"}
# One completions request of this many fixture prompts (as token ids), judged against the no-speculation engine.
SERVED_PROMPTS = 8
SERVED_TOKENS = 24


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def serve_command(model: str, speculative_config: dict, port: int, *extra: str) -> list[str]:
    vllm = shutil.which("vllm")
    prefix = [vllm] if vllm else [sys.executable, "-m", "vllm.entrypoints.cli.main"]
    return prefix + [
        "serve", model,
        "--speculative-config", json.dumps(speculative_config),
        "--dtype", "bfloat16",
        "--enforce-eager",
        "--no-enable-prefix-caching",
        "--max-model-len", "512",
        "--gpu-memory-utilization", "0.2",
        "--host", HOST,
        "--port", str(port),
        *extra,
    ]  # fmt: skip


def serve_env() -> dict:
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1")
    # The in-process engine core of the LLM-based e2e tests (set when equivalence.py is imported) is not what
    # `vllm serve` runs: give the server its usual separate engine core process.
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    return env


def log_tail(log_path: Path) -> str:
    try:
        return log_path.read_text(errors="replace")[-LOG_TAIL_CHARS:]
    except OSError as e:
        return f"<no server log: {e}>"


@contextlib.contextmanager
def vllm_server(cmd: list[str], log_path: Path):
    """Starts `cmd` in its own process group, logging to `log_path`; stops the whole group on exit (the soak's)."""
    with running_server(cmd, 0, log_path, serve_env()) as server:
        yield server.process


http = functools.partial(soak_http, timeout=REQUEST_TIMEOUT_S)  # (status, body) of one request


def wait_until_healthy(proc: subprocess.Popen, base_url: str, log_path: Path) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(
                f"vllm serve exited with {proc.returncode} before it was healthy; log tail:\n{log_tail(log_path)}"
            )
        with contextlib.suppress(OSError):
            status, _ = http("GET", f"{base_url}/health", timeout=5)
            if status == 200:
                return
        time.sleep(2)
    pytest.fail(f"vllm serve not healthy after {STARTUP_TIMEOUT_S} s; log tail:\n{log_tail(log_path)}")


def metric_total(metrics_text: str, name: str) -> float | None:
    """Sum of a Prometheus metric's samples over its labels (counters are exposed as `<name>_total`)."""
    values = []
    for line in metrics_text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        sample = line.split("{", 1)[0].split(" ", 1)[0]
        if sample in (name, f"{name}_total"):
            values.append(float(line.rsplit(" ", 1)[1]))
    return sum(values) if values else None


def metrics_when(base_url: str, ready) -> str:
    """The server's /metrics text once `ready(text)` holds, or its last text after METRICS_TIMEOUT_S (the caller's
    asserts then say what is missing): counters are updated as the engine core's stats reach the front end."""
    deadline = time.monotonic() + METRICS_TIMEOUT_S
    while True:
        status, metrics = http("GET", f"{base_url}/metrics")
        assert status == 200, metrics[:2000]
        if ready(metrics) or time.monotonic() > deadline:
            return metrics
        time.sleep(1)


def test_serve_reconstruct_answers_and_reports_spec_decode(fixture_model, tmp_path):
    from transformers import AutoTokenizer

    from vllm_treewy.fixture import fixture_prompts

    prompts = fixture_prompts(AutoTokenizer.from_pretrained(fixture_model), SERVED_PROMPTS)
    port = free_port()
    base_url = f"http://{HOST}:{port}"
    log_path = tmp_path / "vllm-serve.log"
    with vllm_server(serve_command(fixture_model, RECONSTRUCT_K3, port), log_path) as proc:
        wait_until_healthy(proc, base_url, log_path)

        def post(path: str, body: dict) -> dict:
            status, text = http("POST", f"{base_url}{path}", body)
            assert status == 200, f"{path}: HTTP {status}: {text[:2000]}\nserver log tail:\n{log_tail(log_path)}"
            return json.loads(text)

        completion = post(
            "/v1/completions",
            {"model": fixture_model, "prompt": COMPLETION_PROMPT,
             "max_tokens": 16, "temperature": 0},
        )  # fmt: skip
        assert completion["choices"][0]["text"], completion
        assert completion["usage"]["completion_tokens"] > 0, completion

        chat = post(
            "/v1/chat/completions",
            {"model": fixture_model,
             "messages": [{"role": "user", "content": CHAT_MESSAGE}],
             "max_tokens": 16, "temperature": 0},
        )  # fmt: skip
        assert chat["choices"][0]["message"]["content"], chat
        assert chat["usage"]["completion_tokens"] > 0, chat

        # Several prompts in one request: the engine batches them, prefills beside speculative decodes.
        batch = post(
            "/v1/completions",
            {"model": fixture_model, "prompt": prompts, "max_tokens": SERVED_TOKENS, "temperature": 0,
             "ignore_eos": True, "return_token_ids": True},
        )  # fmt: skip
        served = [choice["token_ids"] for choice in sorted(batch["choices"], key=lambda c: c["index"])]

        metrics = metrics_when(base_url, lambda text: (metric_total(text, "vllm:spec_decode_num_drafts") or 0) > 0)
        drafts = metric_total(metrics, "vllm:spec_decode_num_drafts")
        accepted = metric_total(metrics, "vllm:spec_decode_num_accepted_tokens")
        spec_lines = "\n".join(line for line in metrics.splitlines() if "spec_decode" in line)
        assert drafts is not None and drafts > 0, f"no speculative drafts reported:\n{spec_lines}"
        assert accepted is not None, f"no vllm:spec_decode_num_accepted_tokens:\n{spec_lines}"
        # The fixture's MTP head drafts the target's bigram: most drafts are accepted.
        assert accepted > 0, f"no draft accepted:\n{spec_lines}"
        assert proc.poll() is None, f"server died during the test; log tail:\n{log_tail(log_path)}"

    # After the server is gone: the in-process no-speculation engine re-scores any divergence (raw logits).
    from vllm_treewy.fixture.exact import ExactModel
    from vllm_treewy.vllm_plugin.testing.equivalence import compare_tie_aware, engine, generate_greedy

    with engine(fixture_model, logprobs_mode="raw_logits") as reference:
        expected = generate_greedy(reference, prompts, [SERVED_TOKENS] * len(prompts))
        verdict = compare_tie_aware(reference, prompts, expected, served, ExactModel(fixture_model).next_token_logits)
    assert verdict.num_tokens_compared == SERVED_PROMPTS * SERVED_TOKENS and verdict.passed, verdict.summary()


def test_serve_bad_config_fails_at_startup(fixture_model, tmp_path):
    """An unknown strategy stops `vllm serve` in the front end, with one error, before an engine core starts."""
    port = free_port()
    log_path = tmp_path / "vllm-serve-bad.log"
    bad = {**RECONSTRUCT_K3, "mamba_state_commit": "snapshot"}
    with vllm_server(serve_command(fixture_model, bad, port), log_path) as proc:
        try:
            returncode = proc.wait(timeout=BAD_CONFIG_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"vllm serve still running {BAD_CONFIG_TIMEOUT_S} s after a bad config:\n{log_tail(log_path)}")
    log = log_path.read_text(errors="replace")
    assert returncode != 0, log[-LOG_TAIL_CHARS:]
    assert log.count("Input should be 'store_all' or 'reconstruct'") == 1, log[-LOG_TAIL_CHARS:]
    assert "mamba_state_commit" in log
    assert "EngineCore" not in log, log[-LOG_TAIL_CHARS:]


MTP_TREE = {**RECONSTRUCT_K3, "draft_tree_widths": [2, 2, 1]}  # the README's command
# More decoding requests than whole [2, 2, 1] trees (1 + 10 tokens each) fit a step's token budget: some fall back.
SMALL_BUDGET = ("--max-num-seqs", "4", "--max-num-batched-tokens", "32")


@pytest.fixture(scope="module")
def tree_server(fixture_model, tmp_path_factory):
    """The README's tree command behind `vllm serve` (separate engine core process), under a small token budget;
    the two tree tests below send it their requests (the budget only makes some steps fall back: every request is
    answered). Yields (process, base URL, log path)."""
    port = free_port()
    base_url = f"http://{HOST}:{port}"
    log_path = tmp_path_factory.mktemp("serve-tree") / "vllm-serve-tree.log"
    with vllm_server(serve_command(fixture_model, MTP_TREE, port, *SMALL_BUDGET), log_path) as proc:
        wait_until_healthy(proc, base_url, log_path)
        yield proc, base_url, log_path


def test_serve_mtp_tree_samples_and_reports_acceptance_per_depth(fixture_model, tree_server):
    """The README's tree command behind `vllm serve` (separate engine core process), under a small token budget: a
    chat request at temperature 0.8 is answered, and /metrics reports the acceptance at each depth of the tree
    (vLLM's per-position counter: position i is depth i + 1; no path is deeper than the tree) and, after a batch of
    requests, the tree fallbacks (`vllm:treewy_tree_fallbacks`, labelled per engine as vLLM's own counters)."""
    proc, base_url, log_path = tree_server
    status, text = http("POST", f"{base_url}/v1/chat/completions", {
        "model": fixture_model, "messages": [{"role": "user", "content": CHAT_MESSAGE}],
        "max_tokens": 48, "temperature": 0.8, "seed": 11, "ignore_eos": True})
    assert status == 200, f"HTTP {status}: {text[:2000]}\nserver log tail:\n{log_tail(log_path)}"
    chat = json.loads(text)
    assert chat["choices"][0]["message"]["content"], chat
    assert chat["usage"]["completion_tokens"] == 48, chat
    status, text = http("POST", f"{base_url}/v1/completions", {
        "model": fixture_model, "prompt": [COMPLETION_PROMPT, CHAT_MESSAGE] * 2, "max_tokens": 24,
        "temperature": 0, "ignore_eos": True})
    assert status == 200, f"HTTP {status}: {text[:2000]}\nserver log tail:\n{log_tail(log_path)}"
    def accepted_and_fallen_back(text: str) -> bool:
        per_depth = per_position(text, "vllm:spec_decode_num_accepted_tokens_per_pos")
        return sum(per_depth.values()) > 0 and (metric_total(text, "vllm:treewy_tree_fallbacks") or 0) > 0

    metrics = metrics_when(base_url, accepted_and_fallen_back)
    per_depth = per_position(metrics, "vllm:spec_decode_num_accepted_tokens_per_pos")
    fallbacks = metric_total(metrics, "vllm:treewy_tree_fallbacks")
    spec_lines = "\n".join(line for line in metrics.splitlines() if "spec_decode" in line or "treewy" in line)
    assert per_depth.get(0, 0) > 0, f"no draft accepted at depth 1:\n{spec_lines}"
    assert all(count == 0 for position, count in per_depth.items() if position >= 3), spec_lines
    assert (fallbacks or 0) > 0, f"no tree fallback in /metrics:\n{spec_lines}"
    labels = [sample.labels for family in text_string_to_metric_families(metrics)
              if family.name == "vllm:treewy_tree_fallbacks" for sample in family.samples
              if sample.name.endswith("_total")]
    assert labels == [{"model_name": fixture_model, "engine": "0"}], spec_lines
    assert "request steps without speculation" in log_path.read_text(errors="replace")  # the engine core's line
    assert proc.poll() is None, f"server died during the test; log tail:\n{log_tail(log_path)}"


def per_position(metrics_text: str, name: str) -> dict[int, float]:
    """A per-position counter's samples by their `position` label."""
    counts = {}
    for line in metrics_text.splitlines():
        if line.startswith(f"{name}_total{{") or line.startswith(f"{name}{{"):
            labels, value = line.rsplit(" ", 1)
            position = labels.split('position="', 1)[1].split('"', 1)[0]
            counts[int(position)] = counts.get(int(position), 0) + float(value)
    return counts


def test_openai_client_against_serve_with_mtp_tree(fixture_model, tree_server):
    """What the people this serves run: the `openai` client against `vllm serve` with reconstruct and an MTP tree,
    completions and chat, streamed and not, n > 1 at temperature 0.8; greedy streamed text equals greedy
    non-streamed text. The server is `tree_server`, the README's tree command (its small token budget only makes
    steps of several requests fall back)."""
    import openai

    proc, base_url, log_path = tree_server
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", timeout=REQUEST_TIMEOUT_S)
    messages = [{"role": "user", "content": CHAT_MESSAGE}]

    greedy = client.completions.create(model=fixture_model, prompt=COMPLETION_PROMPT, max_tokens=16,
                                       temperature=0)
    streamed = "".join(chunk.choices[0].text for chunk in client.completions.create(
        model=fixture_model, prompt=COMPLETION_PROMPT, max_tokens=16, temperature=0, stream=True)
        if chunk.choices)
    assert greedy.choices[0].text and streamed == greedy.choices[0].text, (greedy, streamed)

    sampled = client.completions.create(model=fixture_model, prompt=COMPLETION_PROMPT, max_tokens=16,
                                        temperature=0.8, n=3, seed=5)
    assert len(sampled.choices) == 3 and all(c.text for c in sampled.choices), sampled
    assert sampled.usage.completion_tokens > 0

    chat = client.chat.completions.create(model=fixture_model, messages=messages, max_tokens=16,
                                          temperature=0.8, n=2)
    assert len(chat.choices) == 2 and all(c.message.content for c in chat.choices), chat
    chat_greedy = client.chat.completions.create(model=fixture_model, messages=messages, max_tokens=16,
                                                 temperature=0)
    chunks = client.chat.completions.create(model=fixture_model, messages=messages, max_tokens=16,
                                            temperature=0, stream=True)
    chat_streamed = "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)
    assert chat_streamed == chat_greedy.choices[0].message.content, (chat_streamed, chat_greedy)
    assert proc.poll() is None, f"server died during the test; log tail:\n{log_tail(log_path)}"
