"""The six workloads of TreeWY's serving evaluation, generated locally in the file formats `vllm bench serve` reads.

| workload | TreeWY's source | file written here | `vllm bench serve` dataset | swept over |
| --- | --- | --- | --- | --- |
| chat | ShareGPT | `chat.sharegpt.json` (ShareGPT format) | `sharegpt` | concurrency |
| mixed | Spec-Bench | `mixed.spec_bench.jsonl` (Spec-Bench `question.jsonl`) | `spec_bench` | concurrency |
| balanced | synthetic balanced chat | `balanced.jsonl` (`{"prompt", "output_tokens"}`) | `custom` | concurrency |
| generation_heavy | synthetic | `generation_heavy.jsonl` | `custom` | concurrency |
| summarize_heavy | synthetic | `summarize_heavy.jsonl` | `custom` | concurrency |
| bursty | BurstGPT | `bursty.burstgpt.csv` (BurstGPT columns) | `burstgpt` | arrival rate (gamma) |

Each file has the real data set's format, so a real file drops in by path (`params/bench.json`'s `dataset_path`,
bench/sweep/README.md). Lengths
are drawn from the grid's `LengthProfile` (the model's context bounds them); prompt text is cut from a token
stream and decoded with the model's tokenizer, so a prompt of n tokens re-tokenizes to about n tokens.
"""

from __future__ import annotations

import csv
import json
import math
import random
from dataclasses import dataclass
from pathlib import Path

WORKLOADS = ("chat", "mixed", "balanced", "generation_heavy", "summarize_heavy", "bursty")
# Spec-Bench's six categories; summarization and retrieval-augmented QA carry long prompts.
SPEC_BENCH_CATEGORIES = ("mt_bench", "translation", "summarization", "qa", "math_reasoning", "rag")
LONG_SPEC_BENCH_CATEGORIES = ("summarization", "rag")
# BurstGPT is swept over its arrival rate (as in TreeWY), the others over a fixed concurrency.
RATE_AXIS_WORKLOADS = ("bursty",)
MIN_TOKENS = 4  # vLLM's ShareGPT loader drops prompts and replies shorter than this
SEED = 20261130


@dataclass(frozen=True)
class LengthProfile:
    """Token lengths per workload: medians of log-normal draws (chat, bursty) or fixed means with +-25% spread."""

    chat_input: int
    chat_output: int
    mixed_short_input: int
    mixed_long_input: int
    mixed_output: int  # Spec-Bench is run with one output length (`--spec-bench-output-len`)
    balanced: int
    generation_heavy_input: int
    generation_heavy_output: int
    summarize_heavy_input: int
    summarize_heavy_output: int
    bursty_input: int
    bursty_output: int
    max_total: int  # prompt + output must fit the server's max_model_len
    samples: int = 256  # requests per file; a point samples from them (vLLM oversamples when it needs more)


@dataclass(frozen=True)
class WorkloadData:
    """What `vllm bench serve` needs to read one workload."""

    name: str
    axis: str  # "concurrency" or "request_rate"
    bench_params: dict  # dataset flags, as `vllm bench sweep serve` bench-params keys


class TextSource:
    """Prompt text of a requested token length: a slice of a token stream, decoded."""

    def __init__(self, token_stream: list[int], decode):
        if len(token_stream) < 2:
            raise ValueError("token stream too short")
        self.stream = token_stream
        self.decode = decode

    def text(self, num_tokens: int, rng: random.Random) -> str:
        # Repeat the stream as needed; start anywhere so prompts differ.
        start = rng.randrange(len(self.stream))
        ids = [self.stream[(start + i) % len(self.stream)] for i in range(num_tokens)]
        return self.decode(ids)


def _lognormal(rng: random.Random, median: int, sigma: float, low: int, high: int) -> int:
    return int(min(max(round(median * math.exp(rng.gauss(0.0, sigma))), low), high))


def _spread(rng: random.Random, mean: int, low: int, high: int) -> int:
    return int(min(max(round(mean * rng.uniform(0.75, 1.25)), low), high))


def _fit(prompt_len: int, output_len: int, max_total: int) -> tuple[int, int]:
    """Shortens the prompt first so that prompt + output fits the context."""
    prompt_len = max(MIN_TOKENS, min(prompt_len, max_total - output_len))
    return prompt_len, min(output_len, max_total - prompt_len)


def write_chat(path: Path, lengths: LengthProfile, source: TextSource, rng: random.Random) -> None:
    """ShareGPT format; vLLM takes the reply's token count as the request's output length."""
    records = []
    for i in range(lengths.samples):
        n_in = _lognormal(rng, lengths.chat_input, 0.8, MIN_TOKENS, lengths.max_total)
        n_out = _lognormal(rng, lengths.chat_output, 0.7, MIN_TOKENS, lengths.max_total)
        n_in, n_out = _fit(n_in, n_out, lengths.max_total)
        records.append({"id": f"chat-{i}", "conversations": [
            {"from": "human", "value": source.text(n_in, rng)},
            {"from": "gpt", "value": source.text(n_out, rng)},
        ]})  # fmt: skip
    path.write_text(json.dumps(records) + "\n")


