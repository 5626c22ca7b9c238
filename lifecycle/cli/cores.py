"""How many torch threads a command runs on: one policy for ``run`` and ``serve``."""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

_TOPOLOGY = Path("/sys/devices/system/cpu")


def torch_threads(requested: int | None, *, processes: int = 1, event_loop: bool = False) -> int:
    """Return torch's intra-op threads: ``requested``, else this process's share of the cores.

    The physical cores this process may use are shared evenly by the ``processes``
    of one node (the workers torchrun started there), since compute threads on
    hyper-threads or another worker's cores only contend; a process that also runs
    an HTTP event loop leaves it one core. Never fewer than one.
    """
    if requested is not None:
        return requested
    return max(1, physical_cores() // processes - (1 if event_loop else 0))


def physical_cores(cpus: Iterable[int] | None = None, topology: Path = _TOPOLOGY) -> int:
    """Count the physical cores behind ``cpus`` (by default the CPUs this process may use).

    Logical CPUs that are hyper-threads of one core list the same siblings in
    ``topology/cpuN/topology/thread_siblings_list``, so each distinct list is
    one core. Where that file cannot be read (not Linux, a restricted
    ``/sys``) SMT cannot be told apart reliably, and every logical CPU counts.
    Affinity is honoured (``taskset``, cpusets); a CFS quota is not.
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
