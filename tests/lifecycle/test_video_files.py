"""MP4 files: written by the ffmpeg imageio-ffmpeg ships, no Python between fork and exec."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.processes import run_python

pytest.importorskip("imageio_ffmpeg", reason="MP4 needs the [video] extra")

# Registers a handler that the child of every fork runs only when Python runs between fork
# and exec (subprocess's preexec_fn), then writes a two-frame video as MP4.
PROGRAM = """
import os, sys
import torch
from lifecycle.pictures.video import mp4_bytes

marker = sys.argv[1]
os.register_at_fork(after_in_child=lambda: open(marker, "w").close())
video = torch.linspace(-1, 1, 3 * 2 * 16 * 16).reshape(3, 2, 16, 16)
print(mp4_bytes(video)[4:8].decode())
"""


def test_ffmpeg_starts_without_running_python_in_the_child(tmp_path: Path) -> None:
    """Writing an MP4 starts ffmpeg with no fork handler run in its child, and the file is
    an MP4 (an ``ftyp`` box first)."""
    marker = tmp_path / "a fork handler ran"
    done = run_python(PROGRAM, marker, cwd=tmp_path, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "ftyp\n"
    assert not marker.exists()
