"""The align-mode post-sampling writes (`kernels.bookkeeping.boundary_states_torch`, `boundary_states_triton`): each
speculative row's accepted count into its slot and, where its accepted tokens reach a block boundary, the state and conv
window after the boundary's node into the boundary's block. On random batches of rows (speculative or not, zero-draft
rows, boundaries at the root, inside the drafts and at the last accepted node, the in-place case where the boundary
block is the slot, freed (null) boundary columns, null slots), several layers in one or two KV-cache groups, fp32 and
bf16 states, both conv layouts, strided pages: the Triton kernel (interpreter) equals the torch twin, both match the
fp64 per-node recurrence and the exact conv window, the counts follow the per-row semantics, nothing else in any page
changes, and the boundary state is bit for bit the commit the next step's state pass would make. Draft trees (the commit
table, each row's recorded count): on random trees and the chain rows of `draft_tree_max_batch_size`, both kernels write
the fp64 per-node state after the accepted path's node at the boundary's depth and the path's conv window; a twin that
walks block indices 0..node fails that check."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_treewy.kernels.bookkeeping.boundary_states_torch import (
    BoundaryLayer,
    boundary_rows,
    record_accepted_and_boundaries_torch,
    sampled_rows,
)
from vllm_treewy.kernels.factor_rows import slot_factor_width
from vllm_treewy.kernels.gdn_step_torch import commit_paths, committed_states, gdn_step_packed
from vllm_treewy.kernels.reference import reference_gated_tree

from .test_gdn_step import STATE_TOLERANCE, gated_inputs
from .tree_cases import relative_error
from .triton_cases import DEVICE, rows

from vllm_treewy.kernels.gdn_step_triton import gdn_commit_triton  # noqa: E402
from vllm_treewy.kernels.bookkeeping.boundary_states_triton import (  # noqa: E402
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


# Draft trees: the commit table (`step_metadata.commit_ancestor_table`'s layout: the tree's verified block, root =
# row 0, then the verified block of the chain of the tree's depth), each row's count = 1 + its accepted commit node.


def _ancestor_rows(parents, width):
    """Per node of a verified block (`parents`, root = -1) its path, the node first, -1 beyond: `[n, width]`."""
    table = []
    for node in range(len(parents)):
        path = []
        while node >= 0:
            path.append(node)
            node = parents[node]
        table.append(path + [-1] * (width - len(path)))
    return table


def tree_commit_table(parents):
    """The commit table of the tree `parents` (root + N nodes) and its chain of the tree's depth D: `[(1 + N) +
    (1 + D), D + 1]` int32, the chain's rows block-local."""
    depths = [len([n for n in _ancestor_rows(parents, len(parents))[j] if n >= 0]) - 1 for j in range(len(parents))]
    depth = max(depths)
    chain = tuple(range(-1, depth))
    return torch.tensor(_ancestor_rows(parents, depth + 1) + _ancestor_rows(chain, depth + 1), dtype=torch.int32)


def _depth(table, node):
    return int((table[node] >= 0).sum()) - 1


@st.composite
def tree_batches(draw):
    """(block size, the tree's parents (root + N nodes, node order: parents first), per row (seq_len, draft tokens,
    count, the verified block's parents)): tree rows accepting any node (its ancestors are the accepted path), chain
    rows of the tree's depth (counts offset by 1 + N), root-only decodes and non-speculative rows, running tokens
    drawn so that boundaries fall at every depth of the accepted path."""
    block_size = draw(st.sampled_from([1, 2, 3, 4, 8]))
    num_nodes = draw(st.integers(2, 7))
    parents = [-1] + [draw(st.integers(0, j - 1)) for j in range(1, num_nodes + 1)]
    table = tree_commit_table(parents)
    depth = table.shape[1] - 1
    chain = tuple(range(-1, depth))
    batch = []
    for _ in range(draw(st.integers(1, 5))):
        kind = draw(st.sampled_from(["tree", "tree", "chain", "root", "none"]))
        if kind == "tree":
            node = draw(st.integers(0, num_nodes))
            draft, count, block = num_nodes, node + 1, tuple(parents)
            reach = _depth(table, node)
        elif kind == "chain":
            j = draw(st.integers(0, depth))
            draft, count, block, reach = depth, 1 + j + 1 + num_nodes, chain, j
        else:
            draft, count, block, reach = (0 if kind == "root" else -1), 1, (-1,), 0
        ends = draw(st.integers(0, reach))  # the boundary after the path's node at depth `ends`
        running = draw(st.integers(1, 4)) * block_size - ends
        running = running if running >= 1 else running + block_size * (1 + ends // block_size)
        if draw(st.booleans()):
            running = draw(st.integers(1, 4 * block_size))
        batch.append((running + max(draft, 0), draft, count, block))
    null_slots = draw(st.lists(st.integers(0, len(batch) - 1), max_size=1))
    freed = draw(st.lists(st.integers(0, len(batch) - 1), max_size=1))
    return block_size, parents, table, batch, set(null_slots), set(freed)


def _tree_block_tables(batch, block_size, table, null_slots, freed, gen):
    info = boundary_rows(*(torch.tensor([r[i] for r in batch], dtype=torch.int32) for i in range(3)), len(batch),
                         block_size, table)
    columns = max(seq_len // block_size + 1 for seq_len, *_ in batch)
    num_slots = 2 * len(batch) + 4
    block_table = torch.randint(1, num_slots, (len(batch), columns), dtype=torch.int32, generator=gen)
    blocks = (torch.randperm(num_slots - 1, generator=gen) + 1).tolist()
    for i, row in enumerate(info.rows.tolist()):
        slot_col, node, dest_col = int(info.slot_columns[i]), int(info.nodes[i]), int(info.dest_columns[i])
        block_table[row, slot_col] = NULL_BLOCK if row in null_slots else blocks.pop()
        if node >= 0 and dest_col != slot_col:
            block_table[row, dest_col] = NULL_BLOCK if row in freed else blocks.pop()
    return block_table, num_slots, info


def _run_tree_case(case, num_layers, state_dtype, seed):
    """Both kernels on one case: (layers before, the twin's, the kernel's, per layer the step's inputs, the rows)."""
    block_size, parents, table, batch, null_slots, freed = case
    gen = torch.Generator().manual_seed(seed)
    block_table, num_slots, info = _tree_block_tables(batch, block_size, table, null_slots, freed, gen)
    rows_per_slot = max(len(parents), table.shape[1])
    layers = _layers(num_layers, 1, [block_table], num_slots, rows_per_slot, state_dtype, bool(seed % 2), gen)
    blocks = [r[3] if r[1] >= 0 else () for r in batch]
    steps = []
    for i, layer in enumerate(layers):
        packed, inputs, _, _ = gated_inputs(blocks, KEY_HEADS, RATIO, KEY_DIM, VALUE_DIM, seed + i)
        slots = _slots(layer, [r[:3] for r in batch], block_size)
        gdn_step_packed(*inputs, layer.state, slots, packed.parents, packed.cu_nodes, num_key_heads=KEY_HEADS,
                        factors=layer.factors)
        for row, (_, d, _, block) in enumerate(batch):
            if d >= 0 and slots[row] >= 0:
                x = torch.randn(len(block), CONV_DIM, generator=torch.Generator().manual_seed(seed + 7 * row + i))
                layer.conv_inputs[int(slots[row]), : len(block)] = x.to(layer.conv_inputs.dtype)
        steps.append((packed, inputs, blocks))
    before = _clone(layers)
    seq_lens, drafts, counts = (torch.tensor([r[i] for r in batch], dtype=torch.int32) for i in range(3))
    twin = _clone(layers)
    record_accepted_and_boundaries_torch(twin, seq_lens, drafts, counts, len(batch), block_size=block_size,
                                         null_block=NULL_BLOCK, commit_ancestors=table)
    kernel = [BoundaryLayer(*(t.to(DEVICE) for t in layer)) for layer in _as_views_of(_clone(layers), layers)]
    record_accepted_and_boundaries_triton(kernel, boundary_table(kernel), seq_lens.to(DEVICE), drafts.to(DEVICE),
                                          counts.to(DEVICE), len(batch), block_size=block_size,
                                          null_block=NULL_BLOCK, commit_ancestors=table.to(DEVICE))
    kernel = [BoundaryLayer(*(t.cpu() for t in layer)) for layer in kernel]
    return before, twin, kernel, steps, info, counts


def _check_tree_case(case, num_layers, state_dtype, seed, results):
    """Every written state is the fp64 per-node recurrence's state after the accepted path's node at the boundary's
    depth, every written conv window the path's exact one; counts and untouched pages as the semantics say."""
    block_size, parents, table, batch, null_slots, freed = case
    before, twin, kernel, steps, info, counts = results
    tolerance = STATE_TOLERANCE[state_dtype]
    for i, old in enumerate(before):
        packed, inputs, blocks = steps[i]
        expected_counts = old.counts.clone()
        expected_conv = old.conv_history.clone()
        written = set()
        for r, row in enumerate(info.rows.tolist()):
            seq_len, draft, count, block = batch[row]
            slot = int(old.block_table[row, info.slot_columns[r]])
            if slot == NULL_BLOCK:
                continue
            # the accepted path, by depth, from the table row of the commit node; the boundary by positions
            accepted_node = count - 1
            path = [int(n) for n in table[accepted_node] if n >= 0][::-1]  # root first, block-local indices
            running = seq_len - draft
            boundary = (running + len(path) - 1) // block_size * block_size
            node = path[boundary - running] if boundary >= running else -1
            assert int(info.nodes[r]) == node
            dest = int(old.block_table[row, boundary // block_size - 1]) if node >= 0 else NULL_BLOCK
            hit = node >= 0 and dest != NULL_BLOCK
            expected_counts[slot] = 0 if hit and dest == slot else count
            if not hit:
                continue
            expected_counts[dest] = 0
            written.add(dest)
            reference = reference_gated_tree(*(x[rows(packed, row)] for x in inputs[:3]), *inputs[3:5],
                                             inputs[5][rows(packed, row)], inputs[6], old.state[slot].double(),
                                             blocks[row], KEY_HEADS)
            for result in results[1:3]:
                assert relative_error(result[i].state[dest], reference.recurrence.state[node]) <= tolerance
            on_path = path[: boundary - running + 1]
            sequence = torch.cat([old.conv_history[slot], old.conv_inputs[slot, on_path].T], dim=1)
            expected_conv[dest] = sequence[:, -WIDTH_1:]
        for result in results[1:3]:
            assert torch.equal(result[i].counts, expected_counts)
            assert torch.equal(result[i].conv_history, expected_conv)
            kept = [s for s in range(old.state.shape[0]) if s not in written]
            assert torch.equal(result[i].state[kept], old.state[kept])
            assert torch.equal(result[i].factors, old.factors) and torch.equal(result[i].conv_inputs, old.conv_inputs)


@settings(max_examples=25, deadline=None)
@given(case=tree_batches(), num_layers=st.integers(1, 2), state_dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       seed=st.integers(0, 2**16))
def test_tree_boundary_writes_follow_the_accepted_path(case, num_layers, state_dtype, seed):
    """Random trees (and their chain rows), boundaries at every depth of the accepted path: the torch twin and the
    Triton kernel (interpreted) write the fp64 per-node reference's state and the path's conv window."""
    _check_tree_case(case, num_layers, state_dtype, seed, _run_tree_case(case, num_layers, state_dtype, seed))


def _walking_block_indices():
    """A tree whose accepted path is not the block's first rows: root -> 2 -> 4 (node 1 and 3 are siblings' side),
    block size 2, the root at an odd position so the boundary falls after node 2 (depth 1)."""
    parents = [-1, 0, 0, 1, 2]
    table = tree_commit_table(parents)
    return 2, parents, table, [(3 + 4, 4, 5, tuple(parents))], set(), set()


def test_planted_bug_walking_block_indices_fails(monkeypatch):
    """The bug the table guards against: the state and conv window after block rows 0..node (a chain's walk) instead
    of the accepted path's rows. On a tree whose path is root -> 2 -> 4 the check above fails it."""
    import vllm_treewy.kernels.bookkeeping.boundary_states_torch as twin_module

    case = _walking_block_indices()
    results = _run_tree_case(case, 1, torch.float32, 3)
    _check_tree_case(case, 1, torch.float32, 3, results)  # the real kernels pass

    def block_index_paths(commit_nodes, rows_per_slot, commit_ancestors=None):
        return commit_paths(commit_nodes, rows_per_slot)  # 0..node, the table ignored

    monkeypatch.setattr(twin_module, "commit_paths", block_index_paths)
    monkeypatch.setattr(twin_module, "committed_states",
                        lambda state, slots, factors, nodes, commit_ancestors=None: committed_states(
                            state, slots, factors, nodes))
    broken = _run_tree_case(case, 1, torch.float32, 3)
    try:
        _check_tree_case(case, 1, torch.float32, 3, (broken[0], broken[1], broken[1], *broken[3:]))
    except AssertionError:
        return
    raise AssertionError("the check passed a twin that walks block indices 0..node")


def test_tree_boundary_rows_by_hand():
    """Tree [root, 1, 2 <- 0, 3 <- 1, 4 <- 2], block size 2, root at position 6 (running = 7): accepting node 4
    (path 0 -> 2 -> 4) reaches 9, so the boundary 8 is at depth 1, node 2 (not block index 1); its column 3."""
    table = tree_commit_table([-1, 0, 0, 1, 2])
    info = boundary_rows(torch.tensor([11], dtype=torch.int32), torch.tensor([4], dtype=torch.int32),
                         torch.tensor([5], dtype=torch.int32), 1, 2, table)
    assert info.nodes.tolist() == [2] and info.dest_columns.tolist() == [3] and info.slot_columns.tolist() == [5]
    # its chain step (depth 2, counts offset by 1 + 4): 1 accepted draft reaches 8 at depth 1, block index 1
    info = boundary_rows(torch.tensor([9], dtype=torch.int32), torch.tensor([2], dtype=torch.int32),
                         torch.tensor([2 + 5], dtype=torch.int32), 1, 2, table)
    assert info.nodes.tolist() == [1] and info.dest_columns.tolist() == [3]
