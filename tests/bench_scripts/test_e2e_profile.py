"""The pure part of the end-to-end profile (bench/e2e/e2e_profile.py): kernel kinds, busy time, per-token figures."""

from hypothesis import given
from hypothesis import strategies as st

from bench.e2e.e2e_profile import KernelEvent, busy_us, is_engine_step, kind_of, summarize


def test_kinds_by_name():
    assert kind_of("_conv_step_kernel") == "treewy GDN step"
    assert kind_of("_state_pass_kernel") == kind_of("_request_epilogue_kernel") == "treewy GDN step"
    assert kind_of("_path_epilogue_kernel") == "treewy GDN step"
    assert kind_of("void fused_gdn_decode_post_conv_mtp_kernel<float>(...)") == "vLLM GDN"
    assert kind_of("kernel_unified_attention_3d") == "attention"
    assert kind_of("nvjet_tst_128x64_64x4_1x2_h_bz_coopA_NNT") == "GEMM"
    assert kind_of("fused_moe_kernel") == kind_of("void moe_align_block_size_kernel<int>(...)") == "MoE"
    assert kind_of("void topkGatingSoftmax<float, 8, 256>(...)") == "MoE"
    assert kind_of("something_else") == "other"


def test_busy_time_is_the_union_of_intervals():
    events = [KernelEvent("a", 0, 10), KernelEvent("b", 5, 10), KernelEvent("c", 30, 5), KernelEvent("d", 31, 1)]
    assert busy_us(events) == 20.0  # [0, 15) and [30, 35)


@given(st.lists(st.tuples(st.floats(0, 1e3), st.floats(0, 1e2)), max_size=30))
def test_busy_time_bounds(intervals):
    events = [KernelEvent("k", s, d) for s, d in intervals]
    busy = busy_us(events)
    assert busy <= sum(d for _, d in intervals) + 1e-6
    assert busy >= max((d for _, d in intervals), default=0.0) - 1e-6


def test_summary_per_token():
    events = [KernelEvent("_state_pass_kernel", 0, 30), KernelEvent("nvjet_gemm", 40, 50)]
    summary = summarize(events, wall_s=200e-6, output_tokens=2)
    assert summary["wall_us_per_token"] == 100.0
    assert summary["gpu_busy_us_per_token"] == 40.0
    assert summary["host_us_per_token"] == 60.0
    assert list(summary["kinds"]) == ["GEMM", "treewy GDN step"]
    assert summary["kinds"]["treewy GDN step"]["us_per_token"] == 15.0
    assert summary["kinds"]["GEMM"]["launches_per_token"] == 0.5


def test_most_launched_kernels_per_token():
    events = [KernelEvent("index_put_" + "x" * 300, 10 * i, 1) for i in range(6)]
    events += [KernelEvent("direct_copy_kernel", 100 + 10 * i, 5) for i in range(2)]
    launched = summarize(events, wall_s=1e-3, output_tokens=2)["kinds"]["sampling and copies"]["most_launched"]
    assert list(launched.values()) == [3.0, 1.0]  # per token, most launched first
    assert len(next(iter(launched))) == 160


def test_an_engine_step_is_either_runners_execute_model():
    site = "/venv/lib/python3.12/site-packages/vllm/v1/worker"
    assert is_engine_step((f"{site}/gpu_model_runner.py", 3000, "execute_model"))  # V1
    assert is_engine_step((f"{site}/gpu/model_runner.py", 1718, "execute_model"))  # Model Runner V2
    assert not is_engine_step((f"{site}/gpu_worker.py", 1300, "execute_model"))  # the worker around either
    assert not is_engine_step((f"{site}/worker_base.py", 365, "execute_model"))
    assert not is_engine_step((f"{site}/gpu/model_runner.py", 1592, "sample"))
