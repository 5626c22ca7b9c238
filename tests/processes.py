"""Run Python in a process of its own, as a person runs a command, and keep what it printed."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def run_python(cwd: Path, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """Run this interpreter with ``args`` in ``cwd``; return its exit code and output."""
    return subprocess.run(
        [sys.executable, *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
