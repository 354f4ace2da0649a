"""The production Triton kernels compile for sm_90 (the H200) on this CPU machine: Triton's own offline compiler and
bundled ptxas, the launch arguments bound by Triton's binder as the JIT binds them on the GPU
(`bench/compile_report.compile_launch`). The interpreter runs kernels as Python and never types them as the
compiler does (every `return` it reaches, dead constexpr branches included), so a kernel can pass every interpreter
test and still fail its first compile on the GPU, as the boundary-state kernel once did ("Inconsistent return types:
int32 and fp32" from a chain's placeholder pointer). Launches are captured from the kernels' Python entry points
with `JITFunction.run` recorded, not run, at Qwen3.5 GDN sizes (H=16, HV=32, K=V=128, conv width 4), in a process
of its own without the interpreter (Triton compiles only JIT functions, and the test process's are interpreted).

    python3 -m tests.kernels.test_sm90_compile CASE     # one case, what the test runs"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys

import pytest
import torch
from triton.runtime.jit import JITFunction

from bench.kernels.compile_report import compile_launch, step_case
from vllm_treewy.kernels.bookkeeping.boundary_states_torch import BoundaryLayer
from vllm_treewy.kernels.factor_rows import slot_factor_width
from vllm_treewy.kernels.ancestor_table_torch import ancestor_table_torch
from vllm_treewy.kernels.bookkeeping import slot_counts_triton
from vllm_treewy.kernels.conv_step_triton import conv_step_triton
from vllm_treewy.kernels.bookkeeping.boundary_states_triton import boundary_table, record_accepted_and_boundaries_triton
from vllm_treewy.kernels.top_children_triton import top_children_triton
from vllm_treewy.tree import DraftTree, pack_trees

H, HV, K, V, W1, T = 16, 32, 128, 128, 3, 4
CONV_DIM = 2 * H * K + HV * V
SLOTS, ROWS, BLOCK_SIZE = 8, 4, 16


@contextlib.contextmanager
def recorded_launches():
    """Inside: every kernel launch is appended to the yielded list as `(JITFunction, args, kwargs)` and not run."""
    launches = []
    original = JITFunction.run

    def record(self, *args, grid, warmup, **kwargs):
        launches.append((self, args, kwargs))

    JITFunction.run = record
    try:
        yield launches
    finally:
        JITFunction.run = original


def boundary_launches(state_dtype, commit_ancestors=None):
    state = torch.zeros(SLOTS, HV, V, K, dtype=state_dtype)
    factors = torch.zeros(SLOTS, T, slot_factor_width(HV, K, V))
    conv_history = torch.zeros(SLOTS, CONV_DIM, W1, dtype=torch.bfloat16)
    conv_inputs = torch.zeros(SLOTS, T, CONV_DIM, dtype=torch.bfloat16)
    counts = torch.zeros(SLOTS, dtype=torch.int32)
    block_table = torch.zeros(ROWS, 4, dtype=torch.int32)
    layers = [BoundaryLayer(state, factors, conv_history, conv_inputs, counts, block_table)]
    rows = torch.zeros(ROWS, dtype=torch.int32)
    with recorded_launches() as launches:
        record_accepted_and_boundaries_triton(layers, boundary_table(layers), rows, rows, rows, ROWS,
                                              block_size=BLOCK_SIZE, null_block=0, commit_ancestors=commit_ancestors)
    return launches


def slot_count_launches():
    counts = torch.zeros(SLOTS, dtype=torch.int32)
    rows = torch.zeros(ROWS, dtype=torch.int32)
    table = slot_counts_triton.count_table([(counts, torch.zeros(ROWS, 4, dtype=torch.int32))])
    with recorded_launches() as launches:
        slot_counts_triton.commit_nodes_and_counts_triton(counts, rows, torch.arange(ROWS + 1, dtype=torch.int32),
                                                   rows.clone(), rows.clone(), rows.clone(), 0)
        slot_counts_triton.commit_nodes_and_counts_triton(counts, rows, torch.arange(ROWS + 1, dtype=torch.int32),
                                                   rows.clone(), rows.clone(), None, 0, rows.clone())  # V2's counts
        slot_counts_triton.record_accepted_counts_triton(table, rows, rows, ROWS)
        slot_counts_triton.record_sampled_counts_triton(table, rows, rows, ROWS)
    return launches


def conv_launches(widths):
    """The conv step with the previous step's commit, for chains of T nodes or trees of `widths` (with the root)."""
    tree = DraftTree.from_widths(widths).with_root() if widths else DraftTree.from_widths([1] * (T - 1)).with_root()
    packed, one = pack_trees([tree] * ROWS), pack_trees([tree])
    x = torch.zeros(packed.num_nodes, CONV_DIM, dtype=torch.bfloat16)
    conv_state = torch.zeros(SLOTS, CONV_DIM, W1, dtype=torch.bfloat16)
    weight, bias = torch.zeros(CONV_DIM, W1 + 1, dtype=torch.bfloat16), torch.zeros(CONV_DIM, dtype=torch.bfloat16)
    inputs = torch.zeros(SLOTS, tree.num_nodes, CONV_DIM, dtype=torch.bfloat16)
    commit_ancestors = ancestor_table_torch(one.parents, one.cu_nodes, one.max_depth) if widths else None
    with recorded_launches() as launches:
        conv_step_triton(x, conv_state, torch.arange(ROWS, dtype=torch.int32), weight, bias, packed.parents,
                         packed.cu_nodes, inputs, torch.zeros(ROWS, dtype=torch.int32),
                         commit_ancestors=commit_ancestors, activation="silu")
    return launches


