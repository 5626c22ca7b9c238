"""The CPUs a container's cgroup lets this process use: its CPU quota over its period.

Linux caps a cgroup's CPU time with a quota per period: cgroup v2's ``cpu.max``
(``QUOTA PERIOD``, or ``max PERIOD`` for none), cgroup v1's ``cpu.cfs_quota_us`` and
``cpu.cfs_period_us`` (a quota of -1 for none). A pod limited to 1 CPU on a 64-core
node still has all 64 in its affinity: only the quota says that its threads share one
CPU's time. A parent's quota caps its children, so the limit is the smallest one on
the path from this process's cgroup up to the root of the hierarchy mounted here.

Every path is read under ``root`` (``/`` on a real machine; a fake tree in tests).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path, PurePosixPath
from typing import Literal, NamedTuple

__all__ = ["cpu_quota"]


class Hierarchy(NamedTuple):
    """A mounted cgroup hierarchy that may hold the CPU controller, as this process sees it.

    Attributes:
        version: 2 (unified, ``cpu.max``) or 1 (the ``cpu`` controller's, ``cpu.cfs_*``).
        mount_point: where it is mounted (``/sys/fs/cgroup``, ``/sys/fs/cgroup/cpu``).
        folder: this process's cgroup under the mount point.
    """

    version: Literal[1, 2]
    mount_point: PurePosixPath
    folder: PurePosixPath


def cpu_quota(root: Path = Path("/")) -> float | None:
    """Return the CPUs the quota allows this process (1.5: one and a half), or None.

    None where no quota is set, or none can be read (not Linux, no cgroup mounted).
    """
    try:
        cgroups = (root / "proc/self/cgroup").read_text()
        mountinfo = (root / "proc/self/mountinfo").read_text()
    except OSError:
        return None
    quotas = [
        quota
        for hierarchy in cpu_hierarchies(cgroups, mountinfo)
        for folder in _up_to_mount_point(hierarchy)
        if (quota := _read_quota(root / folder.relative_to("/"), hierarchy.version)) is not None
    ]
    return min(quotas, default=None)


def cpu_hierarchies(cgroups: str, mountinfo: str) -> list[Hierarchy]:
    """Return the hierarchies of ``/proc/self/cgroup`` that ``/proc/self/mountinfo`` mounts.

    The v2 one (line ``0::PATH``) and the v1 one of the ``cpu`` controller
    (``N:cpu,cpuacct:PATH``). A cgroup outside what is mounted (another namespace's
    path) is read at the mount point itself.
    """
    paths: dict[int, PurePosixPath] = {}
    for line in cgroups.splitlines():
        if line.count(":") < 2:
            continue
        number, controllers, written = line.split(":", 2)
        if number == "0" and not controllers:
            paths[2] = PurePosixPath(written)
        elif "cpu" in controllers.split(","):
            paths[1] = PurePosixPath(written)
    hierarchies = []
    for fs_type, options, mount_root, mount_point in _cgroup_mounts(mountinfo):
        version: Literal[1, 2] = 2 if fs_type == "cgroup2" else 1
        if version not in paths or (version == 1 and "cpu" not in options):
            continue
        path = paths[version]
        inside = path.relative_to(mount_root) if path.is_relative_to(mount_root) else None
        folder = mount_point / inside if inside is not None else mount_point
        hierarchies.append(Hierarchy(version, mount_point, folder))
    return hierarchies


def v2_quota(cpu_max: str) -> float | None:
    """Return the CPUs of a v2 ``cpu.max`` (``"150000 100000"``: 1.5); None for ``max``."""
    quota, _, period = cpu_max.strip().partition(" ")
    return None if quota == "max" else int(quota) / int(period or "100000")


def v1_quota(quota: str, period: str) -> float | None:
    """Return the CPUs of v1's ``cpu.cfs_quota_us`` over ``cpu.cfs_period_us``; None for -1."""
    microseconds = int(quota)
    return None if microseconds < 0 else microseconds / int(period)


def _cgroup_mounts(
    mountinfo: str,
) -> Iterator[tuple[str, list[str], PurePosixPath, PurePosixPath]]:
    """Yield each cgroup mount: its type, its options, the root it shows and its mount point."""
    for line in mountinfo.splitlines():
        # ID PARENT MAJOR:MINOR ROOT MOUNT_POINT OPTIONS [OPTIONAL...] - TYPE SOURCE SUPER_OPTIONS
        fields, _, filesystem = line.partition(" - ")
        mount, described = fields.split(" "), filesystem.split(" ")
        if len(mount) >= 5 and len(described) == 3 and described[0] in ("cgroup", "cgroup2"):
            options = described[2].split(",")
            yield described[0], options, PurePosixPath(mount[3]), PurePosixPath(mount[4])


def _up_to_mount_point(hierarchy: Hierarchy) -> Iterator[PurePosixPath]:
    """Yield the process's cgroup folder, then each parent up to the mount point."""
    folder = hierarchy.folder
    yield folder
    while folder != hierarchy.mount_point and folder != folder.parent:
        folder = folder.parent
        yield folder


def _read_quota(folder: Path, version: Literal[1, 2]) -> float | None:
    """Return the quota set at ``folder``; None where it sets none (v2's root has no file)."""
    try:
        if version == 2:
            return v2_quota((folder / "cpu.max").read_text())
        return v1_quota(
            (folder / "cpu.cfs_quota_us").read_text(), (folder / "cpu.cfs_period_us").read_text()
        )
    except (OSError, ValueError):
        return None
