"""The patches under `patches/` are applied to the installed vLLM (`make install`), apply cleanly to vLLM 0.32.0's
own files, and applying them is idempotent; one that conflicts is left out, its files untouched."""

import re
import shutil

import pytest

from vllm_treewy import vllm_patches
from vllm_treewy.vllm_patches import APPLIED, APPLIES, CONFLICTS, apply, patches, state, vllm_root

PATCHES = patches()


def touched_files(diff) -> list[str]:
    return re.findall(r"^\+\+\+ b/(\S+)", diff.read_text(), flags=re.M)


def copy_of_installed(diff, tmp_path):
    for name in touched_files(diff):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(vllm_root() / name, tmp_path / name)
    return tmp_path


def test_there_are_patches():
    assert [p.name for p in PATCHES] == ["vllm-0.32.0-plugin-counters.diff"]


@pytest.mark.parametrize("diff", PATCHES, ids=lambda p: p.name)
def test_the_installed_vllm_has_the_patch(diff):
    assert state(diff, vllm_root()) == APPLIED, "run `python3 -m vllm_treewy.vllm_patches` (make install does)"


@pytest.mark.parametrize("diff", PATCHES, ids=lambda p: p.name)
def test_the_patch_applies_cleanly_to_vllm_and_once(diff, tmp_path):
    root = copy_of_installed(diff, tmp_path)
    if state(diff, root) == APPLIED:  # back to vLLM 0.32.0's own files
        assert vllm_patches._patch(diff, root, "--reverse", "--force", "--silent").returncode == 0
    assert state(diff, root) == APPLIES
    assert f"{diff.name}: applied now ({root / 'vllm'})" in apply(root).splitlines()
    patched = {name: (root / name).read_text() for name in touched_files(diff)}
    assert f"{diff.name}: applied ({root / 'vllm'})" in apply(root).splitlines()
    assert {name: (root / name).read_text() for name in touched_files(diff)} == patched
    assert sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()) == sorted(patched)  # no backups


@pytest.mark.parametrize("diff", PATCHES, ids=lambda p: p.name)
def test_a_conflicting_patch_is_left_out(diff, tmp_path):
    root = copy_of_installed(diff, tmp_path)
    first = root / touched_files(diff)[0]
    first.write_text("# not vLLM's file\n")
    assert state(diff, root) == CONFLICTS
    assert CONFLICTS in apply(root)
    assert first.read_text() == "# not vLLM's file\n"
