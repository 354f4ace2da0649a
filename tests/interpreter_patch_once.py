"""Triton 3.6's interpreter without its repeated language patching, for every test (tests/conftest.py).

The interpreter runs a kernel by patching `triton.language` (its builtins, `tl.tensor`'s methods, `tl.math`, ...) with
interpreted versions for the launch, and restores them when the launch ends. It also patches them again at every call
of a `@triton.jit` device function inside the kernel (`_patch_lang` walks every member of those modules each time,
and nothing restores the second patching: the launch's restore puts the originals back). The second patching installs
the same interpreted versions the launch already did, so it changes nothing but the time: in the step kernels, which
call device functions in their loops, it was more than half of a test's. Here a device function call skips it where
the launch already patched every language module the function sees; a launch patches as before.
"""

import inspect
import sys


def patch_language_once() -> None:
    """Makes the interpreter's device-function calls skip re-patching language modules that the running launch
    already patched (idempotent; the interpreter must be Triton 3.6's, whose `_patch_lang` this wraps)."""
    import triton.language as tl
    from triton.runtime import interpreter

    if getattr(interpreter._patch_lang, "patches_once", False):
        return
    original = interpreter._patch_lang
    launch = interpreter.GridExecutor.__call__.__code__
    patched = []  # per launch in progress: the ids of the language modules it patched

    def lang_ids(fn) -> set[int]:
        return {id(value) for value in fn.__globals__.values() if inspect.ismodule(value) and value in (tl, tl.core)}

    def patch_lang(fn):
        if sys._getframe(1).f_code is not launch:  # a device function's call
            if patched and lang_ids(fn) <= patched[-1]:
                return interpreter._LangPatchScope()  # nothing to restore: the launch's scope restores its patches
            return original(fn)
        scope = original(fn)
        patched.append(lang_ids(fn))
        restore = scope.restore

        def restore_and_forget():
            patched.pop()
            restore()

        scope.restore = restore_and_forget
        return scope

    patch_lang.patches_once = True
    interpreter._patch_lang = patch_lang
