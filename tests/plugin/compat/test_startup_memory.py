"""On CUDA, a hybrid model's KV-cache metadata builders start from an emptied cache
(`vllm_plugin/compat/startup_memory.py`):
the freed profiling KV cache's segment is returned before a builder's buffer can pin it."""

from types import SimpleNamespace

import pytest

from vllm_treewy.vllm_plugin.compat import startup_memory


class FakeCache:
    """The caching allocator as the wrapper sees it: a freed 30 GiB block stays reserved until emptied."""

    def __init__(self):
        self.reserved = 30 << 30
        self.events = []

    def memory_reserved(self):
        return self.reserved

    def empty_cache(self):
        self.events.append("empty_cache")
        self.reserved = 0


@pytest.fixture
def cache(monkeypatch):
    fake = FakeCache()
    monkeypatch.setattr(startup_memory.torch.cuda, "memory_reserved", fake.memory_reserved)
    monkeypatch.setattr(startup_memory.torch.cuda, "empty_cache", fake.empty_cache)
    return fake


@pytest.mark.parametrize("hybrid", [True, False])
def test_the_cache_is_emptied_before_the_builders_allocate_for_hybrid_models(cache, hybrid):
    def builders(self, kv_cache_config, kernel_block_sizes):
        cache.events.append(("builders", kv_cache_config, kernel_block_sizes))

    wrapped = startup_memory._emptying_the_cache_first(builders)
    wrapped(SimpleNamespace(model_config=SimpleNamespace(is_hybrid=hybrid)), "config", [16])
    expected = [("builders", "config", [16])]
    assert cache.events == (["empty_cache"] + expected if hybrid else expected)
    assert wrapped.__wrapped__ is builders
