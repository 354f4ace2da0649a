"""What a soak must leave true, read from the server after the mix: each check is (passed, detail).

- `server_alive`: the process that started is still running (no restart) and /health answers 200;
- `no_engine_errors`: the log has no line of a dead engine core or a failed output handler;
- `no_failed_requests`: every request ended as planned (`driver.Outcome`);
- `refusals_say_why`: every 4xx message names the parameter it refuses;
- `kv_usage_zero`: once idle, vLLM's `vllm:kv_cache_usage_perc` is 0 and no request is running or waiting (every
  aborted and disconnected request freed its blocks);
- `greedy_replay_identical`: greedy requests sent alone after the soak give the tokens they gave before it. They run
  in GDN slots that aborted, dropped and preempted requests left, some with a commit pending: what shows that a
  slot's count state is reset for its next owner (`gdn.step_metadata`: the owner's first step writes 0 before any
  layer reads it). The count state itself is not readable through the server, and a scan of it would say nothing:
  it lives in the GDN page of vLLM's one KV pool, whose free blocks the attention layers reuse;
- `spec_metrics_consistent`: vLLM's acceptance counters: accepted <= drafted tokens, accepted <= drafts x depth,
  the per-position counters sum to the accepted ones and never grow with depth, none beyond the draft depth; tree
  engines export `vllm:treewy_tree_fallbacks`.
"""

from __future__ import annotations

import time

from bench.sweep.metrics import Sample, metric_sum

ACCEPTED = "vllm:spec_decode_num_accepted_tokens_total"
DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens_total"
DRAFTS = "vllm:spec_decode_num_drafts_total"
PER_POSITION = "vllm:spec_decode_num_accepted_tokens_per_pos_total"
FALLBACKS = "vllm:treewy_tree_fallbacks_total"
KV_USAGE = "vllm:kv_cache_usage_perc"
RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
PREEMPTIONS = "vllm:num_preemptions_total"


def per_position(samples: list[Sample]) -> dict[int, float]:
    counts: dict[int, float] = {}
    for s in samples:
        if s.name == PER_POSITION and "position" in s.labels:
            counts[int(s.labels["position"])] = counts.get(int(s.labels["position"]), 0.0) + s.value
    return dict(sorted(counts.items()))


def wait_idle(server, timeout_s: float) -> tuple[bool, dict]:
    """Polls /metrics until the KV usage is 0 with nothing running or waiting; (reached, last readings)."""
    deadline = time.monotonic() + timeout_s
    while True:
        samples = server.metrics()
        readings = {name: metric_sum(samples, name) for name in (KV_USAGE, RUNNING, WAITING)}
        if all(v == 0 for v in readings.values()) or time.monotonic() > deadline:
            return all(v == 0 for v in readings.values()), readings
        time.sleep(1)


def spec_metrics(samples: list[Sample], depth: int, tree: bool) -> tuple[bool, dict]:
    accepted, drafted, drafts = (metric_sum(samples, n) or 0 for n in (ACCEPTED, DRAFT_TOKENS, DRAFTS))
    positions = per_position(samples)
    values = list(positions.values())
    fallbacks = metric_sum(samples, FALLBACKS)
    detail = {"drafts": drafts, "draft_tokens": drafted, "accepted": accepted, "per_position": positions,
              "tree_fallbacks": fallbacks}
    problems = []
    if accepted > drafted:
        problems.append("accepted > drafted tokens")
    if accepted > drafts * depth:
        problems.append("accepted > drafts x depth")
    if abs(sum(values) - accepted) > 0.5:
        problems.append("per-position sum != accepted")
    if any(later > earlier for earlier, later in zip(values, values[1:])):
        problems.append("a deeper position accepted more than a shallower one")
    if any(v > 0 for p, v in positions.items() if p >= depth):
        problems.append(f"accepted beyond depth {depth}")
    if drafts == 0:
        problems.append("no drafts")
    if tree and fallbacks is None:
        problems.append("no vllm:treewy_tree_fallbacks")
    detail["problems"] = problems
    return not problems, detail
