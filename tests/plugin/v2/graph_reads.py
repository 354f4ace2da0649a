"""What a CUDA graph's body reads that it did not make, for tests on CPU (which cannot capture).

A graph keeps the addresses of the tensors its body reads, not the tensors: each tensor read from outside the body
must be held by something that outlives the graph (its owner's buffers, constants, a cache that never evicts).
`reads_from_outside(body)` runs the body and gives the storages of those tensors; `held_storages(*owners)` the
storages reachable from the owners through attributes, fields and containers.
"""

from __future__ import annotations

import functools

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


def _storage(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().data_ptr()


def reads_from_outside(body) -> set[int]:
    """The storages of the tensors `body()` reads before any of its ops made them."""
    made, outside = set(), set()

    class Reads(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            for arg in tree_leaves((args, kwargs or {})):
                if isinstance(arg, torch.Tensor) and _storage(arg) not in made:
                    outside.add(_storage(arg))
            out = func(*args, **(kwargs or {}))
            made.update(_storage(t) for t in tree_leaves(out) if isinstance(t, torch.Tensor))
            return out

    with Reads():
        body()
    return outside


def held_storages(*owners) -> set[int]:
    found, seen = set(), set()

    def walk(obj):
        if id(obj) in seen or isinstance(obj, (type, functools.partial, str, bytes, int, float)):
            return
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            found.add(_storage(obj))
        elif isinstance(obj, dict):
            for value in obj.values():
                walk(value)
        elif isinstance(obj, (list, tuple, set)):
            for value in obj:
                walk(value)
        elif isinstance(obj, torch.nn.Module):
            for tensor in (*obj.parameters(), *obj.buffers()):
                walk(tensor)
        elif hasattr(obj, "__dict__"):
            for value in vars(obj).values():
                walk(value)

    for owner in owners:
        walk(owner)
    return found
