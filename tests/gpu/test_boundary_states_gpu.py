"""The align-mode post-sampling kernel (`kernels.bookkeeping.boundary_states_triton`) compiled on CUDA at Qwen3.5 GDN
sizes (HV=32, K=V=128, conv 8192 channels, k = 3): three layers in two KV-cache groups, 64 rows of every kind
(boundaries at the root, inside the drafts and at the last accepted node, in place, freed boundary columns, rows that do
not speculate), fp32 and bf16 states. Equal to its torch twin (counts and conv windows exactly, states within fp32
rounding) and to the GDN step's own commit (`gdn_commit_triton`) of the same node: an fp32 state within 1e-6, a bf16
state within one bf16 step per element plus 1e-6 of its scale (two compiled kernels may contract their fp32 sums
differently before the rounding; the interpreter's bit-for-bit equality does not carry over); nothing else written.
Model Runner V2's variant (block-table rows per request through `idx_mapping`, int64 as V2 keeps it; drafts read from
the slots' counts by `sampled_rows_triton`) writes what V1's variant writes on the same rows in batch order. Run on the
H200: `pytest -m gpu tests/gpu` (bench/run_gpu_prefix_caching.sh runs this file beside its engines)."""

import pytest
import torch

from vllm_treewy.kernels.bookkeeping.boundary_states_torch import (
    BoundaryLayer,
    boundary_rows,
    record_accepted_and_boundaries_torch,
)
from vllm_treewy.kernels.factor_rows import slot_factor_width

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

from vllm_treewy.kernels.gdn_step_triton import gdn_commit_triton  # noqa: E402
from vllm_treewy.kernels.bookkeeping.boundary_states_triton import (  # noqa: E402
    boundary_table,
    record_accepted_and_boundaries_triton,
    sampled_rows_triton,
)

H, HV, K, V, T, W1 = 16, 32, 128, 128, 4, 3
CONV_DIM = 2 * H * K + HV * V
NULL, BLOCK_SIZE, ROWS, SLOTS = 0, 16, 64, 160


