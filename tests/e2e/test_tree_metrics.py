"""`LLM.get_metrics()` in vLLM's default multiprocess mode (engine core in its own process) shows the tree
fallbacks (`vllm:treewy_tree_fallbacks`, per engine, as vLLM labels its counters) and the acceptance per depth
(vLLM's per-position counter: position i is depth i + 1). `vllm serve`'s /metrics: `test_serve.py`."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e import tree_metrics_llm

pytestmark = pytest.mark.e2e

TIMEOUT_S = 300


def test_llm_get_metrics_in_multiprocess_mode_shows_tree_fallbacks_and_acceptance_per_depth(fixture_model):
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="1", VLLM_CPU_KVCACHE_SPACE="1")
    script = Path(tree_metrics_llm.__file__)
    done = subprocess.run([sys.executable, str(script), fixture_model], env=env, capture_output=True, text=True,
                          timeout=TIMEOUT_S, cwd=script.parents[2])
    log = done.stdout + done.stderr
    lines = [line for line in done.stdout.splitlines() if line.startswith(tree_metrics_llm.RESULT)]
    assert done.returncode == 0 and lines, log[-6000:]
    result = json.loads(lines[-1][len(tree_metrics_llm.RESULT):])
    assert result["engine_core_client"] != "InprocClient", result
    fallbacks = [m for m in result["metrics"] if m["name"] == "vllm:treewy_tree_fallbacks"]
    assert [m["labels"] for m in fallbacks] == [{"model_name": fixture_model, "engine": "0"}], result
    assert fallbacks[0]["value"] > 0, result
    per_depth = next(m["values"] for m in result["metrics"]
                     if m["name"] == "vllm:spec_decode_num_accepted_tokens_per_pos")
    assert per_depth[0] > 0 and not any(per_depth[3:]), result  # no path is deeper than the tree's 3 levels
    assert "request steps without speculation" in log  # the engine core's log line, in its process
