"""Our own architectures against the libraries' classes on the same weights (issue 20).

Run: ``python -m benchmarks archs``. Each family of comparisons is a module of its own:
``_archs_encoders`` (T5, CLIP, the VAE) and ``_archs_dits`` (one denoising step; four
sizes in one packed batch).
"""

from __future__ import annotations

from benchmarks import _archs_dits, _archs_encoders


def main() -> None:
    """Print every comparison's table."""
    _archs_encoders.main()
    _archs_dits.main()
