"""The per-step count updates of the GDN slots: the one-launch kernels equal their torch twins and the per-row
semantics of `vllm_plugin.gdn.step_metadata`, `v1.accepted_counts` and `v2.accepted_counts`, on random batches: null-block rows
(captures, padding), strided slot columns and counts (the count state lives inside each slot's KV-cache page), slots
that a non-speculative row takes over, stale block-table rows past the batch, and V2's rows it skips (-1). And one
compiled variant per kernel."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_treewy.kernels.bookkeeping import slot_counts_triton
from vllm_treewy.kernels.bookkeeping.slot_counts_torch import (
    commit_nodes_and_counts_torch,
    record_accepted_counts_torch,
    record_sampled_counts_torch,
)
from vllm_treewy.kernels.bookkeeping.slot_counts_triton import (
    commit_nodes_and_counts_triton,
    count_table,
    record_accepted_counts_triton,
    record_sampled_counts_triton,
)

from .test_jit_variants import specialization_key
from .triton_cases import DEVICE

NULL_BLOCK = 0
MAX_COUNT = 6  # 1 + the last node of a verified block of up to 6 nodes


def _strided_counts(values: list[int], page: int) -> torch.Tensor:
    """`[S]` int32 counts one `page` of int32 apart, as the count state inside the KV cache's pages."""
    pages = torch.full((len(values), page), -99, dtype=torch.int32)
    pages[:, page - 1] = torch.tensor(values, dtype=torch.int32)
    return pages[:, page - 1]


def _column(values: list[int], columns: int) -> torch.Tensor:
    """Column 0 of a `[rows, columns]` int32 table (vLLM's state indices and block tables), strided unless 1 wide."""
    table = torch.full((len(values), columns), -5, dtype=torch.int32)
    table[:, 0] = torch.tensor(values, dtype=torch.int32)
    return table[:, 0]


def _expected_commit(counts: list[int], spec_slots, nodes, non_spec_slots, accepted=None):
    """The semantics row by row: each speculative row's commit node from its slot's count (-1 in the null block; with
    the runner's `accepted` counts, the row's accepted count where the slot's is pending, bounded by it), then its
    node count into the slot (0 in the null block), then 0 in every non-speculative row's slot."""
    counts = list(counts)
    commit_nodes = [-1 if slot == NULL_BLOCK else counts[slot] - 1 for slot in spec_slots]
    if accepted is not None:
        commit_nodes = [-1 if slot == NULL_BLOCK or counts[slot] == 0 else min(counts[slot], a) - 1
                        for slot, a in zip(spec_slots, accepted)]
    for slot, n in zip(spec_slots, nodes):
        counts[slot] = 0 if slot == NULL_BLOCK else n
    for slot in non_spec_slots:
        counts[slot] = 0
    return commit_nodes, counts


@st.composite
def commit_steps(draw):
    """A batch's rows: distinct real slots, each speculative (with 1 .. 5 nodes) or not, null-block rows among the
    speculative ones (a capture: nodes too) and trailing padding (no nodes); null padding after the non-speculative
    rows."""
    num_slots = draw(st.integers(2, 24))
    counts = draw(st.lists(st.integers(0, MAX_COUNT), min_size=num_slots, max_size=num_slots))
    real = draw(st.lists(st.integers(1, num_slots - 1), unique=True, max_size=num_slots - 1))
    speculative = draw(st.lists(st.booleans(), min_size=len(real), max_size=len(real)))
    spec_slots = [s for s, is_spec in zip(real, speculative) if is_spec]
    non_spec_slots = [s for s, is_spec in zip(real, speculative) if not is_spec]
    for _ in range(draw(st.integers(0, 3))):  # capture rows, anywhere
        spec_slots.insert(draw(st.integers(0, len(spec_slots))), NULL_BLOCK)
    nodes = [draw(st.integers(1, 5)) for _ in spec_slots]
    padding = draw(st.integers(0, 3))
    spec_slots, nodes = spec_slots + [NULL_BLOCK] * padding, nodes + [0] * padding
    non_spec_slots += [NULL_BLOCK] * draw(st.integers(0, 2))
    # the runner's accepted counts per speculative row (Model Runner V2's), or none (the slots' counts alone)
    accepted = [draw(st.integers(1, MAX_COUNT)) for _ in spec_slots] if draw(st.booleans()) else None
    return counts, spec_slots, nodes, non_spec_slots, accepted


@settings(max_examples=80, deadline=None)
@given(step=commit_steps(), page=st.integers(1, 3), spec_columns=st.integers(1, 4), non_spec_columns=st.integers(1, 3),
       staged=st.booleans(), block_rows=st.sampled_from([4, 128]))
