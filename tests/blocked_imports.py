"""The start of a program in which some libraries cannot be imported, as if not installed.

A test of an optional library runs its program in a process of its own (the test's
process has imported them already) and puts ``blocking(...)`` first: every import of a
blocked library, or of a module inside one, raises ``ModuleNotFoundError`` naming it.
"""

from __future__ import annotations

FINDER = """
import importlib.abc
import sys


class Blocker(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {name!r} (blocked)")
        return None


sys.meta_path.insert(0, Blocker())
"""


def blocking(*libraries: str) -> str:
    """Return the source that, run first, makes ``libraries`` unimportable in its process."""
    return f"BLOCKED = {sorted(libraries)!r}\n" + FINDER


UNINSTALLING = """
import importlib.machinery
import sys


class Uninstalled(importlib.machinery.PathFinder):
    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if name.partition(".")[0] in UNINSTALLED:
            return None
        return importlib.machinery.PathFinder.find_spec(name, path, target)


sys.meta_path = [
    Uninstalled if finder is importlib.machinery.PathFinder else finder
    for finder in sys.meta_path
]
"""


def uninstalled(*libraries: str) -> str:
    """Return the source that, run first, makes ``libraries`` look not installed in its
    process: ``importlib.util.find_spec`` finds nothing, so a library that probes for
    another before importing it (diffusers probes imageio) carries on without it."""
    return f"UNINSTALLED = {sorted(libraries)!r}\n" + UNINSTALLING
