"""Changes to the installed vLLM that a plugin cannot make: the unified diffs in the repository's `patches/`.

Each `patches/*.diff` is a diff against vLLM 0.32.0's source tree (paths `a/vllm/...`), written to be proposed
upstream. `apply()` (run by `make install`, or `python3 -m vllm_treewy.vllm_patches`) patches the installed `vllm`
package in place with GNU `patch`, idempotently: a diff already applied is left alone, one that neither applies
cleanly nor is applied is reported and left out (the plugin runs without what it adds). Reinstalling vLLM undoes
them; `make install` applies them again. Nothing here imports vLLM (its location comes from the import system).
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

PATCH_DIR = Path(__file__).resolve().parents[1] / "patches"
APPLIED, APPLIES, CONFLICTS = "applied", "applies cleanly", "conflicts"


def patches() -> list[Path]:
    return sorted(PATCH_DIR.glob("*.diff"))


def vllm_root() -> Path:
    """The directory that holds the installed `vllm` package (what the diffs' paths are relative to)."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or spec.origin is None:
        raise ModuleNotFoundError("vllm is not installed")
    return Path(spec.origin).parents[1]


def _patch(diff: Path, root: Path, *flags: str) -> subprocess.CompletedProcess:
    return subprocess.run(["patch", "-p1", "--batch", "--no-backup-if-mismatch", "-d", str(root), *flags],
                          input=diff.read_bytes(), capture_output=True)


def state(diff: Path, root: Path) -> str:
    """APPLIED (every hunk reverses cleanly), APPLIES (every hunk applies cleanly) or CONFLICTS."""
    if _patch(diff, root, "--dry-run", "--reverse", "--force").returncode == 0:
        return APPLIED
    if _patch(diff, root, "--dry-run", "--forward").returncode == 0:
        return APPLIES
    return CONFLICTS


def apply(root: Path | None = None) -> str:
    """Applies every patch that is not applied yet; says what it found and did, a line per patch."""
    root = vllm_root() if root is None else root
    lines = []
    for diff in patches():
        found = state(diff, root)
        if found == APPLIES:
            done = _patch(diff, root, "--forward", "--silent")
            found = "applied now" if done.returncode == 0 else f"failed: {done.stdout.decode(errors='replace')}"
        elif found == CONFLICTS:
            found = f"{CONFLICTS} with the installed vLLM: left out"
        lines.append(f"{diff.name}: {found} ({root / 'vllm'})")
    return "\n".join(lines)


if __name__ == "__main__":
    report = apply()
    print(report)
    sys.exit(1 if "failed" in report or CONFLICTS in report else 0)
