"""Our own architectures against the libraries' classes on the same weights (issue 20).

Run: ``python -m benchmarks archs``. Each comparison is a function of its own module:
``_archs_dits`` (one denoising step; four sizes in one packed batch).
"""

from __future__ import annotations

from benchmarks import _archs_dits


def main() -> None:
    """Print every comparison's table."""
    _archs_dits.main()
