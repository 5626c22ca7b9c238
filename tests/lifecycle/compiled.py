"""What the compile tests read of a component's compilation after each request."""

from __future__ import annotations

from typing import NamedTuple

from components.compile import Compilation


class Compiled(NamedTuple):
    """The graphs inductor built for a component so far, and how many were recompiles."""

    graphs: int
    recompiles: int

    @classmethod
    def of(cls, compilation: Compilation) -> Compiled:
        """Read them from ``compilation``."""
        return cls(compilation.graphs, compilation.recompiles)
