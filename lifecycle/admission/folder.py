"""A pipeline from a folder: what the folder refuses, and whether its components fit together.

Only the folder's JSON files and configs are read (``components.folders``). What the
folder cannot run (an unsupported class, code of its own, pickled weights) is refused
under the problem's own code; the recipe of its pipeline class says where the
components' widths do not fit, in place of the generic walk over ports (SD3's text
states are joined side by side, not handed from one encoder to the next).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import NamedTuple

from components.defaults import DEFAULT_STEPS
from components.folders.index import PIPELINE
from components.folders.problems import Problem
from components.loader import ComponentLoader
from components.recipes import Recipe
from components.recipes.base import RecipeError
from components.recipes.folder import FolderPipeline
from lifecycle.refusals import Refusal, RefusalCode
from lifecycle.spec.model_ids import source_folder
from lifecycle.spec.structs import PipelineSpec

__all__ = ["default_steps", "open_folder"]

_CODES = {code.value: code for code in RefusalCode}
"""Each refusal code by its value: a folder's problems name theirs as strings."""


class OpenedFolder(NamedTuple):
    """A spec's folder as admission and the orchestrator see it.

    Attributes:
        recipe: the recipe of its pipeline class on the spec's loaders; None when the
            folder is refused as a whole (then ``refusals`` say why).
        refusals: every reason the folder cannot run, with its code.
    """

    recipe: Recipe | None
    refusals: list[Refusal]


def open_folder(spec: PipelineSpec, loaders: Mapping[str, ComponentLoader]) -> OpenedFolder:
    """Read the folder of ``spec`` (which has a ``source``) and its recipe on ``loaders``.

    Never raises for what the folder holds: a file that went missing since the spec was
    decoded, or a config the recipe cannot read, is a ``loader.unavailable`` refusal.
    """
    try:
        pipeline = FolderPipeline.read(source_folder(str(spec.source)))
        refusals = _refusals(spec, pipeline.problems)
        if refusals or pipeline.recipe is None:
            return OpenedFolder(None, refusals)
        recipe = pipeline.recipe(pipeline.model_index, loaders)
        return OpenedFolder(recipe, _refusals(spec, recipe.interface_problems()))
    except RecipeError as err:
        return OpenedFolder(None, _refusals(spec, err.problems))
    except (OSError, ValueError, KeyError) as err:
        what = f"a config lacks the key {err}" if isinstance(err, KeyError) else str(err)
        return OpenedFolder(
            None,
            [
                Refusal(
                    code=RefusalCode.LOADER_UNAVAILABLE,
                    component=spec.name,
                    message=f"the pipeline folder {spec.source} cannot be read: {what}",
                    hint="restore the folder as save_pretrained wrote it, or point source at "
                    "another",
                )
            ],
        )


def default_steps(recipe: Recipe | None) -> int:
    """Return the denoising steps of a request that names none: the pipeline class's
    (``recipe``), else ``DEFAULT_STEPS`` for a pipeline of kinds.

    The one default: HTTP, ``lifecycle run`` and admission's step cache check take it here,
    and a ``Batch`` made in Python has it for a pipeline of kinds.
    """
    return DEFAULT_STEPS if recipe is None else recipe.default_steps


def _refusals(spec: PipelineSpec, problems: Iterable[Problem]) -> list[Refusal]:
    return [
        Refusal(
            code=_CODES[problem.code],
            component=spec.name if problem.component == PIPELINE else problem.component,
            message=problem.message,
            hint=problem.hint,
        )
        for problem in problems
    ]
