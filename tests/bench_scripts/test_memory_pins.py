"""bench/e2e/memory_pins.py names the live blocks that keep reserved memory from empty_cache()."""

from bench.e2e.memory_pins import MIB, pinned_segments, summary


def block(size_mib, state, filename="x.py"):
    return {"size": int(size_mib * MIB), "state": state,
            "frames": [{"filename": "/site-packages/torch/cuda/memory.py", "line": 1, "name": "alloc"},
                       {"filename": f"/site-packages/{filename}", "line": 7, "name": "make_buffer"}]}


def segment(total_mib, blocks, pool=(0, 0)):
    allocated = sum(b["size"] for b in blocks if b["state"] == "active_allocated")
    return {"total_size": int(total_mib * MIB), "allocated_size": allocated, "segment_pool_id": pool,
            "blocks": blocks}


def test_segments_pinned_by_a_live_block_rank_by_their_free_bytes():
    snapshot = {"segments": [
        segment(2048, [block(1, "active_allocated", "vllm/worker.py"), block(2047, "inactive")]),
        segment(512, [block(512, "active_allocated")]),  # full: nothing to return
        segment(4096, [block(4096, "inactive")]),  # wholly free: empty_cache() returns it
        segment(8192, [block(8, "inactive"), block(0.5, "active_allocated", "vllm_treewy/buffer.py"),
                       block(8183.5, "inactive")], pool=(1, 3)),
    ]}
    pinned = pinned_segments(snapshot)
    assert [s["total_mib"] for s in pinned] == [8192, 2048]
    assert pinned[0]["free_mib"] == 8191.5 and pinned[0]["pool"] == [1, 3]
    assert pinned[0]["live_blocks"][0]["frames"] == ["/site-packages/vllm_treewy/buffer.py:7 make_buffer"]
    report = summary(snapshot)
    assert report["pinned_free_mib"] == 8191.5 + 2047 and report["pinned_segments"] == 2
    assert report["reserved_mib"] == 2048 + 512 + 4096 + 8192
