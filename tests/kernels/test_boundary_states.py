"""The align-mode post-sampling writes (`kernels.boundary_states`, `kernels.triton.boundary_states`): each speculative
row's accepted count into its slot and, where its accepted tokens reach a block boundary, the state and conv window
after the boundary's node into the boundary's block. On random batches of rows (speculative or not, zero-draft
rows, boundaries at the root, inside the drafts and at the last accepted node, the in-place case where the boundary
block is the slot, freed (null) boundary columns, null slots), several layers in one or two KV-cache groups, fp32 and
bf16 states, both conv layouts, strided pages: the Triton kernel (interpreter) equals the torch twin, both match the
fp64 per-node recurrence and the exact conv window, the counts follow the per-row semantics, nothing else in any
page changes, and the boundary state is bit for bit the commit the next step's state pass would make."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_treewy.kernels.boundary_states import (
    BoundaryLayer,
    boundary_rows,
    record_accepted_and_boundaries_torch,
    sampled_rows,
)
from vllm_treewy.kernels.factor_rows import slot_factor_width
from vllm_treewy.kernels.gdn_step_torch import gdn_step_packed
from vllm_treewy.kernels.reference import reference_gated_tree

from .test_gdn_step import STATE_TOLERANCE, gated_inputs
from .tree_cases import relative_error
from .triton_cases import DEVICE, rows

from vllm_treewy.kernels.triton import gdn_commit_triton  # noqa: E402
from vllm_treewy.kernels.triton.boundary_states import (  # noqa: E402
    boundary_table,
    record_accepted_and_boundaries_triton,
    sampled_rows_triton,
)

NULL_BLOCK = 0
KEY_HEADS, RATIO, KEY_DIM, VALUE_DIM = 1, 2, 16, 8
HV = KEY_HEADS * RATIO
CONV_DIM = 2 * KEY_HEADS * KEY_DIM + HV * VALUE_DIM
WIDTH_1 = 3  # conv width 4


@st.composite
def batches(draw):
    """(block size, max nodes per verified block, per row (seq_len, draft tokens, accepted), null slot rows, freed
    boundary rows): rows of every kind, their running tokens drawn near block boundaries."""
    block_size = draw(st.sampled_from([2, 3, 4, 8]))
    num_nodes = draw(st.integers(1, 5))  # 1 + k
    num_rows = draw(st.integers(1, 6))
    batch = []
    for _ in range(num_rows):
        draft = draw(st.integers(-1, num_nodes - 1))
        accepted = draw(st.integers(1, max(1, draft + 1)))
        kind = draw(st.sampled_from(["any", "root", "in place", "last accepted"]))
        # a boundary after the root, after the whole block (all accepted: the slot's block), after the accepted
        # node, or anywhere
        ends = {"root": 0, "in place": max(draft, 0), "last accepted": accepted - 1}.get(kind)
        if kind == "in place":
            accepted = max(draft, 0) + 1
        if ends is None:
            running = draw(st.integers(1, 4 * block_size))
        else:
            running = draw(st.integers(1, 4)) * block_size - ends
            running = running if running >= 1 else running + block_size * (1 + (ends // block_size))
        batch.append((running + max(draft, 0), draft, accepted))
    null_slots = draw(st.lists(st.integers(0, num_rows - 1), max_size=1))
    freed = draw(st.lists(st.integers(0, num_rows - 1), max_size=2))
    return block_size, num_nodes, batch, set(null_slots), set(freed)


def _block_tables(batch, block_size, null_slots, freed, num_groups, gen):
    """Per group a `[rows, columns]` block table: each row's slot and boundary columns hold distinct real blocks
    (the same block where the boundary block is the slot), the rest null or stale real ids of other blocks."""
    rows_info = boundary_rows(*(torch.tensor([r[i] for r in batch], dtype=torch.int32) for i in range(3)),
                              len(batch), block_size)
    columns = max(seq_len // block_size + 1 for seq_len, _, _ in batch)
    num_slots = 2 * len(batch) + 4
    tables = []
    for _ in range(num_groups):
        table = torch.randint(1, num_slots, (len(batch), columns), dtype=torch.int32, generator=gen)
        blocks = (torch.randperm(num_slots - 1, generator=gen) + 1).tolist()
        for i, row in enumerate(rows_info.rows.tolist()):
            slot_col, node, dest_col = (int(rows_info.slot_columns[i]), int(rows_info.nodes[i]),
                                        int(rows_info.dest_columns[i]))
            table[row, slot_col] = NULL_BLOCK if row in null_slots else blocks.pop()
            if node >= 0 and dest_col != slot_col:
                table[row, dest_col] = NULL_BLOCK if row in freed else blocks.pop()
        tables.append(table)
    return tables, num_slots


def _layers(num_layers, num_groups, tables, num_slots, num_nodes, state_dtype, dim_first, gen):
    """Layers' strided views into pages of random values (factors and conv inputs filled by the test), the
    layers of group g reading tables[g]."""
    layers = []
    width = slot_factor_width(HV, KEY_DIM, VALUE_DIM)
    conv_columns = WIDTH_1 + num_nodes - 1  # vLLM's conv state: w - 1 + k columns
    for i in range(num_layers):
        state = (torch.randn(num_slots, HV, VALUE_DIM, KEY_DIM, generator=gen) * 0.3).to(state_dtype)
        factors = torch.randn(num_slots, num_nodes + 1, width + 5, generator=gen)[:, :num_nodes, :width]
        if dim_first:
            conv = torch.randn(num_slots, CONV_DIM, conv_columns, generator=gen).bfloat16()
        else:
            conv = torch.randn(num_slots, conv_columns, CONV_DIM, generator=gen).bfloat16().transpose(1, 2)
        inputs = torch.randn(num_slots, num_nodes, CONV_DIM + 3, generator=gen).bfloat16()[:, :, :CONV_DIM]
        counts = torch.randint(0, 7, (num_slots, 3), dtype=torch.int32, generator=gen)[:, 1]
        layers.append(BoundaryLayer(state, factors, conv[:, :, :WIDTH_1], inputs, counts,
                                    tables[i % num_groups]))
    return layers


def _fill_verified_blocks(layers, batch, block_size, seed):
    """Each speculative row's verify in every layer: its chain's factor rows (the torch step from the slot's state)
    and conv inputs in its slot. Returns per layer the step's inputs for the fp64 reference."""
    chains = [tuple(range(-1, d)) if d >= 0 else () for _, d, _ in batch]  # root + d drafts
    steps = []
    for i, layer in enumerate(layers):
        packed, inputs, _, _ = gated_inputs(chains, KEY_HEADS, RATIO, KEY_DIM, VALUE_DIM, seed + i)
        slots = _slots(layer, batch, block_size)
        gdn_step_packed(*inputs, layer.state, slots, packed.parents, packed.cu_nodes, num_key_heads=KEY_HEADS,
                        factors=layer.factors)
        for row, (_, d, _) in enumerate(batch):
            if d >= 0 and slots[row] >= 0:
                x = torch.randn(d + 1, CONV_DIM, generator=torch.Generator().manual_seed(seed + 7 * row + i))
                layer.conv_inputs[int(slots[row]), : d + 1] = x.to(layer.conv_inputs.dtype)
        steps.append((packed, inputs, chains))
    return steps


def _slots(layer, batch, block_size):
    """Each row's slot (-1 for null slots and rows that do not speculate), as the step was handed them."""
    out = []
    for row, (seq_len, d, _) in enumerate(batch):
        slot = int(layer.block_table[row, (seq_len - 1) // block_size]) if d >= 0 else NULL_BLOCK
        out.append(slot if slot != NULL_BLOCK else -1)
    return torch.tensor(out, dtype=torch.int32)


def _clone(layers):
    return [BoundaryLayer(*(t.clone() if n != "block_table" else t for n, t in zip(BoundaryLayer._fields, layer)))
            for layer in layers]


def _as_views_of(layers, like):
    """Copies of `layers` with `like`'s strides (the kernel asserts one layout)."""
    out = []
    for layer, model in zip(layers, like):
        views = []
        for t, m in zip(layer, model):
            copy = torch.empty_strided(m.size(), m.stride(), dtype=m.dtype)
            copy.copy_(t)
            views.append(copy)
        out.append(BoundaryLayer(*views))
    return out


@settings(max_examples=25, deadline=None)
@given(case=batches(), num_layers=st.integers(1, 3), two_groups=st.booleans(),
       state_dtype=st.sampled_from([torch.float32, torch.bfloat16]), dim_first=st.booleans(),
       seed=st.integers(0, 2**16))
def test_boundary_writes_match_reference_twin_and_semantics(case, num_layers, two_groups, state_dtype, dim_first,
                                                            seed):
    block_size, num_nodes, batch, null_slots, freed = case
    gen = torch.Generator().manual_seed(seed)
    num_groups = 2 if two_groups and num_layers > 1 else 1
    tables, num_slots = _block_tables(batch, block_size, null_slots, freed, num_groups, gen)
    layers = _layers(num_layers, num_groups, tables, num_slots, num_nodes, state_dtype, dim_first, gen)
    steps = _fill_verified_blocks(layers, batch, block_size, seed)
    before = _clone(layers)
    seq_lens, drafts, accepted = (torch.tensor([r[i] for r in batch], dtype=torch.int32) for i in range(3))

    twin = _clone(layers)
    record_accepted_and_boundaries_torch(twin, seq_lens, drafts, accepted, len(batch), block_size=block_size,
                                         null_block=NULL_BLOCK)
    kernel = [BoundaryLayer(*(t.to(DEVICE) for t in layer)) for layer in _as_views_of(_clone(layers), layers)]
    record_accepted_and_boundaries_triton(kernel, boundary_table(kernel), seq_lens.to(DEVICE), drafts.to(DEVICE),
                                          accepted.to(DEVICE), len(batch), block_size=block_size,
                                          null_block=NULL_BLOCK)
    kernel = [BoundaryLayer(*(t.cpu() for t in layer)) for layer in kernel]

    info = boundary_rows(seq_lens, drafts, accepted, len(batch), block_size)
    tolerance = STATE_TOLERANCE[state_dtype]
    for i, (layer, old, out, ref_out) in enumerate(zip(layers, before, kernel, twin)):
        packed, inputs, chains = steps[i]
        expected_counts = old.counts.clone()
        expected_state, expected_conv = old.state.clone(), old.conv_history.clone()
        written = set()
        for r, row in enumerate(info.rows.tolist()):
            slot = int(layer.block_table[row, info.slot_columns[r]])
            if slot == NULL_BLOCK:
                continue
            node, dest = int(info.nodes[r]), int(layer.block_table[row, info.dest_columns[r]])
            boundary = node >= 0 and dest != NULL_BLOCK
            expected_counts[slot] = 0 if boundary and dest == slot else int(accepted[row])
            if not boundary:
                continue
            expected_counts[dest] = 0
            written.add(dest)
            reference = reference_gated_tree(*(x[rows(packed, row)] for x in inputs[:3]), *inputs[3:5],
                                             inputs[5][rows(packed, row)], inputs[6], old.state[slot].double(),
                                             chains[row], KEY_HEADS)
            expected_state[dest] = reference.recurrence.state[node].to(state_dtype)
            for result in (out, ref_out):
                assert relative_error(result.state[dest], reference.recurrence.state[node]) <= tolerance
            sequence = torch.cat([old.conv_history[slot], old.conv_inputs[slot, : node + 1].T], dim=1)
            expected_conv[dest] = sequence[:, -WIDTH_1:]
            # bit for bit the commit the next step's state pass would make in the slot
            committed = old.state.clone().to(DEVICE)
            gdn_commit_triton(committed, torch.tensor([slot], dtype=torch.int32, device=DEVICE), old.factors.to(DEVICE),
                              torch.tensor([node], dtype=torch.int32, device=DEVICE), num_key_heads=KEY_HEADS)
            assert torch.equal(out.state[dest], committed[slot].cpu())
        for result in (out, ref_out):
            assert torch.equal(result.counts, expected_counts)
            assert torch.equal(result.conv_history, expected_conv)
            kept = [s for s in range(num_slots) if s not in written]
            assert torch.equal(result.state[kept], old.state[kept])
            assert torch.equal(result.factors, old.factors) and torch.equal(result.conv_inputs, old.conv_inputs)
        assert relative_error(out.state, ref_out.state.double()) <= tolerance


def test_boundary_rows_semantics():
    """The per-row quantities by hand: block size 4, rows verifying a root and 3 drafts whose root is token 3 of the
    sequence (2 accepted: boundary 4 at node 1), token 4 (the root ends the block: node 0), token 5 (a boundary only
    if all 4 are accepted: 8 at node 3, in the running block), and a row that does not speculate."""
    seq_lens = torch.tensor([6, 7, 8, 9], dtype=torch.int32)
    drafts = torch.tensor([3, 3, 3, -1], dtype=torch.int32)
    accepted = torch.tensor([2, 1, 4, 1], dtype=torch.int32)
    info = boundary_rows(seq_lens, drafts, accepted, 4, 4)
    assert info.rows.tolist() == [0, 1, 2]
    assert info.slot_columns.tolist() == [1, 1, 1]
    assert info.nodes.tolist() == [1, 0, 3]
    assert info.dest_columns.tolist() == [0, 0, 1]
    assert boundary_rows(seq_lens, drafts, torch.tensor([1, 1, 3, 1], dtype=torch.int32), 4, 4).nodes.tolist() == \
        [-1, 0, -1]


@settings(max_examples=10, deadline=None)
@given(case=batches(), seed=st.integers(0, 2**16))
def test_v2_rows_through_idx_mapping_match_the_batch_rows(case, seed):
    """Model Runner V2's rows: block-table rows per request state reached through `idx_mapping` (out of order, -1
    rows skipped), the drafts read from the slots' counts (`sampled_rows`, its kernel equal to the twin): the writes
    equal those on the batch-ordered table with the drafts given (V1), on both paths."""
    block_size, num_nodes, batch, null_slots, freed = case
    gen = torch.Generator().manual_seed(seed)
    tables, num_slots = _block_tables(batch, block_size, null_slots, freed, 1, gen)
    (layer,) = _layers(1, 1, tables, num_slots, num_nodes, torch.float32, False, gen)
    seq_lens, drafts, num_sampled = (torch.tensor([r[i] for r in batch], dtype=torch.int32) for i in range(3))
    num_sampled[drafts < 0] = 0  # a prompt chunk samples nothing
    skipped = torch.rand(len(batch), generator=gen) < 0.2
    # the step's count update: each speculative row's node count in its slot; the other rows' slots (null here:
    # `_block_tables` gives only the speculative rows blocks of their own) and the null block hold 0
    counts = layer.counts
    for row, (seq_len, draft, _) in enumerate(batch):
        if draft < 0:
            tables[0][row, (seq_len - 1) // block_size] = NULL_BLOCK
        else:
            counts[int(tables[0][row, (seq_len - 1) // block_size])] = draft + 1
    counts[NULL_BLOCK] = 0
    # V2's request rows: a permutation, with stale rows between
    order = torch.randperm(2 * len(batch), generator=gen)[: len(batch)]
    v2_table = torch.randint(1, num_slots, (2 * len(batch), tables[0].shape[1]), dtype=torch.int32, generator=gen)
    v2_table[order] = tables[0]
    idx_mapping = torch.where(skipped, -1, order)
    v1_drafts = torch.where(skipped | (counts[tables[0][torch.arange(len(batch)), (seq_lens.long() - 1) // block_size]
                                              .long()] == 0), -1, drafts)

    expected = _clone([layer])
    expected[0] = expected[0]._replace(block_table=tables[0].masked_fill(skipped[:, None], NULL_BLOCK))
    record_accepted_and_boundaries_torch(expected, seq_lens, v1_drafts, num_sampled.clamp(min=1), len(batch),
                                         block_size=block_size, null_block=NULL_BLOCK)
    v2 = [layer._replace(block_table=v2_table)]
    twin = _clone(v2)
    rows = sampled_rows(twin[0].counts, v2_table, idx_mapping, seq_lens, num_sampled, len(batch),
                        block_size=block_size, null_block=NULL_BLOCK)
    assert torch.equal(rows[0], v1_drafts) and torch.equal(rows[1], num_sampled.clamp(min=1))
    record_accepted_and_boundaries_torch(twin, seq_lens, *rows, len(batch), block_size=block_size,
                                         null_block=NULL_BLOCK, idx_mapping=idx_mapping)
    kernel = [BoundaryLayer(*(t.to(DEVICE) for t in view)) for view in _as_views_of(_clone(v2), v2)]
    device_rows = sampled_rows_triton(kernel[0].counts, kernel[0].block_table, idx_mapping.to(DEVICE),
                                      seq_lens.to(DEVICE), num_sampled.to(DEVICE), len(batch), block_size=block_size,
                                      null_block=NULL_BLOCK)
    assert all(torch.equal(a.cpu(), b) for a, b in zip(device_rows, rows))
    record_accepted_and_boundaries_triton(kernel, boundary_table(kernel), seq_lens.to(DEVICE), *device_rows,
                                          len(batch), block_size=block_size, null_block=NULL_BLOCK,
                                          idx_mapping=idx_mapping.to(DEVICE))
    for result in (twin[0], BoundaryLayer(*(t.cpu() for t in kernel[0]))):
        assert torch.equal(result.counts, expected[0].counts)
        assert torch.equal(result.conv_history, expected[0].conv_history)
    assert torch.equal(twin[0].state, expected[0].state)
    # the kernel sums the commit's terms in the state pass's order (the twin in its own), as on V1's rows
    assert relative_error(kernel[0].state.cpu(), expected[0].state.double()) <= STATE_TOLERANCE[torch.float32]
