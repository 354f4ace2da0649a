import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_treewy.kernels.conv_step_torch import conv_step_packed
from vllm_treewy.kernels.reference import reference_tree_conv
from vllm_treewy.kernels.ancestor_table_torch import ancestor_table_torch
from vllm_treewy.tree import DraftTree, node_requests, pack_trees

from .tree_cases import chains, relative_error, trees
from .triton_cases import DEVICE, rows

from vllm_treewy.kernels.conv_step_triton import conv_step_triton  # noqa: E402

WIDTH, CHANNELS = 4, 80


@settings(max_examples=12, deadline=None)
@given(batch=st.lists(trees(max_nodes=9, max_depth=5), min_size=1, max_size=4), rows_per_slot=st.integers(1, 5),
       history_len=st.sampled_from([WIDTH - 1, WIDTH + 1]), transposed=st.booleans(), data=st.data())
def test_conv_step_commits_the_previous_draft_then_convolves(batch, rows_per_slot, history_len, transposed, data):
    """conv_step = commit of each slot's previous draft (a chain over the slot's rows, or one static tree given as
    an ancestor table, possibly with spare columns) at its commit node from the per-slot input rows, then the tree
    conv of this step; the step's inputs replace the rows. Triton vs torch twin vs the fp64 node-by-node reference;
    padding requests and slots outside the batch are untouched."""
    seed = data.draw(st.integers(0, 2**16))
    generator = torch.Generator().manual_seed(seed)
    batch = [p if len(p) <= rows_per_slot else p[:rows_per_slot] for p in batch]
    packed = pack_trees(batch)
    num_slots = len(batch) + 2
    x = torch.randn(packed.num_nodes, CHANNELS, generator=generator)
    weight, bias = torch.randn(CHANNELS, WIDTH, generator=generator), torch.randn(CHANNELS, generator=generator)
    bias = bias if data.draw(st.booleans()) else None
    activation = data.draw(st.sampled_from([None, "silu"]))
    if transposed:
        conv_state = torch.randn(num_slots, history_len, CHANNELS, generator=generator).transpose(1, 2)
    else:
        conv_state = torch.randn(num_slots, CHANNELS, history_len, generator=generator)
    inputs = torch.randn(num_slots, rows_per_slot, CHANNELS, generator=generator)
    slots = torch.randperm(num_slots, generator=generator)[: len(batch)].to(torch.int32)
    commit_tree = data.draw(st.one_of(st.none(), trees(max_nodes=rows_per_slot, max_depth=rows_per_slot)))
    if commit_tree is None:
        commit_parents, commit_ancestors = tuple(range(-1, rows_per_slot - 1)), None
    else:
        depth = DraftTree(commit_tree).max_depth + data.draw(st.integers(0, 1))
        commit_parents = commit_tree
        commit_ancestors = ancestor_table_torch(torch.tensor(commit_tree, dtype=torch.int32),
                                                 torch.tensor([0, len(commit_tree)]), depth)
    commit = torch.tensor([data.draw(st.integers(-1, len(commit_parents) - 1)) for _ in batch], dtype=torch.int32)
    if len(batch) > 1 and data.draw(st.booleans()):
        slots[0] = -1  # a padding request

    expected_out, expected_state, expected_inputs = x.clone(), conv_state.clone(), inputs.clone()
    for b, parents in enumerate(batch):
        if slots[b] < 0:
            continue
        s, r = int(slots[b]), rows(packed, b)
        history = conv_state[s]
        if commit[b] >= 0:
            history = reference_tree_conv(inputs[s, : len(commit_parents)], history, weight, bias,
                                          commit_parents).history[commit[b]].float()
        expected_state[s] = history
        expected_out[r] = reference_tree_conv(x[r], history, weight, bias, parents, activation).out.float()
        expected_inputs[s, : len(parents)] = x[r]

    twin_state, twin_inputs = conv_state.clone(), inputs.clone()
    twin_out = conv_step_packed(x, twin_state, slots, weight, bias, packed.parents, packed.cu_nodes, twin_inputs,
                                commit, commit_ancestors=commit_ancestors, activation=activation)
    state, step_inputs = conv_state.clone().to(DEVICE), inputs.clone().to(DEVICE)
    out = torch.full_like(x, float("nan")).to(DEVICE)
    device_bias = None if bias is None else bias.to(DEVICE)
    conv_step_triton(x.to(DEVICE), state, slots.to(DEVICE), weight.to(DEVICE), device_bias,
                     packed.parents.to(DEVICE), packed.cu_nodes.to(DEVICE), step_inputs, commit.to(DEVICE),
                     commit_ancestors=None if commit_ancestors is None else commit_ancestors.to(DEVICE),
                     activation=activation, out=out, block_nodes=4, block_d=32)
    live = slots.long()[node_requests(packed.cu_nodes)] >= 0
    for actual_out, actual_state, actual_inputs in ((out.cpu(), state.cpu(), step_inputs.cpu()),
                                                    (twin_out, twin_state, twin_inputs)):
        assert relative_error(actual_out[live], expected_out[live]) <= 1e-5
        assert torch.allclose(actual_state, expected_state, rtol=0, atol=0)
        assert torch.equal(actual_inputs, expected_inputs)
    assert bool(out.cpu()[~live].isnan().all())


