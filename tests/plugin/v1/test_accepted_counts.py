"""Right after sampling, each speculative row's accepted count goes into its slot in every KV-cache group of
reconstruct GDN layers (each group has its own count state and block table); rows that verified no drafts keep
their slot's count. On CUDA one launch covers all groups, through a table of the groups' addresses that the model's
first GDN layer keeps (`gdn.sampling_tables`) while the KV cache stays where it is."""

from types import SimpleNamespace

import pytest
import torch
from vllm.v1.kv_cache_interface import MambaSpec

from vllm_treewy.kernels.bookkeeping import dispatch
from vllm_treewy.tree import DraftTree
from vllm_treewy.vllm_plugin.config import draft_shape_of
from vllm_treewy.vllm_plugin.v1.accepted_counts import (
    chain_step_of_tree_config,
    gdn_counts_and_block_tables,
    record_chain_accepted_counts,
)
from vllm_treewy.vllm_plugin.gdn.sampling_tables import count_table_of
from vllm_treewy.vllm_plugin.gdn.sampling_tables import SamplingTables

NUM_SLOTS, MAX_REQS = 8, 6


@pytest.fixture(autouse=True, params=["torch", "triton"])
def count_updates(request, monkeypatch):
    """Every test on both paths: the torch ops (CPU) and the one-launch kernel (CUDA; here the interpreter)."""
    monkeypatch.setattr(dispatch, "launches_triton", lambda counts: request.param == "triton")
    return request.param


def _gdn_layer():
    # the count state inside each slot's KV-cache page, after the slot's other states: strided
    counts = torch.zeros(NUM_SLOTS, 3, dtype=torch.int32)[:, 2]
    return SimpleNamespace(keeps_slot_counts=True, verified_node_counts=lambda: counts, sampling_tables=SamplingTables())


def _runner(block_tables):
    """Group 0: full attention; groups 1 and 2: reconstruct GDN layers, with their own slots and block table widths."""
    gdn = MambaSpec(block_size=16, shapes=((4,),), dtypes=(torch.float32,))
    layers = {"attn.0": SimpleNamespace(), "gdn.0": _gdn_layer(), "gdn.1": _gdn_layer()}
    groups = [SimpleNamespace(kv_cache_spec=object(), layer_names=["attn.0"]),
              SimpleNamespace(kv_cache_spec=gdn, layer_names=["gdn.0"]),
              SimpleNamespace(kv_cache_spec=gdn, layer_names=["gdn.1"])]
    tables = [SimpleNamespace(block_table=SimpleNamespace(gpu=table)) for table in block_tables]
    return SimpleNamespace(
        compilation_config=SimpleNamespace(static_forward_context=layers),
        kv_cache_config=SimpleNamespace(kv_cache_groups=groups),
        input_batch=SimpleNamespace(block_table=tables, num_reqs=3),
        num_decode_draft_tokens=SimpleNamespace(gpu=torch.full((MAX_REQS,), -1, dtype=torch.int32)),
        num_accepted_tokens=SimpleNamespace(gpu=torch.ones(MAX_REQS, dtype=torch.int32)),
    )


def _block_table(slots, width):
    table = torch.zeros(MAX_REQS, width, dtype=torch.int32)
    table[: len(slots), 0] = torch.tensor(slots, dtype=torch.int32)
    return table


def _counts(runner, layer):
    return runner.compilation_config.static_forward_context[layer].verified_node_counts().tolist()


def test_speculative_rows_record_their_accepted_counts_in_every_gdn_group():
    # rows 0 and 2 verified drafts, row 1 is a prefill; a stale row 3 (a removed request) is past the batch
    runner = _runner([_block_table([1, 2, 3, 4], 4), _block_table([3, 5, 6, 3], 1), _block_table([7, 1, 2, 7], 3)])
    runner.num_decode_draft_tokens.gpu[:4] = torch.tensor([3, -1, 0, 3])
    runner.num_accepted_tokens.gpu[:4] = torch.tensor([4, 2, 1, 3])
    runner.compilation_config.static_forward_context["gdn.1"].verified_node_counts()[1] = 5  # the prefill's slot
    record_chain_accepted_counts(runner, 3)
    assert _counts(runner, "gdn.0") == [0, 0, 0, 4, 0, 0, 1, 0]
    assert _counts(runner, "gdn.1") == [0, 5, 1, 0, 0, 0, 0, 4]


def test_the_kernel_follows_a_kv_cache_that_moved(count_updates):
    """The address table is built once and kept by the first GDN layer; a rebound KV cache (new count tensors)
    rebuilds it."""
    runner = _runner([_block_table([], 1), _block_table([3], 2), _block_table([4], 2)])
    runner.num_decode_draft_tokens.gpu[0] = 3
    runner.num_accepted_tokens.gpu[0] = 2
    record_chain_accepted_counts(runner, 1)
    if count_updates == "triton":
        groups = gdn_counts_and_block_tables(runner)
        table = count_table_of(runner, groups)
        record_chain_accepted_counts(runner, 1)
        assert count_table_of(runner, groups) is table
    runner.compilation_config.static_forward_context["gdn.1"] = _gdn_layer()
    runner.num_accepted_tokens.gpu[0] = 3
    record_chain_accepted_counts(runner, 1)
    assert _counts(runner, "gdn.0")[3] == 3 and _counts(runner, "gdn.1")[4] == 3
    assert [name for name in vars(runner) if "treewy" in name] == []  # nothing kept on vLLM's runner


def test_a_chain_step_of_a_tree_config_records_its_counts_past_the_trees():
    """draft_tree_max_batch_size: a chain row's count c names chain block c - (2 + N) in the commit table, after the
    tree's 1 + N rows (`gdn.step_metadata.commit_ancestor_table`); rows without drafts keep their slot's count."""
    runner = _runner([_block_table([1, 2, 3], 4), _block_table([3, 5, 6], 1), _block_table([7, 1, 2], 3)])
    runner.num_decode_draft_tokens.gpu[:3] = torch.tensor([3, -1, 2])
    runner.num_accepted_tokens.gpu[:3] = torch.tensor([4, 2, 1])  # row 0 accepted all 3 drafts, row 2 none
    record_chain_accepted_counts(runner, 3, offset=11)  # the [2, 2, 1] tree: 1 + N = 11
    assert _counts(runner, "gdn.0") == [0, 0, 0, 15, 0, 0, 12, 0]
    assert _counts(runner, "gdn.1") == [0, 0, 12, 0, 0, 0, 0, 15]


def test_which_steps_of_a_tree_config_verify_chains():
    tree = DraftTree.from_widths([2, 2, 1])
    config = SimpleNamespace(is_draft_tree=True, draft_tree=tree, draft_tree_max_batch_size=2)

    def step(*drafts):
        return SimpleNamespace(scheduled_spec_decode_tokens={f"r{i}": [0] * n for i, n in enumerate(drafts)})

    assert chain_step_of_tree_config(draft_shape_of(config), step(3, 1))
    # prefills only: counts of rows without drafts stay put
    assert chain_step_of_tree_config(draft_shape_of(config), step())
    assert not chain_step_of_tree_config(draft_shape_of(config), step(10, 10))
    config.draft_tree_max_batch_size = None  # no threshold: every step is the tree's
    assert not chain_step_of_tree_config(draft_shape_of(config), step(3))
