"""An orchestrator's own offload folder: private, safely named, owned, reclaimed once orphaned.

Each folder holds an owner file with the pid and boot id of the process that
made it. A folder whose owner is gone (another boot, or no such process) was
left by a crash or SIGKILL: the next orchestrator using the same
``memory.offload_dir`` deletes it and logs ``residency.reclaimed``. A folder
without a readable owner file is never touched.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import tempfile
from pathlib import Path

from lifecycle.logs import get_logger

__all__ = ["create", "probe"]

log = get_logger("lifecycle")

OWNER_FILE = "owner.lock"
"""The file in each orchestrator folder that names the process owning it."""

_ATTEMPTS = 3
"""How often a folder is made again after a concurrent probe removed the root it was in."""
_UNSAFE = re.compile(r"[^A-Za-z0-9_-]")
_BOOT_ID = Path("/proc/sys/kernel/random/boot_id")


def safe_name(name: str) -> str:
    """Return ``name`` usable as one path component: no separators, no dots, at most 64 chars."""
    return _UNSAFE.sub("_", name)[:64]


def boot_id() -> str:
    """Return this boot's id, or '' where the system does not tell it."""
    try:
        return _BOOT_ID.read_text().strip()
    except OSError:
        return ""


def create(root: Path, name: str) -> Path:
    """Reclaim orphaned folders under ``root``, then make a fresh 0700 folder owned by us.

    Raises:
        OSError: ``root`` or the folder cannot be created.
    """
    return _owned_folder(root, name, reclaiming=True)


def probe(root: Path, name: str) -> OSError | None:
    """Try what :func:`create` does under ``root`` and undo it; return what stopped it, or None.

    The folders that did not exist (``root`` and missing parents) are made and
    removed again, deepest first and only while empty, since another process may
    have started using one meanwhile; the fresh folder and its owner file are
    removed. Orphans are left for ``create`` to reclaim. Should this process die
    half-way, its owner file lets a later ``create`` reclaim the fresh folder.
    """
    made = _missing(root)
    try:
        folder = _owned_folder(root, name, reclaiming=False)
        (folder / OWNER_FILE).unlink()
        folder.rmdir()
    except OSError as err:
        return err
    finally:
        for path in made:
            with contextlib.suppress(OSError):
                path.rmdir()
    return None


def _owned_folder(root: Path, name: str, *, reclaiming: bool) -> Path:
    """Make ``root``, reclaim its orphans when ``reclaiming``, then a fresh folder owned by us."""
    attempt = 1
    while True:
        root.mkdir(mode=0o700, parents=True, exist_ok=True)
        try:
            if reclaiming:
                reclaim(root)
            folder = Path(tempfile.mkdtemp(prefix=f"{safe_name(name)}-", dir=root))  # mode 0700
        except FileNotFoundError:
            # a concurrent probe removed the root it had made, just after our mkdir
            if attempt == _ATTEMPTS:
                raise
            attempt += 1
            continue
        owner = {"pid": os.getpid(), "boot_id": boot_id()}
        (folder / OWNER_FILE).write_text(json.dumps(owner))
        return folder


def _missing(path: Path) -> list[Path]:
    """Return ``path`` and those of its parents that do not exist, deepest first."""
    missing = []
    for folder in (path, *path.parents):
        if os.path.lexists(folder):
            break
        missing.append(folder)
    return missing


def reclaim(root: Path) -> list[Path]:
    """Delete the folders under ``root`` whose owning process is gone; return them."""
    reclaimed = []
    for folder in sorted(root.iterdir()):
        owner = _owner(folder / OWNER_FILE)
        if owner is None or _is_alive(*owner):
            continue
        try:
            shutil.rmtree(folder)
        except OSError as err:
            log.warning("residency.reclaim_failed", path=str(folder), error=str(err))
            continue
        log.info("residency.reclaimed", path=str(folder), pid=owner[0], boot_id=owner[1])
        reclaimed.append(folder)
    return reclaimed


def _owner(path: Path) -> tuple[int, str] | None:
    """Return the pid and boot id an owner file names, or None when it names none."""
    try:
        owner = json.loads(path.read_text())
        return int(owner["pid"]), str(owner["boot_id"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _is_alive(pid: int, boot: str) -> bool:
    """Tell whether process ``pid`` of boot ``boot`` may still be running.

    A reused pid reads as alive: the folder is kept, which is the safe mistake.
    """
    if boot != boot_id():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # it exists, under another user
    return True
