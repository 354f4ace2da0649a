"""Stand-ins for the commands the GPU scripts start, so that a script's own scheduling runs without engines."""

import os
from pathlib import Path


def logging_python3_path(tmp_path: Path) -> str:
    """A PATH whose first `python3` only echoes its arguments (`python3 ARGS`), then exits 0."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python3").write_text('#!/bin/sh\necho "python3 $*"\n')
    (bin_dir / "python3").chmod(0o755)
    return f"{bin_dir}{os.pathsep}{os.environ['PATH']}"
