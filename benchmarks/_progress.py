"""diffusers' and transformers' progress bars, off while a benchmark calls the libraries.

Saving and loading their models draws tqdm bars on stderr ("Writing model shards",
"Loading weights", "Loading pipeline components...") between the tables the benchmarks
print. Each library's own switch turns its bars off for the block, and what was on is
turned back on after, so that a test that writes a folder in its own process keeps its
settings.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from contextlib import contextmanager

from components.libraries import is_importable

LIBRARIES = ("transformers", "diffusers")
"""The libraries whose ``utils.logging`` holds a progress-bar switch."""


@contextmanager
def no_progress_bars() -> Iterator[None]:
    """Turn off the installed libraries' progress bars inside the block (a decorator too)."""
    switches = [
        importlib.import_module(f"{library}.utils.logging")
        for library in LIBRARIES
        if is_importable(library)
    ]
    turned_off = [switch for switch in switches if switch.is_progress_bar_enabled()]
    for switch in turned_off:
        switch.disable_progress_bar()
    try:
        yield
    finally:
        for switch in turned_off:
            switch.enable_progress_bar()
