"""A spec whose pipeline is a diffusers-format folder: ``source = "path"`` (design §12).

The folder says what the components are (each one's kind and options) and what the
stages are (its pipeline class's recipe); the spec's ``[components.X]`` tables only
override what a user chooses: residency, loader, attention, dtype, layerwise settings
and options. This resolves the parsed spec before it is decoded, so what comes out is
an ordinary spec with every component spelled out, and resolving that again changes
nothing (``lifecycle spec FOLDER`` prints it for a user to edit).

Reading the folder touches its JSON files only. A missing or malformed file is bad
input (``SourceError``, naming the path); a folder that is whole but cannot run
(an unsupported class, code of its own, pickled weights) resolves, leaving out the
components it refuses, and admission refuses it with every reason.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from components.recipes.folder import FolderPipeline

SOURCE = "source"
"""The spec key that names a pipeline folder."""


class SourceError(ValueError):
    """A spec's ``source`` folder, or what the spec says of it, is bad input.

    Attributes:
        message: what is wrong, naming the file or key, and the fix.
        path: the spec's key path (``$.source``, ``$.components.vae``).
    """

    def __init__(self, message: str, path: str) -> None:
        self.message = message
        self.path = path
        super().__init__(message)


def resolve_source(raw: dict[str, Any], base: Path) -> dict[str, Any]:
    """Return the parsed spec ``raw`` with its folder's components and stages spelled out.

    ``source`` is read relative to ``base`` (the spec file's folder) and becomes absolute.
    Each component of the folder gets its kind and options from the folder, the spec's
    own keys for it on top; the stages are the recipe's. The pipeline is named after the
    folder unless the spec names it.

    Raises:
        SourceError: the folder or one of its files is missing or malformed; the spec names
            a component the folder lacks, another kind than the folder's, or other stages.
    """
    source = raw[SOURCE]
    if not isinstance(source, str) or not source:
        raise SourceError(f"Expected a pipeline folder's path, got {source!r}", f"$.{SOURCE}")
    folder = (base / source).resolve()
    try:
        pipeline = FolderPipeline.read(folder)
    except (OSError, ValueError) as err:
        raise SourceError(str(err), f"$.{SOURCE}") from None
    components = _components(pipeline, raw.get("components", {}))
    stages = [
        {"name": stage.name, "uses": [name for name in stage.uses if name in components]}
        for stage in (pipeline.recipe.stages if pipeline.recipe is not None else ())
    ]
    stages = [stage for stage in stages if stage["uses"]]
    if "stages" in raw and raw["stages"] != stages:
        timeline = " -> ".join(f"{s['name']} [{', '.join(s['uses'])}]" for s in stages)
        raise SourceError(
            f"Expected the stages of the folder's {pipeline.model_index.pipeline_class} "
            f"({timeline or 'none'}), got others; remove [[stages]]: a folder's pipeline "
            "class sets them",
            "$.stages",
        )
    return {
        **raw,
        SOURCE: str(folder),
        "name": raw.get("name", folder.name),
        "components": components,
        "stages": stages,
    }


def _components(pipeline: FolderPipeline, overrides: object) -> dict[str, dict[str, Any]]:
    """Return each component of ``pipeline`` as a spec table, ``overrides`` applied."""
    if not isinstance(overrides, dict):
        raise SourceError(
            f"Expected a table of component overrides, got {type(overrides).__name__}",
            "$.components",
        )
    names = pipeline.names()
    for name, override in overrides.items():
        at = f"$.components.{name}"
        if name not in names:
            raise SourceError(
                f"Expected a component of the folder ({', '.join(names) or 'none'}), got {name!r}",
                at,
            )
        if not isinstance(override, dict):
            raise SourceError(f"Expected a table, got {type(override).__name__}", at)
    components = {}
    for name, plan in pipeline.components.items():
        override = dict(overrides.get(name, {}))
        kind = override.pop("kind", plan.kind)
        if kind != plan.kind:
            raise SourceError(
                f"Expected kind '{plan.kind}' (the folder's '{name}' is of class "
                f"{plan.options['class_name']}), got {kind!r}; remove the key: the folder "
                "names the class",
                f"$.components.{name}.kind",
            )
        options = override.pop("options", {})
        if not isinstance(options, dict):
            raise SourceError(
                f"Expected a table, got {type(options).__name__}", f"$.components.{name}.options"
            )
        components[name] = {"kind": plan.kind, **override, "options": {**plan.options, **options}}
    return components
