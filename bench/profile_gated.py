"""One fused GDN step for ncu: `ncu --clock-control none -k regex:'_gated_step_kernel|_state_pass_kernel|
_row_epilogue_kernel' --launch-skip 6L --launch-count L python3 bench/profile_gated.py [fp32|bf16] T B
['{"block_k": 32, "state_dot": true, ...}']` with L the step's launches (2: the state pass and the row epilogue,
the defaults up to 8 nodes; 1: the one kernel); the JSON: `gdn_step_triton`'s launch options, none = its defaults
(`bench/device_gated.sh` runs it)."""

import json
import sys

import torch

from gated_bench import Step

name, T, B = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
config = json.loads(sys.argv[4]) if len(sys.argv) > 4 else {}
step = Step(T, B, {"fp32": torch.float32, "bf16": torch.bfloat16}[name], sets=4)
step.fill_prev(config)  # 4 steps, then the profiled ones
for s in range(4):
    step.ours(s, config)()
torch.cuda.synchronize()
print("ok")
