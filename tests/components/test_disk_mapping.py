"""What happens to weights mapped from a disk-offload file when the file is cut under them.

The design keeps the file out of reach (0700 folder, 0400 file, rewrites by
rename, never in place); these tests show what the mapping risks if someone
makes it writable and truncates it anyway, and that the next onload refuses it.
"""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from components.accounting import module_bytes
from components.offload import DiskStore, OffloadError
from tests.components.test_offload import build, run
from tests.processes import run_python

ROOT = Path(__file__).resolve().parents[2]

TRUNCATE_WHILE_MAPPED = """
import os, sys
from pathlib import Path
from components.offload import DiskStore
from tests.components.test_offload import build, run

path = Path(sys.argv[1])
model = build()
store = DiskStore(model, path, "cpu")
store.onload()
run(model)
print("ran from the map", flush=True)
path.chmod(0o600)  # undo the store's read-only mode, as only the owner or root can
os.truncate(path, 0)
run(model)  # touches pages that no longer exist in the file
print("survived", flush=True)
"""


def test_truncating_a_mapped_file_kills_the_process_with_sigbus(tmp_path: Path) -> None:
    """Weights mapped from a file truncated under them end the process with SIGBUS."""
    result = run_python(TRUNCATE_WHILE_MAPPED, tmp_path / "lm.safetensors", cwd=ROOT)
    assert result.stdout.splitlines() == ["ran from the map"]
    assert result.returncode == -signal.SIGBUS


def test_file_truncated_while_offloaded_is_refused_before_mapping(tmp_path: Path) -> None:
    """A file cut short while offloaded is refused at onload, before any page is mapped."""
    path = tmp_path / "lm.safetensors"
    model = build()
    store = DiskStore(model, path, "cpu")
    store.onload()
    expected = run(model)
    store.offload()
    data = path.read_bytes()
    path.chmod(0o600)
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(OffloadError, match="ends inside tensor"):
        store.onload()
    assert str(path) not in Path("/proc/self/maps").read_text()
    assert module_bytes(model) == 0
    path.write_bytes(data)  # the same bytes again: the checksums accept them
    store.onload()
    assert (run(model) == expected).all()
