"""vLLM 0.32 still has every internal the adapter reaches into, with the parameters the adapter relies on.

Runs after the plugin's `register()` too: the check looks through our wrappers (`__wrapped__`) at vLLM's own code.
"""

import dataclasses
import functools
import sys
import types

import pytest

from vllm_treewy.vllm_plugin import patch_points, register
from vllm_treewy.vllm_plugin.patch_points import INTERNAL_ATTRIBUTES, PATCH_POINTS, InternalAttributes, PatchPoint


@pytest.mark.parametrize("installed", [False, True], ids=["before register", "after register"])
@pytest.mark.parametrize("point", PATCH_POINTS, ids=str)
def test_vllm_still_has_the_patch_point(point, installed):
    if installed:
        register()
    point.check()


@pytest.mark.parametrize("attributes", INTERNAL_ATTRIBUTES, ids=str)
def test_vllm_still_has_the_attributes_the_adapter_uses(attributes):
    attributes.check()


def test_v2s_propose_still_takes_the_keywords_the_tree_speculator_passes():
    import inspect

    parameters = inspect.signature(patch_points.V2_SPECULATOR_PROPOSE.original()).parameters
    assert set(patch_points.V2_PROPOSE_KEYWORDS) <= set(parameters)


def test_a_renamed_attribute_or_a_changed_return_type_fails_the_check():
    runner = INTERNAL_ATTRIBUTES[0]
    with pytest.raises(AttributeError, match="num_accepted_token"):
        dataclasses.replace(runner, names=("input_batch", "num_accepted_token")).check()
    # a dataclass field, a buffer registered by name, a module global: each found where vLLM keeps it, else missing
    for owner, name in (("MambaSpec", "shapes"), ("Attention", "_k_scale"), ("", "op_registry_oot")):
        found = next(a for a in INTERNAL_ATTRIBUTES if a.owner == owner)
        assert name in found.names and not found.missing()
        assert dataclasses.replace(found, names=(name + "_moved",)).missing() == [name + "_moved"]
    with pytest.raises(TypeError, match="return type"):
        dataclasses.replace(patch_points.RUNNER_PREPARE_INPUTS, returns="tuple[Tensor, int").check()
    with pytest.raises(ModuleNotFoundError):
        InternalAttributes("vllm.v1.worker.no_such_module", "X", ("y",), "reads", "").check()


def test_a_moved_or_resigned_point_fails_the_check():
    point = patch_points.GDN_METADATA_BUILD
    with pytest.raises(AttributeError):
        dataclasses.replace(point, attribute="GDNAttentionMetadataBuilder._no_such_method").check()
    with pytest.raises(TypeError, match="expected parameters"):
        dataclasses.replace(point, parameters=("self", "common_attn_metadata", "common_prefix_len")).check()
    with pytest.raises(ModuleNotFoundError):
        PatchPoint("vllm.v1.worker.no_such_module", "X", "wraps", "").check()


def test_register_replaces_every_wrapped_point_and_is_idempotent():
    register()
    first = {str(p): p.resolve() for p in PATCH_POINTS}
    register()
    assert {str(p): p.resolve() for p in PATCH_POINTS} == first
    from vllm.platforms import current_platform

    platform = "cpu" if current_platform.is_cpu() else "cuda"
    for point in PATCH_POINTS:
        if point.how == "wraps" and point.only_on in (None, platform):
            assert point.original() is not getattr(point.resolve(), "__func__", point.resolve()), point


def _counting(original, calls):
    @functools.wraps(original)
    def counted(*args):
        calls.append(args)
        return original(*args)

    return counted


def test_wrap_wraps_once_and_finds_its_mark_under_a_later_wrapper(monkeypatch):
    module = types.ModuleType("treewy_fake_module")

    class Owner:
        def method(self, x):
            return x + 1

        @classmethod
        def from_config(cls, x):
            return x * 2

    module.Owner = Owner
    monkeypatch.setitem(sys.modules, module.__name__, module)
    calls = []
    method = PatchPoint(module.__name__, "Owner.method", "wraps", "", ("self", "x"))
    for _ in range(2):
        method.wrap(_counting, calls)
    assert Owner().method(1) == 2 and len(calls) == 1
    # someone else's functools.wraps wrapper on top keeps the mark: still no second wrapper of ours
    Owner.method = functools.wraps(Owner.method)(lambda self, x: Owner.method.__wrapped__(self, x))
    method.wrap(_counting, calls)
    assert Owner().method(1) == 2 and len(calls) == 2
    assert method.original() is not Owner.method

    def doubling_classmethod(original, calls):
        function = original.__func__

        @functools.wraps(function)
        def counted(cls, x):
            calls.append(x)
            return function(cls, x)

        return classmethod(counted)

    from_config = PatchPoint(module.__name__, "Owner.from_config", "wraps", "", ("cls", "x"))
    for _ in range(2):
        from_config.wrap(doubling_classmethod, calls)
    assert Owner.from_config(3) == 6 and calls[-1] == 3 and len(calls) == 3


def test_a_point_vllm_binds_on_cuda_only_is_checked_by_name_elsewhere(monkeypatch):
    """FlashAttention's varlen function is a module global only where vLLM's CUDA extensions load: without CUDA the
    check finds the name in the module's source (and fails when vLLM stops naming it), and resolving gives None."""
    monkeypatch.setattr(patch_points, "_cuda_extensions_loaded", lambda: False)
    point = patch_points.FLASH_ATTN_VARLEN_FUNC
    point.check()
    assert point.resolve() is None or callable(point.resolve())
    gone = dataclasses.replace(point, attribute="flash_attn_varlen_func_renamed")
    with pytest.raises(TypeError, match="no longer names"):
        gone.check()
