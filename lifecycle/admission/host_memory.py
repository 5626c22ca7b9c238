"""Refuse weights that cannot fit the host's available memory, before any is read.

What the host must hold at once is decided here from the declared sizes (kinds'
declarations or weights-file headers). Every component is built in host memory,
and a host store keeps its master copy there for good: on a CPU device the
master is the weights themselves, on CUDA a pinned copy that onload copies from
(resident components keep one too, to be evicted without a copy back). So:

- with the ``host`` target, every component, whatever its residency;
- with the ``disk`` target, every component kept resident, plus the largest one
  that offloads: ``load()`` builds each in memory before it writes its file and
  frees it.

The prompt cache (``serving.prompt_cache_bytes``) counts whole too: it may fill; and so
do the finished videos a worker keeps of a pipeline that makes videos
(``serving.video_store_bytes``, their MP4 files: past it the oldest go first). Each
component counts whole, as one process holds it; the ranks of a layout on
one node hold at least that together. A component of unknown size counts
nothing: the check refuses only what cannot fit.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from components import ResidencyMode
from components.loader import ComponentLoader
from lifecycle.admission.budget import declared_bytes
from lifecycle.refusals import Refusal, RefusalCode
from lifecycle.spec.sizes import format_sizes
from lifecycle.spec.structs import PipelineSpec

__all__ = ["available_host_bytes", "host_memory_refusals"]

MEMINFO = Path("/proc/meminfo")
SHOWN = 3
"""The components a refusal names by size; the rest are counted."""


def available_host_bytes(meminfo: Path = MEMINFO) -> int | None:
    """Return the bytes this host can give new allocations now, or None where it cannot tell.

    Linux's ``MemAvailable`` (free memory plus what the kernel can reclaim without
    swapping); else free physical pages, which leaves out reclaimable caches.
    """
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024  # in kB
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        return None


def held_at_once(spec: PipelineSpec, loaders: Mapping[str, ComponentLoader]) -> dict[str, int]:
    """Return each component the host holds at once, with its declared bytes."""
    sizes = {
        name: size
        for name in spec.components
        if (size := declared_bytes(loaders[name])) is not None
    }
    if spec.memory.offload_target == "host":
        return sizes
    resident = {
        name: size
        for name, size in sizes.items()
        if spec.components[name].residency_mode is ResidencyMode.RESIDENT
    }
    offloaded = [name for name in sizes if name not in resident]
    if offloaded:
        largest = max(offloaded, key=lambda name: sizes[name])
        resident[largest] = sizes[largest]
    return resident


def host_memory_refusals(
    spec: PipelineSpec,
    loaders: Mapping[str, ComponentLoader],
    available: int | None,
    videos: int = 0,
) -> list[Refusal]:
    """Refuse a pipeline whose weights held at once, with its prompt cache and the
    ``videos`` bytes of finished videos a worker keeps of it, exceed ``available`` host
    bytes."""
    if available is None:
        return []
    held = held_at_once(spec, loaders)
    cache = spec.serving.prompt_cache
    needed = sum(held.values()) + cache + videos
    if needed <= available:
        return []
    ranked = sorted(held, key=lambda name: (-held[name], name))
    total, free, cached, stored, *each = format_sizes(
        needed, available, cache, videos, *(held[name] for name in ranked)
    )
    parts = [f"{name} {size}" for name, size in zip(ranked, each, strict=True)][:SHOWN]
    if len(ranked) > SHOWN:
        parts.append(f"{len(ranked) - SHOWN} more")
    if cache:
        parts.append(f"prompt cache {cached}")
    if videos:
        parts.append(f"finished videos {stored}")
    fixes = [_smaller(spec, ranked[0])] if ranked else []
    if cache:
        fixes.append("lower serving.prompt_cache_bytes")
    if videos:
        fixes.append("lower serving.video_store_bytes")
    held_what = (
        "every component"
        if spec.memory.offload_target == "host"
        else "the resident components and the largest disk-offloaded one"
    )
    return [
        Refusal(
            code=RefusalCode.HOST_MEMORY,
            component=spec.name,
            message=f"the host holds {held_what} at once: {total} "
            f"({', '.join(parts)}), and it has {free} available",
            hint=f"{', '.join(fixes)}, or run where at least {total} of memory is available",
        )
    ]


def _smaller(spec: PipelineSpec, largest: str) -> str:
    """Return how to make the host hold less of component ``largest``."""
    to_disk = (
        f', keep {largest} on disk (memory.offload_target = "disk" and '
        f'components.{largest}.residency = "component_offload")'
        if spec.memory.offload_target == "host"
        or spec.components[largest].residency_mode is ResidencyMode.RESIDENT
        else ""
    )
    return f"make {largest} smaller (components.{largest}.options){to_disk}"
