"""Output paths checked before any work starts, so a run never fails at its very end."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["OutputPathError", "prepare_file", "prepare_folder"]


class OutputPathError(ValueError):
    """An output path cannot be written; the message says which and why."""


def prepare_folder(path: Path, what: str) -> Path:
    """Create the folder ``path`` (with its parents) and check it can be written.

    Raises:
        OutputPathError: it is a file, cannot be created, or is not writable.
    """
    try:
        path.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise OutputPathError(f"{what} {path} is a file, not a folder") from None
    except OSError as err:
        raise OutputPathError(f"cannot create {what} {path}: {err.strerror}") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise OutputPathError(f"cannot write into {what} {path}: permission denied")
    return path


def prepare_file(path: Path, what: str) -> Path:
    """Create the folder of the file ``path`` and check the file can be written there.

    Raises:
        OutputPathError: it is a folder, or its folder cannot be created or written.
    """
    if path.is_dir():
        raise OutputPathError(f"{what} {path} is a folder, not a file")
    prepare_folder(path.parent, f"the folder of {what}")
    if path.exists() and not os.access(path, os.W_OK):
        raise OutputPathError(f"cannot write {what} {path}: permission denied")
    return path
