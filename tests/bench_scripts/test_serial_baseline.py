"""bench/kernels/serial_baseline.py's per-node serial kernel (the tree bench's yardstick) against the fp64 per-node
recurrence (Triton interpreter on CPU)."""

import torch

from bench.kernels.serial_baseline import serial_tree_triton
from tests.kernels.tree_cases import relative_error
from tests.kernels.triton_cases import DEVICE, TREE_BATCH, packed_gdn, rows, to_device
from vllm_treewy.kernels.reference import reference_tree_recurrence


def test_serial_baseline_matches_reference():
    packed, inputs, pool, slots = packed_gdn(TREE_BATCH, seed=41)
    state = pool.float()
    o, node_states = serial_tree_triton(*to_device(*inputs, state, slots, packed.parents, packed.cu_nodes),
                                        block_v=16)
    o, node_states = o.cpu(), node_states.cpu()
    for b, parents in enumerate(TREE_BATCH):
        r = rows(packed, b)
        expected = reference_tree_recurrence(*(x[r] for x in inputs), state[slots[b]], parents)
        assert relative_error(o[r], expected.o) <= 2e-5
        assert relative_error(node_states[r], expected.state) <= 2e-5
