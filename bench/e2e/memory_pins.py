"""What keeps CUDA memory reserved after `torch.cuda.empty_cache()`: the caching allocator's segments holding the most
reserved-but-unallocated bytes, with the live blocks that pin each one and the Python frames that allocated them.

empty_cache() returns only segments with no live block; one small tensor left in a multi-GiB segment keeps all of
it. vLLM sizes the KV cache from the free memory it measures, then allocates it in one piece, so such segments can
make that allocation fail although vLLM counted their bytes as free (issue 9's start-up OOM, 2026-12-01).

    attach(path)  # in the engine's process, before it starts: records allocation stacks; on a CUDA OOM writes the
                  # summary of `pinned_segments` to `path` and prints its head
"""

from __future__ import annotations

import json
from pathlib import Path

MIB = 1 << 20
# frames worth naming: the code that decided to allocate, not torch's allocation helpers
OWN_CODE = ("vllm/", "vllm_treewy/", "torch/_inductor/", "bench/", "fla/")


def _frames(block: dict, limit: int = 6) -> list[str]:
    frames = block.get("frames") or []
    named = [f for f in frames if any(part in f.get("filename", "") for part in OWN_CODE)] or frames
    return [f"{f.get('filename', '?')}:{f.get('line', '?')} {f.get('name', '?')}" for f in named[:limit]]


def pinned_segments(snapshot: dict, top: int = 8) -> list[dict]:
    """The `top` segments by reserved-but-unallocated bytes that empty_cache() cannot return (they hold a live
    block), each with its pool (non-zero: a CUDA graph's private pool) and live blocks, largest first."""
    pinned = []
    for segment in snapshot.get("segments", []):
        live = [b for b in segment.get("blocks", []) if b.get("state") != "inactive"]
        free = segment["total_size"] - segment["allocated_size"]
        if live and free > 0:
            pinned.append({
                "total_mib": segment["total_size"] / MIB, "free_mib": free / MIB,
                "pool": list(segment.get("segment_pool_id", (0, 0))),
                "live_blocks": [{"mib": b["size"] / MIB, "state": b["state"], "frames": _frames(b)}
                                for b in sorted(live, key=lambda b: -b["size"])[:4]],
            })
    pinned.sort(key=lambda s: -s["free_mib"])
    return pinned[:top]


def summary(snapshot: dict) -> dict:
    segments = snapshot.get("segments", [])
    reserved = sum(s["total_size"] for s in segments)
    allocated = sum(s["allocated_size"] for s in segments)
    pinned = pinned_segments(snapshot, top=len(segments))
    return {"reserved_mib": reserved / MIB, "allocated_mib": allocated / MIB,
            "pinned_free_mib": sum(s["free_mib"] for s in pinned), "pinned_segments": len(pinned),
            "top": pinned[:8]}


def attach(path: Path) -> None:
    """Record allocation stacks in this process; on a CUDA out-of-memory error, write `summary` to `path`."""
    import torch

    torch.cuda.memory._record_memory_history(max_entries=100_000, stacks="python")

    def on_oom(device, size, device_allocated, device_free):
        report = summary(torch.cuda.memory._snapshot())
        report["failed_allocation_mib"] = size / MIB
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report, indent=1) + "\n")
        print(f"OOM: {report['pinned_free_mib']:,.0f} MiB free inside {report['pinned_segments']} segments that "
              f"live blocks pin (see {path}):", flush=True)
        for segment in report["top"][:4]:
            block = segment["live_blocks"][0]
            print(f"  {segment['total_mib']:,.0f} MiB segment, {segment['free_mib']:,.0f} free, pool "
                  f"{segment['pool']}, pinned by {block['mib']:.1f} MiB from {block['frames'][:2]}", flush=True)

    torch._C._cuda_attach_out_of_memory_observer(on_oom)
