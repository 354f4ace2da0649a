"""One `vllm serve` process for a soak: the README's chain or [2,2,1] tree command on loopback, its health, /metrics,
and its log.

The server runs in its own process group (torn down on exit, whatever happens) with prefix caching on and vLLM's
defaults otherwise; `extra_args` adds what a site needs (CI: `--enforce-eager`; the H200: the gpu-vllm site's
backends and a fixed KV budget).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from bench.sweep.metrics import Sample, parse_prometheus

HOST = "127.0.0.1"
# The README's two `vllm serve` commands' speculative configs, as it writes them (tests/bench_scripts and tests/soak
# check that each one's compact JSON appears there verbatim).
README_SPECS = {
    "chain": {"method": "mtp", "num_speculative_tokens": 3, "mamba_state_commit": "reconstruct"},
    "tree": {"method": "mtp", "num_speculative_tokens": 3, "mamba_state_commit": "reconstruct",
             "draft_tree_widths": [2, 2, 1]},
}
# Log lines that mean the engine died or a request failed inside it (not a client's disconnect).
ENGINE_DEAD_MARKERS = ("EngineDeadError", "EngineCore encountered a fatal error", "Engine core proc",
                       "AsyncLLM output_handler failed", "died unexpectedly")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def serve_command(model: str, strategy: str, port: int, max_model_len: int,
                  speculative_extra: dict | None = None, extra_args: tuple[str, ...] = ()) -> list[str]:
    spec = {**README_SPECS[strategy], **(speculative_extra or {})}
    return [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", model,
            "--speculative-config", json.dumps(spec), "--enable-prefix-caching",
            "--max-model-len", str(max_model_len), "--host", HOST, "--port", str(port),
            *extra_args]  # fmt: skip


def http(method: str, url: str, body: dict | None = None, timeout: float = 30) -> tuple[int, str]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")


@dataclass
class Server:
    """A started `vllm serve`: its process, port, log and command."""

    process: subprocess.Popen
    port: int
    log_path: Path
    command: list[str]
    started_s: float | None = None
    events: list[str] = field(default_factory=list)

    @property
    def base_url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def alive(self) -> bool:
        return self.process.poll() is None

    def healthy(self) -> bool:
        with contextlib.suppress(OSError):
            return http("GET", f"{self.base_url}/health", timeout=10)[0] == 200
        return False

    def wait_healthy(self, timeout_s: float) -> None:
        start = time.monotonic()
        while time.monotonic() - start < timeout_s:
            if not self.alive():
                raise RuntimeError(f"vllm serve exited with {self.process.returncode}; log tail:\n{self.log_tail()}")
            if self.healthy():
                self.started_s = time.monotonic() - start
                return
            time.sleep(1)
        raise RuntimeError(f"vllm serve not healthy after {timeout_s} s; log tail:\n{self.log_tail()}")

    def metrics(self) -> list[Sample]:
        status, text = http("GET", f"{self.base_url}/metrics")
        if status != 200:
            raise RuntimeError(f"/metrics: HTTP {status}: {text[:500]}")
        return parse_prometheus(text)

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def log_tail(self, chars: int = 6000) -> str:
        return self.log_text()[-chars:]


def server_env(extra_env: dict | None = None) -> dict:
    env = dict(os.environ)
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # `vllm serve` runs its engine core in its own process
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
    env.update(extra_env or {})
    return env


@contextlib.contextmanager
def running_server(command: list[str], port: int, log_path: Path, env: dict):
    """Starts `command` in its own process group, logging to `log_path`; stops the whole group on exit."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                   start_new_session=True)
    try:
        yield Server(process, port, log_path, command)
    finally:
        stop_process_group(process)


def stop_process_group(process: subprocess.Popen) -> None:
    for sig, wait_s in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            break
        try:
            process.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            continue
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, sig)  # the engine core child may outlive the leader
        break
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(timeout=5)
