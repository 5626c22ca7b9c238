"""Removing a store's file or an orchestrator's folder, whatever was done to it."""

from __future__ import annotations

import json
from pathlib import Path

from components.offload.removal import remove_path
from tests.processes import run_python

UNPRIVILEGED = """
import json, os, shutil, tempfile
from pathlib import Path

from components.offload.removal import remove_path

if os.geteuid() == 0:  # permissions bind only another user: become nobody
    os.setgid(65534)
    os.setuid(65534)
root = Path(tempfile.mkdtemp())
placed = root / "vae.safetensors"  # a directory where the file was
(placed / "deeper").mkdir(parents=True)
(placed / "deeper" / "keep").write_text("")
(placed / "deeper").chmod(0)  # unreadable
placed.chmod(0o500)  # unwritable: its entries cannot be deleted
try:
    shutil.rmtree(root)
    premise = "removed"
except PermissionError:
    premise = "PermissionError"
remove_path(root)
print(json.dumps({"rmtree": premise, "left": os.path.lexists(root)}))
"""


class TestRemovePath:
    def test_a_directory_in_place_of_a_file_is_deleted(self, tmp_path: Path) -> None:
        """A directory tree found where a file was is deleted whole."""
        path = tmp_path / "vae.safetensors"
        (path / "deeper").mkdir(parents=True)
        (path / "deeper" / "keep").write_text("")
        remove_path(path)
        assert list(tmp_path.iterdir()) == []

    def test_nothing_there_is_fine(self, tmp_path: Path) -> None:
        """A path already gone is no error."""
        remove_path(tmp_path / "gone.safetensors")
        assert list(tmp_path.iterdir()) == []

    def test_a_link_goes_not_what_it_points_to(self, tmp_path: Path) -> None:
        """A link in place of the file is deleted; the directory it points to is kept."""
        kept = tmp_path / "kept"
        kept.mkdir()
        (kept / "data").write_text("x")
        link = tmp_path / "vae.safetensors"
        link.symlink_to(kept, target_is_directory=True)
        remove_path(link)
        assert not link.is_symlink()
        assert (kept / "data").read_text() == "x"

    def test_unreadable_directories_are_opened_first(self, root: Path) -> None:
        """A tree made unreadable and unwritable by its owner, which rmtree cannot delete, is
        deleted whole (run as an unprivileged user, whom permissions bind)."""
        result = run_python(UNPRIVILEGED, cwd=root)
        assert result.returncode == 0, result.stderr
        assert json.loads(result.stdout) == {"rmtree": "PermissionError", "left": False}
