"""bench/e2e/membound_ceiling.py counts the 27B shape's matrices as its model card has them, and its bound holds."""

import json
import shutil
from pathlib import Path

from bench.e2e.membound_ceiling import main, shape_costs
from bench.sweep.models import QWEN35_27B

MEMBOUND = Path(__file__).parents[2] / "bench/results/gpu_vllm_e2e/membound_27b_gmu0.9"


def test_matrix_flops_of_the_27b_shape():
    costs = shape_costs(QWEN35_27B)
    hidden, mlp = 5120, 3 * 5120 * 17408
    # in_proj_qkv (2 x 16 x 128 keys + 48 x 128 values), in_proj_z, in_proj_a/b (48 each), out_proj
    gdn = hidden * (2 * 2048 + 6144 + 6144 + 2 * 48) + 6144 * hidden + mlp
    # q_proj with its output gate (2 x 24 x 256), k/v_proj (4 x 256 each), o_proj
    attention = hidden * (2 * 6144 + 2 * 1024) + 6144 * hidden + mlp
    assert costs.target_layer_flops == 2 * (48 * gdn + 16 * attention)
    assert costs.mtp_layer_flops == 2 * (2 * hidden * hidden + attention)
    assert costs.logit_row_flops == 2 * 248320 * hidden
    assert costs.gdn_state_bytes == 48 * 128 * 128 * 4 and costs.gdn_layers == 48
    # the card's 27B: layers, embedding and lm_head
    assert abs((costs.target_layer_flops / 2 + 2 * 248320 * hidden) / 1e9 - 26.9) < 0.05


def test_bound_below_what_the_h200_measured(tmp_path, capsys):
    for name in ("reconstruct.json", "store_all.json"):
        shutil.copy(MEMBOUND / name, tmp_path / name)
    assert main([str(tmp_path)]) == 0
    report = json.loads((tmp_path / "ceiling.json").read_text())
    for strategy in report["strategies"].values():
        assert strategy["lower_bound_prefill_s"] < strategy["lower_bound_matrix_s"] < strategy["lower_bound_s"]
        assert 1.0 < strategy["measured_over_lower_bound"] < 3.0
    # the same matrix work, store_all's 1 + k state writes against reconstruct's 1
    rc, sa = report["strategies"]["reconstruct"], report["strategies"]["store_all"]
    assert abs(rc["matrix_flops"] / sa["matrix_flops"] - 1) < 1e-3
    assert 2.0 < sa["gdn_state_bytes"] / rc["gdn_state_bytes"] < 2.5
    assert report["measured_ratio"] < report["ratio_with_gdn_step_at_bound"] < report["ratio_with_gdn_step_free"]
    assert "reconstruct / store_all measured 1.136" in capsys.readouterr().out
