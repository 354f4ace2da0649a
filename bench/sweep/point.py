"""One benchmark point: `vllm bench serve` with the server's scheduler figures added to its result file.

`vllm bench sweep serve` runs this as its `--bench-cmd` and appends `--save-result --result-dir D
--result-filename F` to it; every argument that is not one of ours goes to vLLM's own `vllm bench serve` parser.
The benchmark runs in this process (same code as the `vllm bench serve` CLI), with a `MetricsSampler` polling the
server's `/metrics` beside it; the sampler's figures and the point's workload name are then written into the
result JSON, so that they reach the sweep's summary and our report like vLLM's own fields.

    python -m bench.sweep.point --workload chat --model M --port 8000 --dataset-name sharegpt ...
    python -m bench.sweep.point --serve-worker SOCKET          # a warm worker (see serve_points)
    python -m bench.sweep.point --worker SOCKET --workload chat ...   # one point, run by that worker
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import traceback
from pathlib import Path

from bench.sweep.metrics import DEFAULT_INTERVAL_S, MetricsSampler


def split_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """Our flags, and the rest for `vllm bench serve`."""
    # No abbreviations: a `vllm bench serve` flag must never be taken for a prefix of ours.
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], add_help=False, allow_abbrev=False)
    parser.add_argument("--workload", required=True, help="the grid's workload name, recorded in the result")
    parser.add_argument("--metrics-interval", type=float, default=DEFAULT_INTERVAL_S)
    ours, rest = parser.parse_known_args(argv)
    return ours, rest


def base_url(bench_args: argparse.Namespace) -> str:
    if bench_args.base_url:
        return bench_args.base_url.rstrip("/")
    return f"http://{bench_args.host}:{bench_args.port}"


def result_path(bench_args: argparse.Namespace) -> Path | None:
    if not bench_args.save_result or not bench_args.result_filename:
        return None
    return Path(bench_args.result_dir or ".") / bench_args.result_filename


def run_point(argv: list[str]) -> dict:
    """Runs one point in this process; returns the result with our figures (also written into the result file)."""
    ours, rest = split_args(argv)

    from vllm.benchmarks.serve import add_cli_args
    from vllm.benchmarks.serve import main as bench_serve
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(prog="vllm bench serve")
    add_cli_args(parser)
    bench_args = parser.parse_args(rest)

    sampler = MetricsSampler(base_url(bench_args), interval_s=ours.metrics_interval)
    sampler.start()
    try:
        result = bench_serve(bench_args)
    finally:
        sampler.stop()
    extra = {"workload": ours.workload, **sampler.summary()}
    result.update(extra)

    path = result_path(bench_args)
    if path is not None:
        saved = json.loads(path.read_text())
        saved.update(extra)
        path.write_text(json.dumps(saved, indent=2) + "\n")
    print(json.dumps(extra), file=sys.stderr, flush=True)
    return result


# A warm worker: importing vLLM's benchmark code costs ~10 s of CPU per process, more than a CPU grid's point
# itself, so the grid's driver starts one process that imports it once and runs the points sent to its socket,
# one at a time. The `--worker SOCKET` client is what `vllm bench sweep serve` runs per point.


def serve_points(socket_path: str) -> None:
    """Runs points sent as JSON argument lists on a Unix socket, one at a time, until the process is stopped
    (the driver stops it after the sweep); answers each with {"ok": bool, "error": str}."""
    import vllm.benchmarks.serve  # noqa: F401  (the import the worker exists to pay once)

    Path(socket_path).unlink(missing_ok=True)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as server:
        server.bind(socket_path)
        server.listen(1)
        print(f"bench worker ready on {socket_path}", flush=True)
        while True:
            connection, _ = server.accept()
            with connection:
                argv = json.loads(_read_message(connection))
                try:
                    run_point(argv)
                    reply = {"ok": True, "error": ""}
                except BaseException as error:  # the worker outlives a failed point; the client reports it
                    reply = {"ok": False, "error": "".join(traceback.format_exception(error))}
                connection.sendall(json.dumps(reply).encode() + b"\n")


def _read_message(connection: socket.socket) -> str:
    chunks = []
    while not chunks or not chunks[-1].endswith(b"\n"):
        chunk = connection.recv(65536)
        if not chunk:
            break
        chunks.append(chunk)
    return b"".join(chunks).decode()


def send_point(socket_path: str, argv: list[str]) -> int:
    """Client side: hands one point to the worker and waits for it (a point ends when its requests do; the
    connection closes if the worker dies)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as connection:
        connection.connect(socket_path)
        connection.sendall(json.dumps(argv).encode() + b"\n")
        reply_text = _read_message(connection)
    if not reply_text:
        print("bench worker closed the connection without an answer", file=sys.stderr)
        return 1
    reply = json.loads(reply_text)
    if not reply["ok"]:
        print(reply["error"], file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--serve-worker"]:
        serve_points(argv[1])
        return 0
    if argv[:1] == ["--worker"]:
        return send_point(argv[1], argv[2:])
    run_point(argv)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
