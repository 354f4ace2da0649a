"""vLLM's rejection sampler expands each request's sampling parameters to its draft tokens; on the CPU backend the
plugin's expansion (`compat.cpu_rejection_expand`) is what runs, and it gives every token its request's own values."""

import pytest
import torch
from vllm.platforms import current_platform

from vllm_treewy.vllm_plugin.compat import cpu_rejection_expand

pytestmark = pytest.mark.skipif(not current_platform.is_cpu(), reason="vLLM's CPU platform replaces the kernel")


@pytest.fixture(autouse=True)
def registered_as_the_worker_does():
    cpu_rejection_expand.install()
    current_platform.register_triton_kernel_overrides()  # WorkerWrapperBase.init_worker, after plugins load


@pytest.mark.parametrize("values, replace_from, replace_to", [
    (torch.tensor([0.8, 0.0, 0.7], dtype=torch.float32), 0.0, 1.0),  # temperature: greedy 0 read as 1
    (torch.tensor([5, 0, 8], dtype=torch.int32), 0, 0),  # top-k
    (torch.tensor([0.95, 1.0, 0.9], dtype=torch.float32), 0, 0),  # top-p
    (torch.tensor([3, 4, 5], dtype=torch.int64), 0, 0),
])
def test_every_draft_token_gets_its_requests_value(values, replace_from, replace_to):
    from vllm.v1.sample.rejection_sampler import expand_batch_to_tokens

    cu_num_tokens = torch.tensor([3, 3, 7], dtype=torch.int32)  # 3, 0 and 4 draft tokens
    expanded = expand_batch_to_tokens(values, cu_num_tokens, 7, replace_from=replace_from, replace_to=replace_to)
    replaced = torch.where(values == replace_from, torch.full_like(values, replace_to), values)
    assert expanded.dtype == values.dtype
    assert torch.equal(expanded, torch.cat([replaced[0].repeat(3), replaced[2].repeat(4)]))
