"""bench/host/step_ops.py attributes each counted op to the innermost vllm or vllm_treewy frame, and skips views."""

import torch

from bench.host.step_ops import UNKNOWN_SITE, SiteOps, call_site, op_name

VENV = "/venv/lib/python3.12/site-packages"


def test_the_call_site_is_the_innermost_frame_in_vllm_or_vllm_treewy():
    frames = [
        (f"{VENV}/torch/_tensor.py", 10, "__setitem__"),
        ("/work/wt/vllm_treewy/vllm_plugin/gdn/step_metadata.py", 131, "with_commit_nodes"),
        (f"{VENV}/vllm/v1/attention/backends/gdn_attn.py", 300, "build"),
    ]
    assert call_site(frames) == "vllm_treewy/vllm_plugin/gdn/step_metadata.py:131 with_commit_nodes"
    assert call_site(frames[2:]) == "vllm/v1/attention/backends/gdn_attn.py:300 build"
    assert call_site(frames[:1]) == UNKNOWN_SITE


def test_the_path_starts_at_the_last_package_directory():
    # a checkout under a directory named vllm: the package is the innermost vllm directory
    assert call_site([("/src/vllm/vllm/v1/utils.py", 143, "copy_to_gpu")]) == "vllm/v1/utils.py:143 copy_to_gpu"


def test_views_and_allocations_are_not_counted_and_data_ops_are_by_call_site():
    site_ops = SiteOps()
    counts = torch.zeros(8, dtype=torch.int32)
    with site_ops:
        counts[1:3].view(-1)  # views: no launch
        torch.empty(4)  # allocation: no launch
        counts[torch.tensor([1, 2])] = 3  # one index_put_
        counts.sum().item()  # a reduction, then a host sync
    names = sorted(name for _, name in site_ops.ops)
    assert names == ["HOST SYNC _local_scalar_dense", "index_put_", "sum"]
    assert {site for site, _ in site_ops.ops} == {UNKNOWN_SITE}  # this file is in neither package


def test_op_names_of_views_and_allocations_are_none():
    assert op_name(torch.ops.aten.view.default) is None
    assert op_name(torch.ops.aten.empty_strided.default) is None
    assert op_name(torch.ops.aten.index_put_.default) == "index_put_"


def test_no_triton_launch_is_counted_inside_a_suspended_model_forward():
    """The model forwards are CUDA graph replays on the GPU: the GDN layers' count update launched there is no host
    launch, whatever the interpreter runs."""
    site_ops = SiteOps()
    site_ops.active = True
    forward = site_ops.suspended(lambda: site_ops.count_triton_launch("_commit_nodes_kernel"))
    assert forward() is False and site_ops.count_triton_launch("_record_sampled_counts_kernel") is True
    assert [name for _, name in site_ops.ops] == ["TRITON LAUNCH _record_sampled_counts_kernel"]