def step_launches_of(state_dtype, tokens, widths=None, mode="fused"):
    """`gdn_step_triton`'s launches as `bench/compile_report.step_case` builds them."""
    return [(kernel, args, kwargs) for kernel, _, args, kwargs in step_case(state_dtype, tokens, ROWS, widths, mode)]


def top_children_launches():
    """A drafting level's top children at Qwen3.5's vocab (248,320: chunks past one, the last one partial), bf16
    logits (the MTP head's) at width 2 and fp32 at width 3."""
    with recorded_launches() as launches:
        top_children_triton(torch.zeros(ROWS, 248320, dtype=torch.bfloat16), 2)
        top_children_triton(torch.zeros(ROWS, 248320, dtype=torch.float32), 3)
    return launches


CASES = {
    "boundary fp32": lambda: boundary_launches(torch.float32),
    "boundary bf16": lambda: boundary_launches(torch.bfloat16),
    # a draft tree's commit table ([2,2,1] and its chain of depth 3: 11 + 4 rows, 4 columns)
    "boundary tree fp32": lambda: boundary_launches(torch.float32, torch.zeros(15, 4, dtype=torch.int32)),
    "slot counts": slot_count_launches,
    "conv chain": lambda: conv_launches(None),
    "conv tree 2,2,1": lambda: conv_launches([2, 2, 1]),
    "step chain fused fp32": lambda: step_launches_of(torch.float32, T),
    "step tree 2,2,1 fused bf16": lambda: step_launches_of(torch.bfloat16, None, [2, 2, 1]),
    "step chain commit alone fp32": lambda: step_launches_of(torch.float32, T, mode="commit"),
    "top children": top_children_launches,
}


def compile_case(case: str) -> None:
    launches = CASES[case]()
    assert launches, "no launch captured"
    for kernel, args, kwargs in launches:
        assert compile_launch(kernel, args, kwargs).asm["cubin"], kernel.fn.__name__


@pytest.mark.parametrize("case", list(CASES))
def test_kernel_compiles_for_sm90(case):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-m", "tests.kernels.test_sm90_compile", case], env=env,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]


if __name__ == "__main__":
    assert os.environ.get("TRITON_INTERPRET") != "1", "compiles JIT functions: run without the interpreter"
    compile_case(sys.argv[1])
