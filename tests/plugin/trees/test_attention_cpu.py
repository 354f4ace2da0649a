"""Tree attention and accepted-path compaction on vLLM's CPU paged KV cache.

Every cache here is written by vLLM's own ``cpu_attn_reshape_and_cache`` (what ``do_kv_cache_update`` calls), so
the packings the module decodes are checked against the op that produces them. The chain test compares with vLLM's
``CPUAttentionBackendImpl.forward`` itself, run with the ``vec``/``vec16`` kernels: on some machines torch reports
AMX tiles but vLLM's AMX attention kernel dies of SIGILL, so ``amx`` is covered by the reference and layout tests
(its reshape_and_cache packing runs there), wherever vLLM's build writes an AMX cache at all (not on an AVX2-only
CPU, where the op refuses the ISA).
"""

from __future__ import annotations

import types
from dataclasses import dataclass

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from vllm import _custom_ops as ops

from tests.kernels.tree_cases import chains, random_trees, width_trees
from tests.plugin.attention_reference import masked_attention_fp64
from vllm_treewy.spec_decode import accepted_kv_moves
from vllm_treewy.tree import DraftTree, pack_trees
from vllm_treewy.vllm_plugin.trees import attention as tree_attention_hooks
from vllm_treewy.vllm_plugin.trees.attention_cpu import (
    compact_accepted_kv,
    read_slots,
    split_kv_cache,
    tree_attention,
    verified_block_ancestors,
)

torch.set_num_threads(1)  # a shared 2-core machine; the tensors are tiny


def vllm_writes_amx_cache() -> bool:
    """Whether vLLM's CPU build packs an AMX cache on this machine (its AVX2 build refuses the ISA: "Unsupported CPU
    attention configuration ... isa=0")."""
    kv_cache = torch.zeros(1, 1, 32, 64, dtype=torch.bfloat16)
    row = torch.zeros(1, 1, 32, dtype=torch.bfloat16)
    try:
        ops.cpu_attn_reshape_and_cache(row, row, *split_kv_cache(kv_cache), torch.tensor([0]), "amx")
    except RuntimeError:
        return False
    return True


# (cache dtype, ISA): every packing this module decodes that vLLM writes here, in the dtypes vLLM pairs them with.
AMX_LAYOUT = (torch.bfloat16, "amx")
WRITES_AMX = vllm_writes_amx_cache()
LAYOUTS = [(torch.float32, "vec"), (torch.bfloat16, "vec"), (torch.float16, "vec"), (torch.bfloat16, "vec16")] + (
    [AMX_LAYOUT] if WRITES_AMX else [])
# the layout test lists the AMX packing either way: skipped, with the reason, where vLLM does not write it
EVERY_LAYOUT = LAYOUTS if WRITES_AMX else LAYOUTS + [pytest.param(
    *AMX_LAYOUT, marks=pytest.mark.skip(reason="vLLM's CPU build writes no AMX cache on this CPU (AVX2 only)"))]
# The kernels vLLM's forward can run on every machine (AMX SIGILLs on some, see the module docstring).
RUNNABLE_LAYOUTS = [(torch.float32, "vec"), (torch.bfloat16, "vec"), (torch.bfloat16, "vec16")]


