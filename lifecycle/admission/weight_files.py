"""Weights files: held to the kind's declared tensors from their header, before any load."""

from __future__ import annotations

from pathlib import Path

from components.loader import ComponentLoader
from components.weights import header_problems
from lifecycle.refusals import Refusal, RefusalCode


def weights_refusals(name: str, loader: ComponentLoader) -> list[Refusal]:
    """Refuse a weights file whose header is unreadable or does not match the kind.

    A missing file is the loader path's refusal (``loader.unavailable``), not this one.
    """
    weights = loader.options.weights
    if weights is None or not Path(weights).is_file():
        return []
    try:
        problems = header_problems(Path(weights), loader.tensors())
    except (OSError, ValueError) as err:
        problems = [str(err)]
    if not problems:
        return []
    shown = problems[:5] + ([f"{len(problems) - 5} more"] if len(problems) > 5 else [])
    return [
        Refusal(
            code=RefusalCode.WEIGHTS_MISMATCH,
            component=name,
            message=f"weights file '{weights}' does not fit kind '{loader.kind}': "
            + "; ".join(shown),
            hint=f"point components.{name}.options.weights at a file written by this kind "
            "with these options, its tensors in a floating-point dtype",
        )
    ]
