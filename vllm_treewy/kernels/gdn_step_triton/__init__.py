"""The GDN layer's speculative decode step after the conv, in Triton (CUDA; CPU through TRITON_INTERPRET=1), on packed
draft chains and trees: `gdn_step_triton` (the previous step's commit, then the verify, in two launches) and
`gdn_commit_triton` (the commit alone), both in `step` with the launch table that tiles them. The launches' kernels:
`state_pass` (the commit and the committed state's products), `request_epilogue` and `path_epilogue` (the solve,
outputs and factor rows), `node_inputs` (what they load per request and node). Torch twin:
`vllm_treewy.kernels.gdn_step_torch`."""

from .step import LAUNCH_TABLE, StepLaunch, gdn_commit_triton, gdn_step_triton, step_launch, step_launches

__all__ = ["LAUNCH_TABLE", "StepLaunch", "gdn_commit_triton", "gdn_step_triton", "step_launch", "step_launches"]