def fast(max_examples: int) -> settings:
    return settings(max_examples=max_examples, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def tolerance(dtype: torch.dtype) -> dict:
    # fp32: accumulation order only; 16-bit outputs: the final rounding (half an ulp near 1, plus order).
    return {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 8e-3, "rtol": 8e-3}


@dataclass
class Batch:
    """R tree requests written into one layer's CPU cache; dense copies for the reference."""

    trees: list[tuple[int, ...]]
    context_lens: list[int]
    query: torch.Tensor  # [T (+ padding rows), H, hd], verified blocks back to back
    keys: list[torch.Tensor]  # per request [context + block, Hkv, hd], as stored (cache dtype)
    values: list[torch.Tensor]
    kv_cache: torch.Tensor  # [num_blocks, Hkv, block_size, 2 * hd]
    block_table: torch.Tensor  # [R, max_blocks] int32
    slot_mapping: torch.Tensor  # [sum of seq lens] every written position, request by request
    query_start_loc: torch.Tensor  # [R+1] int32
    seq_lens: torch.Tensor  # [R] int32
    block_size: int
    isa: str

    @property
    def block_lens(self) -> list[int]:
        return [len(tree) + 1 for tree in self.trees]

    @property
    def num_tree_rows(self) -> int:
        return sum(self.block_lens)

    def slot(self, request: int, position: int) -> int:
        block = int(self.block_table[request, position // self.block_size])
        return block * self.block_size + position % self.block_size

    def ancestors(self) -> torch.Tensor:
        """The ancestor table, padded with junk rows up to the query's padding rows."""
        packed = pack_trees(self.trees)
        table = verified_block_ancestors(packed.parents, packed.cu_nodes, packed.max_depth)
        padding = self.query.shape[0] - table.shape[0]
        return torch.cat([table, torch.full((padding, table.shape[1]), 7, dtype=table.dtype)])

    def attend(self, sliding_window: int = -1, output: torch.Tensor | None = None) -> torch.Tensor:
        key_cache, value_cache = split_kv_cache(self.kv_cache)
        return tree_attention(
            self.query, key_cache, value_cache,
            query_start_loc=self.query_start_loc, seq_lens=self.seq_lens, block_table=self.block_table,
            block_ancestors=self.ancestors(), max_query_len=max(self.block_lens),
            max_seq_len=int(self.seq_lens.max()), scale=self.query.shape[-1] ** -0.5, isa=self.isa,
            sliding_window=sliding_window, output=output,
        )

    def rewrite(self, request: int, positions: list[int], keys: torch.Tensor, values: torch.Tensor) -> None:
        """Store new K/V at some of a request's positions, in the cache and the dense copies."""
        self.keys[request][positions] = keys
        self.values[request][positions] = values
        slots = torch.tensor([self.slot(request, p) for p in positions])
        write(self.kv_cache, keys, values, slots, self.isa)


def write(kv_cache, keys, values, slots, isa):
    key_cache, value_cache = split_kv_cache(kv_cache)
    ops.cpu_attn_reshape_and_cache(keys, values, key_cache, value_cache, slots, isa)


def make_batch(trees, context_lens, *, num_heads=4, num_kv_heads=2, head_size=32, dtype=torch.float32, isa="vec",
               block_size=32, padding_rows=0, seed=0, kv_seed=None, unwritten=float("nan")) -> Batch:
    """``seed`` draws the block table, ``kv_seed`` (default ``seed``) the K/V and queries; slots no request wrote
    hold ``unwritten`` (NaN by default, so that any read of them shows)."""
    generator = torch.Generator().manual_seed(seed)
    block_lens = [len(tree) + 1 for tree in trees]
    seq_lens = [c + n for c, n in zip(context_lens, block_lens)]
    blocks_needed = [-(-s // block_size) for s in seq_lens]
    max_blocks = max(blocks_needed) + 1  # one spare column: vLLM's table rows are wider than the request
    num_blocks = sum(blocks_needed) + 3
    # Requests own scattered, shuffled blocks.
    order = torch.randperm(num_blocks, generator=generator)
    block_table = torch.zeros(len(trees), max_blocks, dtype=torch.int32)
    used = 0
    for r, count in enumerate(blocks_needed):
        block_table[r, :count] = order[used:used + count]
        used += count
    kv_cache = torch.full((num_blocks, num_kv_heads, block_size, 2 * head_size), unwritten, dtype=dtype)
    generator = torch.Generator().manual_seed(seed if kv_seed is None else kv_seed)

    def normal(*shape):
        return torch.randn(shape, generator=generator).to(dtype)

    keys = [normal(s, num_kv_heads, head_size) for s in seq_lens]
    values = [normal(s, num_kv_heads, head_size) for s in seq_lens]
    query = normal(sum(block_lens) + padding_rows, num_heads, head_size)
    batch = Batch(
        trees=[tuple(t) for t in trees], context_lens=list(context_lens), query=query, keys=keys, values=values,
        kv_cache=kv_cache, block_table=block_table, slot_mapping=torch.empty(0, dtype=torch.long),
        query_start_loc=torch.tensor([0] + block_lens, dtype=torch.int32).cumsum(0, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32), block_size=block_size, isa=isa,
    )
    batch.slot_mapping = torch.tensor([batch.slot(r, p) for r, s in enumerate(seq_lens) for p in range(s)])
    write(kv_cache, torch.cat(keys), torch.cat(values), batch.slot_mapping, isa)
    return batch


def reference_attention(batch: Batch, sliding_window: int = -1) -> torch.Tensor:
    """Dense fp64 attention with an explicit boolean mask, request by request, from the stored K/V."""
    rows = []
    start = 0
    for r, tree in enumerate(batch.trees):
        verified = DraftTree(tree).with_root()
        block_len, context = verified.num_nodes, batch.context_lens[r]
        ancestor_or_self = verified.ancestor_mask() | torch.eye(block_len, dtype=torch.bool)
        depth = torch.tensor(verified.depth) - 1  # the root has depth 0
        key_position = torch.cat([torch.arange(context), context + depth])
        query_position = context + depth
        mask = torch.cat([torch.ones(block_len, context, dtype=torch.bool), ancestor_or_self], dim=1)
        if sliding_window > 0:
            mask &= (query_position[:, None] - key_position[None, :]) < sliding_window
        rows.append(masked_attention_fp64(batch.query[start:start + block_len], batch.keys[r], batch.values[r], mask))
        start += block_len
    return torch.cat(rows)


def branch_rows(tree: tuple[int, ...], top: int) -> list[int]:
    """Block indices of the subtree under local node ``top`` (``top`` included)."""
    inside = set()
    for node, parent in enumerate(tree):
        if node == top or parent in inside:
            inside.add(node)
    return sorted(1 + node for node in inside)


def any_trees(max_nodes: int = 12, max_depth: int = 5):
    return st.one_of(random_trees(max_nodes, max_depth, min_nodes=0), width_trees(max_nodes), chains(max_depth))


# --- the cache packings ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype,isa", EVERY_LAYOUT, ids=lambda x: str(x).removeprefix("torch."))
@pytest.mark.parametrize("block_size,head_size", [(32, 32), (32, 128), (64, 64)])
def test_read_slots_decodes_what_vllm_writes(dtype, isa, block_size, head_size):
    generator = torch.Generator().manual_seed(1)
    kv_cache = torch.zeros(5, 3, block_size, 2 * head_size, dtype=dtype)
    slots = torch.randperm(5 * block_size, generator=generator)[:40]
    keys = torch.randn(40, 3, head_size, generator=generator).to(dtype)
    values = torch.randn(40, 3, head_size, generator=generator).to(dtype)
    write(kv_cache, keys, values, slots, isa)
    key_cache, value_cache = split_kv_cache(kv_cache)
    assert torch.equal(read_slots(key_cache, slots, isa, is_key=True), keys)
    assert torch.equal(read_slots(value_cache, slots, isa, is_key=False), values)
    # Decoding with the other packing is wrong for at least one of vec/amx: the test can tell them apart.
    other = "amx" if isa != "amx" else "vec"
    assert not torch.equal(read_slots(key_cache, slots, other, is_key=True), keys)


def test_vec16_packing_at_block_size_16():
    kv_cache = torch.zeros(4, 2, 16, 2 * 48, dtype=torch.bfloat16)
    slots = torch.tensor([0, 5, 16, 33, 63])
    keys, values = torch.randn(2, 5, 2, 48).to(torch.bfloat16)
    write(kv_cache, keys, values, slots, "vec16")
    key_cache, value_cache = split_kv_cache(kv_cache)
    assert torch.equal(read_slots(key_cache, slots, "vec16", True), keys)
    assert torch.equal(read_slots(value_cache, slots, "vec16", False), values)


def test_verified_block_ancestors_match_the_rooted_trees():
    trees = [DraftTree.from_widths([2, 2]).parents, (), (-1, 0, 0, 1, -1), (-1, 0, 1)]
    packed = pack_trees(trees)
    table = verified_block_ancestors(packed.parents, packed.cu_nodes, packed.max_depth)
    assert table.shape == (packed.num_nodes + len(trees), packed.max_depth + 1)
    row = 0
    for tree in trees:
        verified = DraftTree(tree).with_root()
        for node in range(verified.num_nodes):
            path, current = [], node
            while current >= 0:
                path.append(current)
                current = verified.parents[current]
            assert table[row].tolist() == path + [-1] * (table.shape[1] - len(path)), (tree, node)
            row += 1


@st.composite
def request_batches(draw):
    """(dtype, isa) of a cache layout, and 1-4 requests' trees and committed context lengths."""
    dtype, isa = draw(st.sampled_from(LAYOUTS))
    num_requests = draw(st.integers(1, 4))
    trees = draw(st.lists(any_trees(), min_size=num_requests, max_size=num_requests))
    context_lens = draw(st.lists(st.integers(0, 70), min_size=num_requests, max_size=num_requests))
    return dtype, isa, trees, context_lens


# --- (a) against a dense fp64 reference ----------------------------------------------------------------------------


@fast(30)
@given(data=st.data())
def test_tree_attention_matches_dense_masked_reference(data):
    dtype, isa, trees, context_lens = data.draw(request_batches())
    num_kv_heads = data.draw(st.sampled_from([1, 2]))
    ratio = data.draw(st.sampled_from([1, 2, 4]))
    head_size = data.draw(st.sampled_from([32, 64]))
    block_size = 16 if isa == "vec16" and data.draw(st.booleans()) else 32
    window = data.draw(st.sampled_from([-1, -1, 1, 3, 40]))
    batch = make_batch(trees, context_lens, num_heads=num_kv_heads * ratio, num_kv_heads=num_kv_heads,
                       head_size=head_size, dtype=dtype, isa=isa, block_size=block_size,
                       padding_rows=data.draw(st.integers(0, 3)), seed=data.draw(st.integers(0, 2**16)))
    sentinel = torch.full_like(batch.query, 5.0)
    output = batch.attend(window, output=sentinel.clone())
    expected = reference_attention(batch, window)
    tree_rows = batch.num_tree_rows
    assert output.dtype == dtype
    torch.testing.assert_close(output[:tree_rows].double(), expected, **tolerance(dtype))
    assert torch.equal(output[tree_rows:], sentinel[tree_rows:]), "padding rows must be left alone"


def test_a_wide_tree_sees_only_its_own_path():
    """A hand-checked case: with one committed token and V = one-hot per position, the output of a leaf spreads over
    exactly context + its ancestors (nothing from siblings)."""
    tree = DraftTree.from_widths([3, 2]).parents  # nodes 0-2 at depth 1; 3, 4 under 0; 5, 6 under 1; 7, 8 under 2
    batch = make_batch([tree], [1], num_heads=1, num_kv_heads=1, head_size=32)
    one_hot = torch.eye(32)[: 1 + 10, None, :]  # position p's value is e_p
    batch.rewrite(0, list(range(11)), torch.zeros(11, 1, 32), one_hot)  # zero keys: uniform over what is visible
    output = batch.attend()
    # Node 5 (block index 6) is under node 1 (block 2): visible positions = committed 0, root 1, block 2, itself 7.
    expected = torch.zeros(32)
    expected[[0, 1, 3, 7]] = 0.25
    torch.testing.assert_close(output[6, 0], expected)


# --- (b) sibling isolation -----------------------------------------------------------------------------------------


@fast(15)
@given(data=st.data())
def test_changing_one_branch_leaves_every_other_row_bit_identical(data):
    dtype, isa = data.draw(st.sampled_from(LAYOUTS))
    trees = [data.draw(any_trees().filter(lambda t: t.count(-1) >= 2)), data.draw(any_trees())]
    batch = make_batch(trees, [data.draw(st.integers(0, 40)), 5], dtype=dtype, isa=isa,
                       seed=data.draw(st.integers(0, 2**16)))
    before = batch.attend()
    tree = trees[0]
    top = data.draw(st.sampled_from([node for node, parent in enumerate(tree) if parent == -1]))
    branch = branch_rows(tree, top)
    generator = torch.Generator().manual_seed(7)
    shape = (len(branch), *batch.keys[0].shape[1:])
    positions = [batch.context_lens[0] + b for b in branch]
    batch.rewrite(0, positions, torch.randn(shape, generator=generator).to(dtype) * 3,
                  torch.randn(shape, generator=generator).to(dtype) * 3)
    batch.query[branch] = torch.randn(batch.query[branch].shape, generator=generator).to(dtype)
    after = batch.attend()
    untouched = [row for row in range(batch.num_tree_rows) if row not in branch]
    assert torch.equal(after[untouched], before[untouched])
    assert not torch.equal(after[branch], before[branch])


# --- (c) chains: vLLM's own causal CPU attention --------------------------------------------------------------------


@pytest.fixture(scope="module")
def vllm_cpu_attention():
    from vllm.config import set_current_vllm_config
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl

    def make(num_heads, head_size, num_kv_heads, sliding_window, dtype, alibi_slopes=None, **features):
        # The impl reads the model dtype (zentorch dispatch) and the context-parallel size from the current config.
        config = types.SimpleNamespace(model_config=types.SimpleNamespace(dtype=dtype),
                                       parallel_config=types.SimpleNamespace(decode_context_parallel_size=1))
        with set_current_vllm_config(config):
            return CPUAttentionBackendImpl(num_heads, head_size, head_size**-0.5, num_kv_heads, alibi_slopes,
                                           None if sliding_window < 0 else sliding_window, "auto", **features)

    return make


def vllm_forward(make_impl, batch: Batch, sliding_window: int) -> torch.Tensor:
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionMetadata

    num_tokens, num_heads, head_size = batch.query.shape
    num_kv_heads = batch.kv_cache.shape[1]
    impl = make_impl(num_heads, head_size, num_kv_heads, sliding_window, batch.query.dtype)
    layer = types.SimpleNamespace(isa=batch.isa, _k_scale_float=1.0, _v_scale_float=1.0)
    scheduler_metadata = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=len(batch.trees), num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_size,
        seq_lens=batch.seq_lens, dtype=batch.query.dtype, query_start_loc=batch.query_start_loc, causal=True,
        sliding_window_size=sliding_window, isa=batch.isa, enable_kv_split=False,
    )
    metadata = CPUAttentionMetadata(
        num_actual_tokens=num_tokens, max_query_len=max(batch.block_lens), query_start_loc=batch.query_start_loc,
        max_seq_len=int(batch.seq_lens.max()), seq_lens=batch.seq_lens, block_table=batch.block_table,
        slot_mapping=batch.slot_mapping, scheduler_metadata=scheduler_metadata, causal=True,
    )
    output = torch.zeros_like(batch.query)
    impl.forward(layer, batch.query, None, None, batch.kv_cache, metadata, output)
    return output


@pytest.mark.parametrize("dtype,isa", RUNNABLE_LAYOUTS, ids=lambda x: str(x).removeprefix("torch."))
@pytest.mark.parametrize("sliding_window", [-1, 4, 37])
def test_a_chain_is_vllm_causal_attention(vllm_cpu_attention, dtype, isa, sliding_window):
    chain_lengths, context_lens = [3, 0, 7, 1], [45, 0, 70, 31]
    trees = [DraftTree.from_widths([1] * n).parents for n in chain_lengths]
    # vLLM's kernel computes whole blocks and lets NaN in a block's unwritten tail reach the output, so the unwritten
    # slots get finite junk here (vLLM zero-fills its caches; a reused block holds stale finite values).
    batch = make_batch(trees, context_lens, num_heads=8, num_kv_heads=2, head_size=64, dtype=dtype, isa=isa, seed=3,
                       unwritten=3.0)
    expected = vllm_forward(vllm_cpu_attention, batch, sliding_window)
    output = batch.attend(sliding_window)
    torch.testing.assert_close(output, expected, **tolerance(dtype))
    # And vLLM's causal attention is not what a branching tree gets.
    branching = make_batch([DraftTree.from_widths([2, 1]).parents], [9], dtype=dtype, isa=isa, seed=3, unwritten=0.0)
    assert not torch.allclose(branching.attend().float(), vllm_forward(vllm_cpu_attention, branching, -1).float(),
                              **tolerance(dtype))


# --- (d) compaction --------------------------------------------------------------------------------------------------


def random_path(tree: tuple[int, ...], generator: torch.Generator) -> list[int]:
    """The root-to-node path of a random node (empty: nothing accepted)."""
    node = int(torch.randint(-1, len(tree), (), generator=generator))
    path = []
    while node >= 0:
        path.append(node)
        node = tree[node]
    return path[::-1]


@fast(25)
@given(data=st.data())
def test_compaction_puts_the_accepted_path_behind_the_root(data):
    dtype, isa, trees, context_lens = data.draw(request_batches())
    seed = data.draw(st.integers(0, 2**16))
    # Two layers: same trees and block table, different K/V.
    layers = [make_batch(trees, context_lens, dtype=dtype, isa=isa, seed=seed, kv_seed=seed + layer)
              for layer in range(2)]
    generator = torch.Generator().manual_seed(seed)
    paths = [random_path(tree, generator) for tree in trees]
    max_depth = max(1, pack_trees(trees).max_depth)
    accepted = torch.tensor([path + [-1] * (max_depth - len(path)) for path in paths], dtype=torch.long)
    roots = torch.tensor(context_lens)

    expected_caches = []
    for batch in layers:  # the expectation, written by vLLM's op: the path's vectors at root + 1, root + 2, ...
        expected = batch.kv_cache.clone()
        for r, path in enumerate(paths):
            sources = [context_lens[r] + 1 + node for node in path]
            slots = torch.tensor([batch.slot(r, context_lens[r] + step) for step in range(1, len(path) + 1)],
                                 dtype=torch.long)
            write(expected, batch.keys[r][sources], batch.values[r][sources], slots, isa)
        expected_caches.append(expected)

    halves = [split_kv_cache(batch.kv_cache) for batch in layers]
    moves = compact_accepted_kv([k for k, _ in halves], [v for _, v in halves], layers[0].block_table, accepted, roots,
                                isa=isa)
    assert torch.equal(moves.sources, accepted_kv_moves(accepted, roots).sources)
    for batch, expected in zip(layers, expected_caches):
        # Whole caches compared bitwise (NaN in unwritten slots included): moved vectors packed right, rest untouched.
        assert torch.equal(batch.kv_cache.view(torch.int8 if dtype != torch.float32 else torch.int32),
                           expected.view(torch.int8 if dtype != torch.float32 else torch.int32))
        for r, path in enumerate(paths):
            kept = context_lens[r] + 1 + len(path)
            slots = torch.tensor([batch.slot(r, p) for p in range(kept)])
            in_order = list(range(context_lens[r] + 1)) + [context_lens[r] + 1 + node for node in path]
            key_cache, value_cache = split_kv_cache(batch.kv_cache)
            assert torch.equal(read_slots(key_cache, slots, isa, True), batch.keys[r][in_order])
            assert torch.equal(read_slots(value_cache, slots, isa, False), batch.values[r][in_order])


def test_compaction_of_a_single_layer_tensor_and_a_path_across_blocks():
    """Root at the last offset of a block, accepted nodes in the next block: moves cross block boundaries."""
    tree = DraftTree.from_widths([3, 3]).parents
    batch = make_batch([tree], [31], block_size=32, seed=5)
    key_cache, value_cache = split_kv_cache(batch.kv_cache)
    compact_accepted_kv(key_cache, value_cache, batch.block_table, torch.tensor([[2, 11]]), torch.tensor([31]),
                        isa="vec")
    slots = torch.tensor([batch.slot(0, p) for p in (32, 33)])
    assert torch.equal(read_slots(key_cache, slots, "vec", True), batch.keys[0][[34, 43]])
    assert torch.equal(read_slots(value_cache, slots, "vec", False), batch.values[0][[34, 43]])


# --- refusals -------------------------------------------------------------------------------------------------------


def test_unsupported_features_are_refused():
    batch = make_batch([(-1, 0)], [3])
    key_cache, value_cache = split_kv_cache(batch.kv_cache)
    common = dict(query_start_loc=batch.query_start_loc, seq_lens=batch.seq_lens, block_table=batch.block_table,
                  block_ancestors=batch.ancestors(), max_query_len=3, max_seq_len=6, scale=1.0)
    with pytest.raises(NotImplementedError, match="soft cap"):
        tree_attention(batch.query, key_cache, value_cache, isa="vec", logits_soft_cap=30.0, **common)
    with pytest.raises(NotImplementedError, match="sinks"):
        tree_attention(batch.query, key_cache, value_cache, isa="vec", sinks=torch.zeros(4), **common)
    with pytest.raises(NotImplementedError, match="neon"):
        tree_attention(batch.query, key_cache, value_cache, isa="neon", **common)
    with pytest.raises(NotImplementedError, match="quantized"):
        fp8 = torch.zeros(2, 2, 32, 64, dtype=torch.uint8)
        tree_attention(batch.query, *split_kv_cache(fp8), isa="vec", **common)


def test_the_cpu_layer_wrapper_hands_the_layers_settings_to_tree_attention(vllm_cpu_attention):
    """vLLM's CPU layer holds soft cap, ALiBi and sinks itself: the tree rows' wrapper passes them on, so the tree
    rows' attention refuses them instead of attending without them; a plain layer gets the tree rows attended."""
    from vllm_treewy.vllm_plugin.v1 import runner as v1_runner

    batch = make_batch([DraftTree.from_widths([2, 1]).parents, (-1,)], [9, 20], num_heads=2, num_kv_heads=1,
                       head_size=32, unwritten=0.0)
    step = types.SimpleNamespace(request_indices=torch.arange(2), token_indices=torch.arange(batch.num_tree_rows),
                                 query_start_loc=batch.query_start_loc, block_ancestors=batch.ancestors(),
                                 block_len=max(batch.block_lens), attention_layers=[])
    metadata = types.SimpleNamespace(tree_step=step, block_table=batch.block_table,
                                     seq_lens=batch.seq_lens, max_seq_len=int(batch.seq_lens.max()))
    layer = types.SimpleNamespace(isa=batch.isa)
    forward = tree_attention_hooks._attending_tree_rows(lambda self, layer, q, k, v, cache, metadata, output: output)

    def run(**features):
        impl = vllm_cpu_attention(2, 32, 1, -1, torch.float32, **features)
        output = torch.zeros_like(batch.query)
        return forward(impl, layer, batch.query, None, None, batch.kv_cache, metadata, output)

    for features, refused in ((dict(logits_soft_cap=30.0), "soft cap"), (dict(alibi_slopes=[0.5, 0.25]), "ALiBi"),
                              (dict(sinks=torch.zeros(2)), "attention sinks")):
        with pytest.raises(NotImplementedError, match=refused):
            run(**features)
    torch.testing.assert_close(run(), batch.attend(), **tolerance(torch.float32))
