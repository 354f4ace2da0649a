"""The server-side figures of a benchmark point, read from vLLM's Prometheus endpoint (`/metrics`).

`vllm bench serve` already diffs the speculative-decoding counters (acceptance length, per-position acceptance)
around a run; what it lacks is the scheduler's side: how many requests the server admitted at once, how many it
preempted, and how full the KV cache got. Gauges only hold the current value, so `MetricsSampler` polls them in
a background thread while the benchmark runs and keeps the peaks.

No vllm import here: the sampler runs beside the benchmark, and the tests use it on plain text.
"""

from __future__ import annotations

import re
import threading
import urllib.error
import urllib.request
from dataclasses import dataclass, field

RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
KV_USAGE = "vllm:kv_cache_usage_perc"
PREEMPTIONS = "vllm:num_preemptions"
CACHE_CONFIG = "vllm:cache_config_info"
SCRAPE_TIMEOUT_S = 5.0
# vLLM's front end refreshes its gauges once per engine step; sampling faster than a step only repeats values.
DEFAULT_INTERVAL_S = 0.25

_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


@dataclass(frozen=True)
class Sample:
    name: str
    labels: dict
    value: float


def parse_prometheus(text: str) -> list[Sample]:
    """Samples of a Prometheus text exposition; counters keep their `_total` suffix as exposed."""
    samples = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if "{" in line:
            name, rest = line.split("{", 1)
            label_text, _, value_text = rest.rpartition("}")
            labels = dict(_LABEL.findall(label_text))
        else:
            name, _, value_text = line.partition(" ")
            labels = {}
        try:
            value = float(value_text.split()[0])
        except (IndexError, ValueError):
            continue
        samples.append(Sample(name.strip(), labels, value))
    return samples


def metric_sum(samples: list[Sample], name: str) -> float | None:
    """Sum over labels (engines) of a gauge `name` or a counter `name_total`; None if the server has no such metric."""
    values = [s.value for s in samples if s.name in (name, f"{name}_total")]
    return sum(values) if values else None


def cache_config(samples: list[Sample]) -> dict:
    """The KV-cache capacity the server computed at start-up (`vllm:cache_config_info` labels)."""
    for s in samples:
        if s.name == CACHE_CONFIG:
            return s.labels
    return {}


def scrape(base_url: str, timeout: float = SCRAPE_TIMEOUT_S) -> list[Sample]:
    with urllib.request.urlopen(f"{base_url}/metrics", timeout=timeout) as response:
        return parse_prometheus(response.read().decode())


def _as_float(value) -> float | None:
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


@dataclass
class MetricsSampler:
    """Polls `/metrics` every `interval_s` between `start()` and `stop()`; `summary()` gives the point's figures."""

    base_url: str
    interval_s: float = DEFAULT_INTERVAL_S
    before: list[Sample] = field(default_factory=list)
    after: list[Sample] = field(default_factory=list)
    running: list[float] = field(default_factory=list)
    waiting: list[float] = field(default_factory=list)
    kv_usage: list[float] = field(default_factory=list)
    failed_scrapes: int = 0

    def __post_init__(self):
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, name="metrics-sampler", daemon=True)

    def start(self) -> None:
        self.before = scrape(self.base_url)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=SCRAPE_TIMEOUT_S + self.interval_s + 1)
        self.after = scrape(self.base_url)
        self._record(self.after)

    def _record(self, samples: list[Sample]) -> None:
        for name, series in ((RUNNING, self.running), (WAITING, self.waiting), (KV_USAGE, self.kv_usage)):
            value = metric_sum(samples, name)
            if value is not None:
                series.append(value)

    def _poll(self) -> None:
        # Bounded by stop(): the event ends the loop within one interval plus one scrape timeout.
        while not self._stop.wait(self.interval_s):
            try:
                self._record(scrape(self.base_url))
            except (OSError, urllib.error.URLError):
                self.failed_scrapes += 1

    def summary(self) -> dict:
        def delta(name: str) -> float | None:
            a, b = metric_sum(self.after, name), metric_sum(self.before, name)
            return None if a is None or b is None else a - b

        config = cache_config(self.after)
        return {
            "server_peak_running_requests": max(self.running, default=None),
            "server_peak_waiting_requests": max(self.waiting, default=None),
            "server_peak_kv_cache_usage": max(self.kv_usage, default=None),
            "server_mean_kv_cache_usage": sum(self.kv_usage) / len(self.kv_usage) if self.kv_usage else None,
            "server_preemptions": delta(PREEMPTIONS),
            "server_kv_cache_max_concurrency": _as_float(config.get("kv_cache_max_concurrency")),
            "server_kv_cache_blocks": _as_float(config.get("num_gpu_blocks")),
            "server_metrics_samples": len(self.kv_usage),
            "server_metrics_failed_scrapes": self.failed_scrapes,
        }


def reset_caches(base_url: str) -> None:
    """What `vllm bench sweep serve` does after each run (`ServerProcess.reset_caches`), for a server command that
    does not start with `vllm` (e.g. `python -m vllm.entrypoints.cli.main serve` on the H200 site)."""
    for endpoint in ("/reset_prefix_cache", "/reset_mm_cache", "/reset_encoder_cache"):
        request = urllib.request.Request(f"{base_url}{endpoint}", data=b"", method="POST")
        with urllib.request.urlopen(request, timeout=30) as response:
            if response.status != 200:
                raise RuntimeError(f"{endpoint}: HTTP {response.status}")


if __name__ == "__main__":
    import sys

    if len(sys.argv) != 3 or sys.argv[1] != "reset-caches":
        raise SystemExit("usage: python -m bench.sweep.metrics reset-caches BASE_URL")
    reset_caches(sys.argv[2])
