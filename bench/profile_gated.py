"""One fused GDN step launch for ncu: `ncu --clock-control none -k regex:_gated_step_kernel --launch-skip 6
--launch-count 1 python3 bench/profile_gated.py [fp32|bf16] T B ['{"block_k": 32, "state_dot": true, ...}']`
(the JSON: `gdn_step_triton`'s launch options; none = its defaults)."""

import json
import sys

import torch

from gated_bench import Step

name, T, B = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
config = json.loads(sys.argv[4]) if len(sys.argv) > 4 else {}
step = Step(T, B, {"fp32": torch.float32, "bf16": torch.bfloat16}[name], sets=4)
step.fill_prev(config)  # 4 launches, then the profiled ones
for s in range(4):
    step.ours(s, config)()
torch.cuda.synchronize()
print("ok")
