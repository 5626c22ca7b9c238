"""A plugin distribution installed nowhere: a ``*.dist-info`` folder that names entry points."""

from __future__ import annotations

from importlib.metadata import PathDistribution
from pathlib import Path


def dist_info(site: Path, name: str, entry_points: str) -> PathDistribution:
    """Write the distribution ``name`` (version 1.0) with ``entry_points`` under ``site``.

    A registry built over the returned distribution reads its entry points in this
    process; ``site`` on a new process's path installs it there.
    """
    dist = site / f"{name.replace('-', '_')}-1.0.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text(entry_points)
    return PathDistribution(dist)
