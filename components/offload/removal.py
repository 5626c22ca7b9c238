"""Deleting what a store or an orchestrator owns on disk, whatever was done to it since."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

__all__ = ["remove_path"]

_OWNER_ONLY = 0o700
"""The mode a directory in a tree being removed is given when it cannot be listed or emptied."""


def remove_path(path: Path) -> None:
    """Delete whatever is at ``path``: a file, a link, or a directory tree; nothing is fine.

    The path is the caller's own (an offload file, an orchestrator's folder), so what
    someone put there instead is deleted too: a directory in place of a file, and
    directories made unreadable or unwritable, which are opened to their owner first.

    Raises:
        OSError: something could not be deleted: the folder holding ``path`` or the
            file system is read-only, or another user owns what is in the way.
    """
    if path.is_symlink() or not path.is_dir():
        path.unlink(missing_ok=True)
        return
    try:
        shutil.rmtree(path)
    except PermissionError:
        _open_to_owner(path)
        shutil.rmtree(path)


def _open_to_owner(root: Path) -> None:
    """Make ``root`` and every directory under it listable and writable by their owner.

    Top-down, so each directory is opened before the walk lists it; links are left alone.
    """
    root.chmod(_OWNER_ONLY)
    for folder, names, _ in os.walk(root):
        for name in names:
            inside = os.path.join(folder, name)
            if not os.path.islink(inside):
                os.chmod(inside, _OWNER_ONLY)
