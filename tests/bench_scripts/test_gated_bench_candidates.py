"""bench/gated_bench.py's candidates: the first per state is the launch default at T=4 for large batches (it alone is
checked against vLLM's compiled kernel, and the tuning's verdict on a new default is read against it), the second
for small ones, and each is the launch it names at every T and batch."""

import pytest
import torch

from bench.gated_bench import CONFIGS
from vllm_treewy.kernels.triton.gated import launch_defaults


@pytest.mark.parametrize("name,dtype", [("fp32", torch.float32), ("bf16", torch.bfloat16)])
def test_first_candidate_is_the_launch_default(name, dtype):
    # the bench's shape: H=16, HV=32 (two value heads a key head), K=128, a chain of 4 nodes; the first candidate
    # is the default of the tuning batch (64), the second that of small batches (1)
    for batch, first in ((64, 0), (1, 1)):
        default = launch_defaults(dtype, batch, 128, max_nodes=4)
        assert {**default, **CONFIGS[name][first]} == default
        assert all({**default, **other} != default for i, other in enumerate(CONFIGS[name]) if i != first)


@pytest.mark.parametrize("name", ["fp32", "bf16"])
def test_candidates_leave_no_option_to_the_defaults(name):
    # `gdn_step_triton` fills an option given as None from `launch_defaults`: a candidate "without a register cap"
    # written as max_registers=None ran capped at 128 wherever the default caps (2026-12-01f: bf16 two heads at
    # T=4 spilled, 329.6 us against 147.4 uncapped in 2026-12-01e)
    for config in CONFIGS[name]:
        assert all(value is not None for value in config.values()), config