@settings(max_examples=8, deadline=None)
@given(batch=st.lists(chains(max_nodes=5), min_size=1, max_size=4), commit_chain=st.booleans(), data=st.data())
def test_chains_without_parents_equal_chains_with_them(batch, commit_chain, data):
    """`parents` None (every request a chain: what the adapter passes for chains, so that no parents are derived in
    the step) gives bit for bit what the same chains' parents give, in the kernel and in the twin: outputs, the
    committed history and the input rows, with a commit along a chain or a tree table."""
    generator = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16)))
    rows_per_slot = 5
    packed = pack_trees(batch)
    num_slots = len(batch) + 1
    x = torch.randn(packed.num_nodes, CHANNELS, generator=generator)
    weight, bias = torch.randn(CHANNELS, WIDTH, generator=generator), torch.randn(CHANNELS, generator=generator)
    conv_state = torch.randn(num_slots, CHANNELS, WIDTH - 1, generator=generator)
    inputs = torch.randn(num_slots, rows_per_slot, CHANNELS, generator=generator)
    slots = torch.randperm(num_slots, generator=generator)[: len(batch)].to(torch.int32)
    commit = torch.tensor([data.draw(st.integers(-1, rows_per_slot - 1)) for _ in batch], dtype=torch.int32)
    commit_ancestors = None if commit_chain else ancestor_table_torch(
        torch.tensor([-1, 0, 0, 1, 2], dtype=torch.int32), torch.tensor([0, rows_per_slot]), 3)
    results = {}
    for given_parents in (True, False):
        parents = packed.parents if given_parents else None
        twin_state, twin_inputs = conv_state.clone(), inputs.clone()
        twin_out = conv_step_packed(x, twin_state, slots, weight, bias, parents, packed.cu_nodes, twin_inputs,
                                    commit, commit_ancestors=commit_ancestors, activation="silu")
        state, step_inputs = conv_state.clone().to(DEVICE), inputs.clone().to(DEVICE)
        out = conv_step_triton(x.to(DEVICE), state, slots.to(DEVICE), weight.to(DEVICE), bias.to(DEVICE),
                               None if parents is None else parents.to(DEVICE), packed.cu_nodes.to(DEVICE),
                               step_inputs, commit.to(DEVICE),
                               commit_ancestors=None if commit_ancestors is None else commit_ancestors.to(DEVICE),
                               activation="silu", block_nodes=4, block_d=32)
        results[given_parents] = (twin_out, twin_state, twin_inputs, out.cpu(), state.cpu(), step_inputs.cpu())
    for with_parents, without in zip(results[True], results[False]):
        assert torch.equal(with_parents, without)
