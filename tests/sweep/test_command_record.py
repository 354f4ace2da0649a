"""What a grid split over device calls records: every call's command, and servers sized for the grid."""

import json
from types import SimpleNamespace

from bench.sweep.grids import GRIDS
from bench.sweep.run import write_command_record


def test_a_grid_split_over_calls_keeps_every_calls_command(tmp_path):
    env = {"TRITON_CACHE_AUTOTUNING": "1", "VLLM_API_KEY": "x", "PATH": "/bin"}
    plan = SimpleNamespace(grid=GRIDS["cpu-ci"], out=tmp_path, sweep_cmd=["s"], serve_cmd=["v"], bench_cmd=["b"], port=1,
                           env=env)
    for only in ("a", "b", "c"):
        write_command_record(plan, ["run", "cpu-ci", "--only", only])
    record = json.loads((tmp_path / "command.json").read_text())
    assert record["command"].endswith("--only c")
    assert [call["command"][-1] for call in record["earlier_calls"]] == ["a", "b"]
    assert record["environment"] == {"TRITON_CACHE_AUTOTUNING": "1"}  # no key, nothing outside vLLM / Triton / torch


def test_h200_servers_admit_the_grids_largest_concurrency():
    for name in ("h200-27b", "h200-27b-core"):
        grid = GRIDS[name]
        flags = list(grid.serve_flags)
        assert int(flags[flags.index("--max-num-seqs") + 1]) == max(grid.concurrencies)
