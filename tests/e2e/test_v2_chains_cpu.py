"""Reconstruct chains on Model Runner V2 on CPU (`tests/e2e/v2_chains_cpu.py`, in a process of its own: V2 forced on,
its Triton kernels interpreted), against V2's no-speculation engine: there the next step commits from V2's own
accepted counts, with nothing of ours after sampling (`gdn.step_metadata`, `v2.accepted_counts`)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def v2_runs(fixture_model) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    result = subprocess.run([sys.executable, "-m", "tests.e2e.v2_chains_cpu", fixture_model], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=2400)
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_the_runs_are_on_model_runner_v2(v2_runs):
    assert v2_runs["v2"] is True


@pytest.mark.parametrize("name", ["reconstruct-k1", "reconstruct-k3", "reconstruct-k1-triton"])
def test_reconstruct_chains_on_v2_are_equivalent_to_no_speculation(v2_runs, name):
    run = v2_runs["runs"][name]
    assert run["passed"], run["summary"]
    assert run["accepted"] > 0
    assert run["mixed_batches"] > 0, "no batch mixed prefills with speculative decodes"
