"""Refuse an offload folder that cannot be made or written, when something offloads to disk.

The one admission check that touches the file system beyond reading headers: it
tries what the orchestrator will do under ``memory.offload_dir`` and removes what
it made (``lifecycle.offload_folder.probe``), so ``check`` leaves nothing behind.
"""

from __future__ import annotations

from pathlib import Path

from components import ResidencyMode
from lifecycle import offload_folder
from lifecycle.refusals import Refusal, RefusalCode
from lifecycle.spec.structs import PipelineSpec

__all__ = ["offload_dir_refusals"]


def disk_offloaded(spec: PipelineSpec) -> list[str]:
    """Return the components whose weights go to files: those that offload, to a disk target."""
    if spec.memory.offload_target != "disk":
        return []
    return [
        name
        for name, component in spec.components.items()
        if component.residency_mode is not ResidencyMode.RESIDENT
    ]


def offload_dir_refusals(spec: PipelineSpec) -> list[Refusal]:
    """Refuse ``memory.offload_dir`` when a component offloads to disk and it cannot be used."""
    offloaded = disk_offloaded(spec)
    if not offloaded:
        return []  # nothing writes there: a host target or resident components never touch it
    root = Path(spec.memory.offload_dir)
    error = offload_folder.probe(root, spec.name)
    if error is None:
        return []
    return [
        Refusal(
            code=RefusalCode.OFFLOAD_DIR_UNUSABLE,
            component=spec.name,
            message=f"memory.offload_dir '{root}' cannot hold the offload files of "
            f"{', '.join(offloaded)}: {_why(error, root)}",
            hint="set memory.offload_dir to a folder this process can create and write (a "
            'short path on a local disk), or set memory.offload_target = "host"',
        )
    ]


def _why(error: OSError, root: Path) -> str:
    """Say what the file system answered, and where when that is not ``root`` itself."""
    if isinstance(error, FileExistsError):
        return f"'{error.filename}' is a file, not a folder"
    where = "" if error.filename in (None, str(root)) else f" at '{error.filename}'"
    return f"{error.strerror or error}{where}"