def _rows(gen):
    """(seq_lens, draft tokens, accepted) of ROWS rows: a quarter not speculating or with no drafts, the rest with
    their verified block placed so that its boundary falls at the root, inside, at the last accepted node or at the
    block's end with all accepted (in place)."""
    seq_lens, drafts, accepted = [], [], []
    for r in range(ROWS):
        draft = [-1, 0, 3, 3][r % 4]
        accept = 1 if draft <= 0 else int(torch.randint(1, draft + 2, (1,), generator=gen))
        ends = [0, accept - 1, draft if draft > 0 else 0, None][(r // 4) % 4]
        if ends == draft and draft > 0:
            accept = draft + 1
        running = (2 + r % 5) * BLOCK_SIZE - ends if ends is not None else 1 + int(torch.randint(0, 80, (1,),
                                                                                                   generator=gen))
        seq_lens.append(running + max(draft, 0))
        drafts.append(draft)
        accepted.append(accept)
    return [torch.tensor(x, dtype=torch.int32) for x in (seq_lens, drafts, accepted)]


def _tables(seq_lens, drafts, accepted, gen, groups=2):
    info = boundary_rows(seq_lens, drafts, accepted, ROWS, BLOCK_SIZE)
    columns = int(seq_lens.max()) // BLOCK_SIZE + 1
    tables = []
    for _ in range(groups):
        table = torch.randint(1, SLOTS, (ROWS, columns), dtype=torch.int32, generator=gen)  # stale ids elsewhere
        blocks = (torch.randperm(SLOTS - 1, generator=gen) + 1).tolist()
        for i, row in enumerate(info.rows.tolist()):
            table[row, info.slot_columns[i]] = blocks.pop()
            if info.nodes[i] >= 0 and info.dest_columns[i] != info.slot_columns[i]:
                table[row, info.dest_columns[i]] = NULL if row % 9 == 0 else blocks.pop()  # some columns freed
        tables.append(table.cuda())
    return tables, info


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_boundary_kernel_matches_twin_and_commit(state_dtype):
    gen = torch.Generator().manual_seed(7)
    seq_lens, drafts, accepted = _rows(gen)
    tables, info = _tables(seq_lens, drafts, accepted, gen)
    width = slot_factor_width(HV, K, V)
    layers = []
    for i in range(3):
        state = (torch.randn(SLOTS, HV, V, K, generator=gen) * 0.3).to(state_dtype).cuda()
        factors = torch.randn(SLOTS, T, width, generator=gen)
        factors[..., HV * (K + 1 + V):] = -torch.rand(SLOTS, T, HV, generator=gen)  # log decays <= 0
        conv = torch.randn(SLOTS, CONV_DIM, W1 + T - 1, generator=gen).bfloat16().cuda()
        inputs = torch.randn(SLOTS, T, CONV_DIM, generator=gen).bfloat16().cuda()
        counts = torch.randint(0, 5, (SLOTS, 2), dtype=torch.int32, generator=gen).cuda()[:, 1]
        layers.append(BoundaryLayer(state, factors.cuda(), conv[:, :, :W1], inputs, counts, tables[i % 2]))
    before = [BoundaryLayer(*(t.clone() for t in layer)) for layer in layers]
    twin = [BoundaryLayer(*(t.clone() for t in layer)) for layer in layers]
    args = (seq_lens.cuda(), drafts.cuda(), accepted.cuda(), ROWS)
    record_accepted_and_boundaries_torch(twin, *args, block_size=BLOCK_SIZE, null_block=NULL)
    record_accepted_and_boundaries_triton(layers, boundary_table(layers), *args, block_size=BLOCK_SIZE,
                                          null_block=NULL)
    torch.cuda.synchronize()
    written_rows = 0
    for number, (layer, old, ref) in enumerate(zip(layers, before, twin)):
        assert torch.equal(layer.counts, ref.counts)
        assert torch.equal(layer.conv_history, ref.conv_history)
        assert torch.equal(layer.factors, old.factors) and torch.equal(layer.conv_inputs, old.conv_inputs)
        scale = ref.state.double().abs().max()
        assert float((layer.state.double() - ref.state.double()).abs().max() / scale) <= (
            2e-6 if state_dtype == torch.float32 else 1e-2)
        for i, row in enumerate(info.rows.tolist()):
            slot = int(layer.block_table[row, info.slot_columns[i]])
            dest = int(layer.block_table[row, info.dest_columns[i]])
            if info.nodes[i] < 0 or dest == NULL:
                continue
            written_rows += number == 0
            committed = old.state.clone()
            gdn_commit_triton(committed, torch.tensor([slot], dtype=torch.int32, device="cuda"), old.factors,
                              torch.tensor([int(info.nodes[i])], dtype=torch.int32, device="cuda"), num_key_heads=H)
            written, expected = layer.state[dest].double(), committed[slot].double()
            if state_dtype == torch.float32:
                assert float((written - expected).abs().max() / expected.abs().max()) <= 1e-6
            else:  # fp32 sums equal up to the compilers' contractions (1e-6 of the state's scale), then one rounding
                scale = expected.abs().max()
                bound = torch.finfo(state_dtype).eps * torch.maximum(written.abs(), expected.abs()) + 1e-6 * scale
                excess = (written - expected).abs() - bound
                assert bool((excess <= 0).all()), (
                    f"{int((excess > 0).sum())} of {excess.numel()} elements beyond one bf16 step; largest difference "
                    f"{float((written - expected).abs().max() / scale):.2e} of the state's scale")
    assert written_rows >= ROWS // 3  # most speculating rows reached a boundary


def test_v2_variant_writes_what_the_batch_rows_write():
    """V2's rows: the requests' block-table rows in a table twice the batch (stale rows between), reached through
    idx_mapping (every eighth row skipped: -1); the rows' drafts from the first layer's slot counts (the step's count
    update: node counts in the speculative rows' slots, 0 in the others'), accepted = max(num_sampled, 1). Both
    compiled variants, counts and conv windows exactly, states within fp32 rounding of each other."""
    gen = torch.Generator().manual_seed(11)
    seq_lens, drafts, accepted = _rows(gen)
    tables, info = _tables(seq_lens, drafts, accepted, gen, groups=1)
    table = tables[0].cpu()
    skipped = torch.arange(ROWS) % 8 == 5
    for row in range(ROWS):  # the non-speculative rows' slots: their own, holding 0 (null here)
        if drafts[row] < 0:
            table[row, (int(seq_lens[row]) - 1) // BLOCK_SIZE] = NULL
    width = slot_factor_width(HV, K, V)
    state = (torch.randn(SLOTS, HV, V, K, generator=gen) * 0.3).cuda()
    factors = torch.randn(SLOTS, T, width, generator=gen)
    factors[..., HV * (K + 1 + V):] = -torch.rand(SLOTS, T, HV, generator=gen)
    conv = torch.randn(SLOTS, CONV_DIM, W1 + T - 1, generator=gen).bfloat16().cuda()
    inputs = torch.randn(SLOTS, T, CONV_DIM, generator=gen).bfloat16().cuda()
    counts = torch.zeros(SLOTS, 2, dtype=torch.int32)[:, 1]
    for row in range(ROWS):
        if drafts[row] >= 0:
            counts[table[row, (int(seq_lens[row]) - 1) // BLOCK_SIZE]] = int(drafts[row]) + 1
    counts = counts.cuda()
    order = torch.randperm(2 * ROWS, generator=gen)[:ROWS]
    v2_table = torch.randint(1, SLOTS, (2 * ROWS, table.shape[1]), dtype=torch.int32, generator=gen)
    v2_table[order] = table
    idx_mapping = torch.where(skipped, -1, order).cuda()  # int64, as V2's
    num_sampled = torch.where(drafts < 0, 0, accepted).cuda()
    v1 = BoundaryLayer(state.clone(), factors.cuda(), conv.clone()[:, :, :W1], inputs, counts.clone(),
                       table.masked_fill(skipped[:, None], NULL).cuda())
    v2 = BoundaryLayer(state.clone(), factors.cuda(), conv.clone()[:, :, :W1], inputs, counts.clone(), v2_table.cuda())
    v1_drafts = torch.where(skipped, -1, drafts).cuda()
    rows = sampled_rows_triton(v2.counts, v2.block_table, idx_mapping, seq_lens.cuda(), num_sampled, ROWS,
                               block_size=BLOCK_SIZE, null_block=NULL)
    assert torch.equal(rows[0], v1_drafts) and torch.equal(rows[1], num_sampled.clamp(min=1))
    record_accepted_and_boundaries_triton([v1], boundary_table([v1]), seq_lens.cuda(), v1_drafts,
                                          num_sampled.clamp(min=1).to(torch.int32), ROWS, block_size=BLOCK_SIZE,
                                          null_block=NULL)
    record_accepted_and_boundaries_triton([v2], boundary_table([v2]), seq_lens.cuda(), *rows, ROWS,
                                          block_size=BLOCK_SIZE, null_block=NULL, idx_mapping=idx_mapping)
    torch.cuda.synchronize()
    assert torch.equal(v2.counts, v1.counts) and torch.equal(v2.conv_history, v1.conv_history)
    assert not torch.equal(v2.state, state)  # boundaries were reached
    scale = v1.state.double().abs().max()
    assert float((v2.state.double() - v1.state.double()).abs().max() / scale) <= 2e-6
