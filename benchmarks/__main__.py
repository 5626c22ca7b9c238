"""Run every benchmark of the suite: ``python -m benchmarks [name ...]``."""

from __future__ import annotations

import importlib
import pkgutil
import sys
from pathlib import Path

from benchmarks._environment import announce
from lifecycle.logs import configure_logging

TOOLS = ("make_pipeline", "make_adapter")
"""Modules here that are command-line tools, not benchmarks: the suite never runs them."""


def main(argv: list[str]) -> None:
    """Run the named benchmark modules, or all: each pins its threads and prints its table."""
    configure_logging("json", "error")
    names = argv or sorted(m.name for m in pkgutil.iter_modules([str(Path(__file__).parent)]))
    for name in names:
        if name.startswith("_") or name in TOOLS:
            continue
        print()
        announce(name)
        importlib.import_module(f"benchmarks.{name}").main()


main(sys.argv[1:])
