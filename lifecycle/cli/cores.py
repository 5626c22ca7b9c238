"""How many torch threads a command runs on: one policy for ``run`` and ``serve``."""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from lifecycle.cli.cgroups import cpu_quota

__all__ = ["Threads", "torch_threads", "wait_passively"]

_TOPOLOGY = Path("/sys/devices/system/cpu")
WAIT_POLICY = "OMP_WAIT_POLICY"


@dataclass(frozen=True)
class Cpus:
    """What bounds the CPUs this process may compute on.

    Attributes:
        cores: the physical cores of its affinity.
        quota: the CPUs its cgroup's quota allows (1.5: one and a half), None: no quota.
    """

    cores: int
    quota: float | None


@dataclass(frozen=True)
class Threads:
    """torch's intra-op thread count for a command, and why (shown with the results).

    Attributes:
        count: the threads, at least one.
        reason: what set it: ``--threads``, or what bounds the CPUs
            (``2 physical cores``, ``cgroup quota 1.0 CPU``) and who shares them.
    """

    count: int
    reason: str


def torch_threads(
    requested: int | None,
    *,
    processes: int = 1,
    event_loop: bool = False,
    cpus: Cpus | None = None,
) -> Threads:
    """Return torch's intra-op threads: ``requested``, else this process's share of the CPUs.

    The CPUs are the physical cores this process may use (``cpus``, by default this
    machine's: ``this_machine()``), or fewer where a cgroup quota allows fewer: threads
    beyond the quota are throttled, and a team waits for its slowest thread. The
    ``processes`` of one node (the workers torchrun started there) share them evenly,
    since compute threads on hyper-threads or another worker's cores only contend; a
    process that also runs an HTTP event loop leaves it one. Never fewer than one.
    """
    if requested is not None:
        return Threads(requested, "--threads")
    cpus = cpus or this_machine()
    usable = cpus.cores
    reason = f"{cpus.cores} physical core{'s' * (cpus.cores != 1)}"
    if cpus.quota is not None and math.floor(cpus.quota) < cpus.cores:
        usable = max(1, math.floor(cpus.quota))
        reason = f"cgroup quota {cpus.quota:.1f} CPU{'s' * (cpus.quota > 1)}"
    if processes > 1:
        usable //= processes
        reason += f" shared by {processes} workers"
    if event_loop:
        usable -= 1
        reason += ", less one for the HTTP event loop"
    return Threads(max(1, usable), reason)


def wait_passively() -> None:
    """Let OpenMP's waiting threads sleep rather than spin, unless the environment chose.

    GNU OpenMP (torch's on Linux) reads ``OMP_WAIT_POLICY`` once, when torch loads it;
    unset, a thread that waits at a barrier first spins for about 3 ms. Beside other
    busy processes a team whose last thread lost its core then spins away the time that
    thread needs: ``PASSIVE`` (sleep at once) keeps the default thread count near
    ``--threads 1`` there (``python -m benchmarks threads``). Set only before torch is
    imported: after that the runtime has read it, and the variable would only reach
    the processes this one starts.
    """
    if "torch" not in sys.modules:
        os.environ.setdefault(WAIT_POLICY, "PASSIVE")


def this_machine() -> Cpus:
    """Return the physical cores this process may use and its cgroup's CPU quota."""
    return Cpus(cores=physical_cores(), quota=cpu_quota())


def physical_cores(cpus: Iterable[int] | None = None, topology: Path = _TOPOLOGY) -> int:
    """Count the physical cores behind ``cpus`` (by default the CPUs this process may use).

    Logical CPUs that are hyper-threads of one core list the same siblings in
    ``topology/cpuN/topology/thread_siblings_list``, so each distinct list is
    one core. Where that file cannot be read (not Linux, a restricted
    ``/sys``) SMT cannot be told apart reliably, and every logical CPU counts.
    Affinity is honoured (``taskset``, cpusets); a quota is ``cgroups.cpu_quota``'s.
    """
    logical = sorted(cpus if cpus is not None else _allowed_cpus())
    cores = set()
    for cpu in logical:
        try:
            siblings = (topology / f"cpu{cpu}" / "topology" / "thread_siblings_list").read_text()
        except OSError:
            return max(len(logical), 1)
        cores.add(siblings.strip())
    return max(len(cores), 1)


def _allowed_cpus() -> set[int]:
    if hasattr(os, "sched_getaffinity"):
        return os.sched_getaffinity(0)
    return set(range(os.cpu_count() or 1))