def test_commit_nodes_and_counts_kernel_equals_twin_and_semantics(step, page, spec_columns, non_spec_columns, staged,
                                                                   block_rows):
    initial, spec_slots, nodes, non_spec_slots, accepted = step
    if not spec_slots:
        accepted = None  # no speculative row: nothing to commit from
    expected_commit_nodes, expected_counts = _expected_commit(initial, spec_slots, nodes, non_spec_slots, accepted)
    rows = len(spec_slots)
    results = []
    for update in (commit_nodes_and_counts_torch, commit_nodes_and_counts_triton):
        counts = _strided_counts(initial, page).to(DEVICE)
        spec = {}
        if rows:
            # a staged batch writes the first rows of persistent buffers: the rows past it stay as they were
            size = rows + 3 if staged else rows
            slots_buffer = torch.full((size,), -7, dtype=torch.int32, device=DEVICE)
            commit_buffer = torch.full((size,), -7, dtype=torch.int32, device=DEVICE)
            cu = torch.tensor([0, *torch.tensor(nodes).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
            spec = dict(batch_slots=_column(spec_slots, spec_columns).to(DEVICE), spec_query_start_loc=cu,
                        slots=slots_buffer[:rows], commit_nodes=commit_buffer[:rows])
            if accepted is not None:
                spec["accepted"] = torch.tensor(accepted, dtype=torch.int32, device=DEVICE)
        else:
            slots_buffer = commit_buffer = None
        non_spec = _column(non_spec_slots, non_spec_columns).to(DEVICE) if non_spec_slots else None
        kwargs = {} if update is commit_nodes_and_counts_torch else {"block_rows": block_rows}
        update(counts, spec.get("batch_slots"), spec.get("spec_query_start_loc"), spec.get("slots"),
               spec.get("commit_nodes"), non_spec, NULL_BLOCK, spec.get("accepted"), **kwargs)
        results.append((counts, slots_buffer, commit_buffer))
    for counts, slots_buffer, commit_buffer in results:
        assert counts.cpu().tolist() == expected_counts
        if rows:
            assert slots_buffer.cpu().tolist() == spec_slots + [-7] * (slots_buffer.numel() - rows)
            assert commit_buffer.cpu().tolist() == expected_commit_nodes + [-7] * (commit_buffer.numel() - rows)


@st.composite
def sampled_steps(draw):
    """A batch of `num_rows` rows over one to three KV-cache groups, each with its own slots (distinct per group),
    counts and block table width; stale rows past the batch, with slots of live rows and drafts of their own."""
    max_rows = draw(st.integers(1, 10))
    num_rows = draw(st.integers(0, max_rows))
    draft_tokens = [draw(st.integers(-1, 3)) for _ in range(max_rows)]
    accepted = [draw(st.integers(1, 4)) for _ in range(max_rows)]
    groups = []
    for _ in range(draw(st.integers(1, 3))):
        num_slots = draw(st.integers(max(2, num_rows + 1), 16))
        live = draw(st.lists(st.integers(1, num_slots - 1), unique=True, min_size=num_rows, max_size=num_rows))
        stale = [draw(st.integers(0, num_slots - 1)) for _ in range(max_rows - num_rows)]
        counts = draw(st.lists(st.integers(0, MAX_COUNT), min_size=num_slots, max_size=num_slots))
        groups.append((counts, live + stale, draw(st.integers(1, 4)), draw(st.integers(1, 3))))
    return num_rows, draft_tokens, accepted, groups


@settings(max_examples=60, deadline=None)
@given(step=sampled_steps(), block_rows=st.sampled_from([4, 128]))
def test_record_accepted_counts_kernel_equals_twin_and_semantics(step, block_rows):
    num_rows, draft_tokens, accepted, groups = step
    expected = []
    for initial, slots, _, _ in groups:
        counts = list(initial)
        for row in range(num_rows):
            if draft_tokens[row] >= 0:  # the rows that verified drafts; the others keep their slot's count
                counts[slots[row]] = accepted[row]
        expected.append(counts)
    results = []
    for kernel in (False, True):
        tensors = [(_strided_counts(initial, page).to(DEVICE), _block_table(slots, width).to(DEVICE))
                   for initial, slots, width, page in groups]
        drafts = torch.tensor(draft_tokens, dtype=torch.int32, device=DEVICE)
        accepted_tokens = torch.tensor(accepted, dtype=torch.int32, device=DEVICE)
        if kernel:
            record_accepted_counts_triton(count_table(tensors), drafts, accepted_tokens, num_rows,
                                          block_rows=block_rows)
        else:
            record_accepted_counts_torch(tensors, drafts, accepted_tokens, num_rows)
        results.append([counts.cpu().tolist() for counts, _ in tensors])
    assert results[0] == results[1] == expected


@st.composite
def v2_sampled_steps(draw):
    """Model Runner V2's batch after a step's sampling: `num_rows` rows, each mapped to a request state (its block
    table row; -1: a row V2 skips), over one to three KV-cache groups with their own slots and block tables (rows per
    request state, more than the batch's); each live row's slot holds the step's count (0 for a row that did not
    speculate, else its node count) and a sampled count (0: a prompt chunk that samples nothing)."""
    max_reqs = draw(st.integers(1, 10))
    num_rows = draw(st.integers(0, max_reqs))
    requests = draw(st.lists(st.integers(0, max_reqs - 1), unique=True, min_size=num_rows, max_size=num_rows))
    idx_mapping = [r if draw(st.integers(0, 5)) else -1 for r in requests] + [-1] * draw(st.integers(0, 2))
    num_sampled = [draw(st.integers(0, 5)) for _ in idx_mapping]
    groups = []
    for _ in range(draw(st.integers(1, 3))):
        num_slots = draw(st.integers(max_reqs + 1, 16))
        slots = draw(st.lists(st.integers(1, num_slots - 1), unique=True, min_size=max_reqs, max_size=max_reqs))
        counts = draw(st.lists(st.integers(0, MAX_COUNT), min_size=num_slots, max_size=num_slots))
        groups.append((counts, slots, draw(st.integers(1, 4)), draw(st.integers(1, 3))))
    return num_rows, idx_mapping, num_sampled, groups


@settings(max_examples=60, deadline=None)
@given(step=v2_sampled_steps(), block_rows=st.sampled_from([4, 128]))
def test_record_sampled_counts_kernel_equals_twin_and_semantics(step, block_rows):
    num_rows, idx_mapping, num_sampled, groups = step
    expected = []
    for initial, slots, _, _ in groups:
        counts = list(initial)
        for row in range(num_rows):
            request = idx_mapping[row]
            # the rows that verified this step (their slot holds its count); the others keep their slot's count
            if request >= 0 and counts[slots[request]] > 0:
                counts[slots[request]] = max(num_sampled[row], 1)
        expected.append(counts)
    results = []
    for kernel in (False, True):
        tensors = [(_strided_counts(initial, page).to(DEVICE), _block_table(slots, width).to(DEVICE))
                   for initial, slots, width, page in groups]
        rows = torch.tensor(idx_mapping, dtype=torch.int64, device=DEVICE)
        sampled = torch.tensor(num_sampled, dtype=torch.int32, device=DEVICE)
        if kernel:
            record_sampled_counts_triton(count_table(tensors), rows, sampled, num_rows, block_rows=block_rows)
        else:
            record_sampled_counts_torch(tensors, rows, sampled, num_rows)
        results.append([counts.cpu().tolist() for counts, _ in tensors])
    assert results[0] == results[1] == expected


def _block_table(slots: list[int], width: int) -> torch.Tensor:
    """`[rows, width]` int32, the slots in column 0 (a request's one state block under reconstruct)."""
    table = torch.full((len(slots), width), 1000, dtype=torch.int32)  # other columns: blocks no row may touch
    table[:, 0] = torch.tensor(slots, dtype=torch.int32)
    return table


class _Launches:
    """Stands in for a kernel: records each launch's (args, kwargs) instead of running it."""

    def __init__(self):
        self.launches = []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launches.append((args, kwargs))


def test_one_compiled_variant_whatever_the_batch(monkeypatch):
    """Both kernels run every step outside the graphs: a batch of a new size, stride or buffer offset must not
    compile a new variant in the middle of serving (Triton's key: dtypes, alignment, ints == 1 or % 16)."""
    kernels = {name: getattr(slot_counts_triton, name)
               for name in ("_commit_nodes_kernel", "_record_accepted_counts_kernel", "_record_sampled_counts_kernel")}
    launches = {name: _Launches() for name in kernels}
    for name, recorder in launches.items():
        monkeypatch.setattr(slot_counts_triton, name, recorder)
    for rows in (1, 3, 16, 17, 128, 300):
        for offset in (0, 1):  # a slice at an odd offset of a larger buffer
            counts = torch.zeros(64, 3, dtype=torch.int32)[:, 2]
            table = torch.zeros(rows + offset, 1 + offset, dtype=torch.int32)[offset:]
            buffer = torch.zeros(rows + 1 + offset, dtype=torch.int32)[offset:]
            commit_nodes_and_counts_triton(counts, table[:, 0], buffer, buffer[:rows], buffer[1:], None, NULL_BLOCK)
            commit_nodes_and_counts_triton(counts, None, None, None, None, table[:, 0], NULL_BLOCK)
            commit_nodes_and_counts_triton(counts, buffer[:rows], buffer, buffer[:rows], buffer[1:], table[:, 0],
                                           NULL_BLOCK)
            commit_nodes_and_counts_triton(counts, table[:, 0], buffer, buffer[:rows], buffer[1:], None, NULL_BLOCK,
                                           buffer[1:])  # Model Runner V2's accepted counts
            record_accepted_counts_triton(count_table([(counts, table)] * (1 + offset)), buffer, buffer[1:], rows)
            idx_mapping = torch.zeros(rows + offset, dtype=torch.int64)[offset:]
            record_sampled_counts_triton(count_table([(counts, table)] * (1 + offset)), idx_mapping, buffer[1:], rows)
    for name, kernel in kernels.items():
        keys = {specialization_key(kernel, *launch) for launch in launches[name].launches}
        assert len(keys) == 1, (name, keys)
