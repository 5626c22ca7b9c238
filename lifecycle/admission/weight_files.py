"""Weights files: held to the kind's declared tensors from their header, before any load."""

from __future__ import annotations

from pathlib import Path

from components.folders.loader import FolderLoader
from components.loader import ComponentLoader
from components.weights import header_problems
from lifecycle.refusals import Refusal, RefusalCode

__all__ = ["weights_refusals"]


def weights_refusals(name: str, loader: ComponentLoader) -> list[Refusal]:
    """Refuse a weights file whose header is unreadable or does not match the kind.

    A missing file is the loader path's refusal (``loader.unavailable``), not this one.
    """
    if isinstance(loader, FolderLoader):
        return _folder_refusals(name, loader)
    weights = loader.options.weights
    if weights is None or not Path(weights).is_file():
        return []
    try:
        problems = header_problems(Path(weights), loader.tensors())
    except (OSError, ValueError) as err:
        problems = [str(err)]
    if not problems:
        return []
    return [
        Refusal(
            code=RefusalCode.WEIGHTS_MISMATCH,
            component=name,
            message=f"weights file '{weights}' does not fit kind '{loader.kind}': "
            + _shown(problems),
            hint=f"point components.{name}.options.weights at a file written by this kind "
            "with these options, its tensors in a floating-point dtype",
        )
    ]


def _folder_refusals(name: str, loader: FolderLoader) -> list[Refusal]:
    """Refuse a component folder whose headers do not hold what its class, built on
    ``meta`` from its ``config.json``, expects (names, shapes, floating dtypes)."""
    try:
        problems = loader.weight_problems()
    except (OSError, ValueError) as err:
        problems = [str(err)]
    if not problems:
        return []
    return [
        Refusal(
            code=RefusalCode.WEIGHTS_MISMATCH,
            component=name,
            message=f"the weights in {loader.folder} do not fit {loader.class_name} as its "
            f"config.json builds it: {_shown(problems)}",
            hint="restore the folder's weights and config.json as save_pretrained wrote them "
            "(both from the same model)",
        )
    ]


def _shown(problems: list[str]) -> str:
    """Join the first five problems, and say how many more there are."""
    shown = problems[:5] + ([f"{len(problems) - 5} more"] if len(problems) > 5 else [])
    return "; ".join(shown)
