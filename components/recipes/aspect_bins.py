"""diffusers' aspect-ratio bins, read from its source without running it, and the nearest bin.

diffusers keeps PixArt's bins as dict literals at the top of its pipeline modules.
Importing those modules imports the pipelines, and transformers with them (about 1.7
CPU-s a process), for a table: the one assignment is parsed out of the installed
module's source instead, once a process, and the nearest bin is chosen by diffusers'
rule (``PixArtImageProcessor.classify_height_width_bin``).
"""

from __future__ import annotations

import ast
import functools
import importlib.util
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TypeAlias

__all__ = ["AspectBins", "BinsNotFound", "nearest_bin", "read_bins"]

AspectBins: TypeAlias = Mapping[str, Sequence[float]]
"""Each bin's aspect ratio (height / width, written as a string) -> its [height, width]."""


class BinsNotFound(LookupError):
    """The installed diffusers holds no table of that name where the recipe reads it."""


@functools.cache  # a table never changes within a process (parsing its module: ~7 CPU-ms)
def read_bins(module: str, name: str) -> AspectBins:
    """Return the dict literal assigned to ``name`` at the top of ``module``'s source.

    The module is found on the import path, not imported, and its parents neither
    (importing ``diffusers`` alone costs about a second).

    Raises:
        BinsNotFound: the module's source is not installed, or assigns ``name`` no dict
            literal at its top (a diffusers that moved the table); the message names both.
    """
    path = _source(module)
    table = None if path is None else _assigned(ast.parse(path.read_bytes()), name)
    if table is None:
        where = f"{module} ({path})" if path is not None else f"{module} (no source installed)"
        raise BinsNotFound(
            f"diffusers' aspect-ratio bins {name} are not a dict literal at the top of "
            f"{where}, where PixArt's recipes read them: this diffusers moved them; install "
            "the diffusers version the project was tested with (pip install "
            "'pipeline-lifecycle[diffusers]')"
        )
    return table


def nearest_bin(height: int, width: int, bins: AspectBins) -> tuple[int, int]:
    """Return the (height, width) of the bin whose aspect ratio is nearest ``height / width``.

    The first of equally near bins wins, in the table's order, as in diffusers.
    """
    ratio = height / width
    nearest = min(bins, key=lambda key: abs(float(key) - ratio))
    bin_height, bin_width = bins[nearest]
    return int(bin_height), int(bin_width)


def _source(module: str) -> Path | None:
    """Return the path of ``module``'s source file under its top package, without importing."""
    top, *rest = module.split(".")
    spec = importlib.util.find_spec(top)
    for folder in (spec and spec.submodule_search_locations) or ():
        path = Path(folder, *rest).with_suffix(".py")
        if path.is_file():
            return path
    return None


def _assigned(tree: ast.Module, name: str) -> AspectBins | None:
    """Return the dict literal a top-level statement of ``tree`` assigns to ``name``."""
    for node in tree.body:
        if isinstance(node, ast.Assign):
            targets, value = node.targets, node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            targets, value = [node.target], node.value
        else:
            continue
        if any(isinstance(target, ast.Name) and target.id == name for target in targets):
            try:
                table = ast.literal_eval(value)
            except ValueError:  # an expression, not a literal
                return None
            return table if isinstance(table, dict) else None
    return None
