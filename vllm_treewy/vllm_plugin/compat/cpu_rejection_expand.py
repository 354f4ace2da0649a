"""vLLM's rejection sampler on its CPU backend: per-token sampling parameters that are the requests' own.

`rejection_sampler.apply_sampling_constraints` expands each request's temperature, top-k and top-p to its draft
tokens through `expand_batch_to_tokens`, whose kernel the CPU platform replaces by
`cpu_triton_utils._expand_kernel_impl` (vLLM's CPU wheel has no Triton). In vLLM 0.32 that replacement hands the
int64 C++ op converted copies of a float32 or int32 output and input, and never copies the result back: the draft
rows' temperature, top-k and top-p stay uninitialized memory (and floats would be truncated to integers), so the
target probabilities of every draft token are arbitrary and speculative sampling at temperature > 0 does not follow
the model's distribution (greedy requests batched with sampled ones are hit too). `expand_per_token` is the same
expansion in torch, in the output's own dtype; the CPU platform reads `_expand_kernel_impl` when the worker
registers its overrides, after plugins load, so rebinding it at plugin load is enough.
"""

from __future__ import annotations

import torch

from vllm_treewy.vllm_plugin.patch_points import CPU_REJECTION_EXPAND


def expand_per_token(output: torch.Tensor, input_val: torch.Tensor, cu_num_tokens: torch.Tensor, replace_from,
                     replace_to, MAX_NUM_TOKENS=None) -> None:  # noqa: N803 (the kernel's parameter name)
    """`output[t] = input_val[request of t]` (`replace_from` read as `replace_to`) for the `cu_num_tokens [B]`
    (inclusive cumulative counts) tokens of each request; `output` has `cu_num_tokens[-1]` entries."""
    counts = torch.diff(cu_num_tokens.long(), prepend=cu_num_tokens.new_zeros(1, dtype=torch.long))
    values = torch.where(input_val == replace_from, torch.full_like(input_val, replace_to), input_val)
    output.copy_(torch.repeat_interleave(values, counts, output_size=output.shape[0]).to(output.dtype))


def install() -> None:
    CPU_REJECTION_EXPAND.replace(expand_per_token)
