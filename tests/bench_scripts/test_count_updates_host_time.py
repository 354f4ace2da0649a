"""bench/host/count_updates_host_time.py runs at the batch sizes its device call uses (its slots once ran out at 64)."""

import pytest

from bench.host.count_updates_host_time import main


@pytest.mark.parametrize("batch", [1, 64])
def test_every_path_runs_at_every_batch(batch, capsys):
    # on CPU the Triton path runs interpreted (the suite sets TRITON_INTERPRET=1)
    assert main(["--device", "cpu", "--batch", str(batch), "--groups", "3", "--calls", "2"]) == 0
    rows = {line.split()[0]: float(line.split()[-1]) for line in capsys.readouterr().out.splitlines()[2:]}
    assert set(rows) == {"torch", "triton"} and min(rows.values()) > 0