def write_mixed(path: Path, lengths: LengthProfile, source: TextSource, rng: random.Random) -> None:
    """Spec-Bench `question.jsonl` format: one question per line, first turn used as the prompt."""
    with path.open("w") as f:
        for i in range(lengths.samples):
            category = SPEC_BENCH_CATEGORIES[i % len(SPEC_BENCH_CATEGORIES)]
            mean = lengths.mixed_long_input if category in LONG_SPEC_BENCH_CATEGORIES else lengths.mixed_short_input
            n_in, _ = _fit(_spread(rng, mean, MIN_TOKENS, lengths.max_total), lengths.mixed_output, lengths.max_total)
            f.write(json.dumps({"question_id": i, "category": category, "turns": [source.text(n_in, rng)]}) + "\n")


def write_custom(path: Path, input_mean: int, output_mean: int, lengths: LengthProfile, source: TextSource,
                 rng: random.Random) -> None:  # fmt: skip
    """vLLM's `custom` format: a prompt and its output length per line."""
    with path.open("w") as f:
        for _ in range(lengths.samples):
            n_in = _spread(rng, input_mean, MIN_TOKENS, lengths.max_total)
            n_out = _spread(rng, output_mean, MIN_TOKENS, lengths.max_total)
            n_in, n_out = _fit(n_in, n_out, lengths.max_total)
            f.write(json.dumps({"prompt": source.text(n_in, rng), "output_tokens": n_out}) + "\n")


def write_bursty(path: Path, lengths: LengthProfile, rng: random.Random) -> None:
    """BurstGPT's CSV columns; vLLM reads only the GPT-4 rows' token counts (it makes its own prompt tokens).
    Arrivals are not in the file: the grid's request rate and gamma burstiness drive them."""
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["Timestamp", "Model", "Request tokens", "Response tokens", "Total tokens", "Log Type"])
        timestamp = 0.0
        for _ in range(lengths.samples):
            n_in = _lognormal(rng, lengths.bursty_input, 0.9, MIN_TOKENS, lengths.max_total)
            n_out = _lognormal(rng, lengths.bursty_output, 0.8, MIN_TOKENS, lengths.max_total)
            n_in, n_out = _fit(n_in, n_out, lengths.max_total)
            timestamp += rng.expovariate(1.0)
            writer.writerow([round(timestamp, 3), "GPT-4", n_in, n_out, n_in + n_out, "Conversation log"])


def workload_axis(name: str) -> str:
    return "request_rate" if name in RATE_AXIS_WORKLOADS else "concurrency"


def write_workloads(data_dir: Path, lengths: LengthProfile, source: TextSource,
                    names: tuple[str, ...] = WORKLOADS) -> dict[str, WorkloadData]:  # fmt: skip
    """Writes the named workloads' files into data_dir (deterministically); returns how to read each."""
    data_dir.mkdir(parents=True, exist_ok=True)
    out = {}
    for name in names:
        rng = random.Random(f"{SEED}-{name}")
        if name == "chat":
            path = data_dir / "chat.sharegpt.json"
            write_chat(path, lengths, source, rng)
            params = {"dataset_name": "sharegpt", "dataset_path": str(path)}
        elif name == "mixed":
            path = data_dir / "mixed.spec_bench.jsonl"
            write_mixed(path, lengths, source, rng)
            params = {"dataset_name": "spec_bench", "dataset_path": str(path),
                      "spec_bench_output_len": lengths.mixed_output, "skip_chat_template": True}  # fmt: skip
        elif name in ("balanced", "generation_heavy", "summarize_heavy"):
            path = data_dir / f"{name}.jsonl"
            means = {
                "balanced": (lengths.balanced, lengths.balanced),
                "generation_heavy": (lengths.generation_heavy_input, lengths.generation_heavy_output),
                "summarize_heavy": (lengths.summarize_heavy_input, lengths.summarize_heavy_output),
            }[name]
            write_custom(path, *means, lengths, source, rng)
            # custom_output_len -1: each line's output_tokens (vLLM's default, 256, would override them).
            params = {"dataset_name": "custom", "dataset_path": str(path), "custom_output_len": -1,
                      "skip_chat_template": True}  # fmt: skip
        elif name == "bursty":
            path = data_dir / "bursty.burstgpt.csv"
            write_bursty(path, lengths, rng)
            params = {"dataset_name": "burstgpt", "dataset_path": str(path)}
        else:
            raise ValueError(f"unknown workload {name!r}; known: {', '.join(WORKLOADS)}")
        out[name] = WorkloadData(name, workload_axis(name), params)
    return out
