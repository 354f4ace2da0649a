"""One GDN step for ncu: `ncu --clock-control none -k regex:'_state_pass_kernel|_request_epilogue_kernel|
_path_epilogue_kernel' --launch-skip 12 --launch-count 2 python3 bench/kernels/profile_gated.py [fp32|bf16] T B
['{"state_rows": 64, "state_block_k": 64, "state_warps": 4, "epilogue_warps": 1}']`: 4 steps with nothing to
commit (the slot sets' previous step), then 4 with the commit, two launches each (the state pass and the epilogue);
skipping 6 steps' launches profiles a committing step with its states out of L2. The JSON: a `StepLaunch`, none =
the launch table's."""

import json
import sys

import torch

from gated_bench import Step
from vllm_treewy.kernels.gdn_step_triton import StepLaunch

name, T, B = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
launch = StepLaunch(**json.loads(sys.argv[4])) if len(sys.argv) > 4 else None
step = Step(T, B, {"fp32": torch.float32, "bf16": torch.bfloat16}[name], sets=4)
step.fill_prev(launch)
for s in range(4):
    step.ours(s, launch)()
torch.cuda.synchronize()
print("ok")
