"""A spec whose pipeline is a diffusers-format folder: ``source = "path"`` (design §12).

The folder says what the components are (each one's kind and options) and what the
stages are (its pipeline class's recipe); the spec's ``[components.X]`` tables only
override what a user chooses: residency, loader, attention, dtype, layerwise settings
and options. This resolves the parsed spec before it is decoded, so what comes out is
an ordinary spec with every component spelled out, and resolving that again changes
nothing (``lifecycle spec FOLDER`` prints it for a user to edit).

``source`` may also be a model id, ``ORG/NAME[@REVISION]``, read from the Hugging Face
cache (``lifecycle.spec.model_ids``; an existing path of that name wins); it resolves to the
id pinned at its commit. A top-level ``variant`` becomes each component's
``options.variant`` unless the component sets its own.

Reading the folder touches its JSON files only. A missing or malformed file, or a model
id the cache lacks, is bad input (``SourceError``, naming the path); a folder that is
whole but cannot run (an unsupported class, code of its own, pickled weights, a variant
it lacks) resolves, leaving out the components it refuses, and admission refuses it with
every reason.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from components.recipes.base import Stage
from components.recipes.folder import FolderPipeline
from lifecycle.spec.model_ids import ModelId, ModelIdError, cache_folder, parse_model_id

__all__ = ["SOURCE", "SourceError", "resolve_source"]

SOURCE = "source"
"""The spec key that names a pipeline folder."""
SOURCE_DOWNLOAD = "source_download"
"""The spec key that lets a model id be downloaded into the cache."""
VARIANT = "variant"
"""The spec key (and folder kinds' option) that picks variant weight files."""
SKIPPED_FILES = (
    "*.bin", "*.pt", "*.pth", "*.ckpt", "*.pkl",  # pickles: never read (design §12)
    "*.msgpack", "*.h5", "*.onnx", "*.onnx_data", "*.tflite",  # other frameworks' weights
)  # fmt: skip
"""What a download leaves out, and what the cache need not hold for a snapshot to be whole."""


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


def _stage(stage: Stage, components: Mapping[str, Any]) -> dict[str, Any]:
    """Return a recipe's stage as the spec writes it: its uses among ``components``, and
    their step windows where it has some."""
    uses = [name for name in stage.uses if name in components]
    written: dict[str, Any] = {"name": stage.name, "uses": uses}
    windows = {
        name: {
            key: bound
            for key, bound in zip(("from_timestep", "below_timestep"), window, strict=True)
            if bound is not None
        }
        for name, window in stage.windows.items()
        if name in uses
    }
    if windows:
        written["windows"] = windows
    return written


def resolve_source(raw: dict[str, Any], base: Path, *, download: bool = False) -> dict[str, Any]:
    """Return the parsed spec ``raw`` with its folder's components and stages spelled out.

    ``source`` is read relative to ``base`` (the spec file's folder) and becomes absolute;
    a model id becomes the id pinned at its commit (``download``, or the spec's
    ``source_download``, lets it be fetched into the cache). Each component of the folder
    gets its kind and options from the folder, the spec's own keys for it on top; the
    stages are the recipe's. The pipeline is named after the folder (a model id's name)
    unless the spec names it.

    Raises:
        SourceError: the folder or one of its files is missing or malformed, or a model id
            is not in the cache; the spec names a component the folder lacks, another
            kind than the folder's, or other stages.
    """
    source = raw[SOURCE]
    if not isinstance(source, str) or not source:
        raise SourceError(
            f"Expected a pipeline folder's path or a model id, got {source!r}", f"$.{SOURCE}"
        )
    folder, source, name = _folder(source, base, download or raw.get(SOURCE_DOWNLOAD) is True)
    try:
        pipeline = FolderPipeline.read(folder)
    except (OSError, ValueError) as err:
        raise SourceError(str(err), f"$.{SOURCE}") from None
    variant = {VARIANT: raw[VARIANT]} if VARIANT in raw else {}
    components = _components(pipeline, raw.get("components", {}), variant)
    stages = [_stage(stage, components) for stage in pipeline.stages()]
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
        SOURCE: source,
        "name": raw.get("name", name),
        "components": components,
        "stages": stages,
    }


def _folder(source: str, base: Path, download: bool) -> tuple[Path, str, str]:
    """Return the folder ``source`` names, ``source`` as resolved (an absolute path, or a
    model id pinned at its commit) and the name a pipeline from it takes.

    Raises:
        SourceError: a model id that cannot be resolved.
    """
    path = base / source
    try:
        taken = path.exists()
    except OSError:  # a name the file system refuses to look up: reading it says so
        taken = True
    model_id = None if taken else parse_model_id(source)
    if model_id is None:
        folder = path.resolve()
        return folder, str(folder), folder.name
    try:
        pinned, folder = _resolve(model_id, download)
    except ModelIdError as err:
        raise SourceError(
            f"Expected a pipeline folder or a model id in the Hugging Face cache, got "
            f"{source!r}: there is no file or folder at {path.resolve()}, and {err}",
            f"$.{SOURCE}",
        ) from None
    return folder, str(pinned), model_id.name


def _resolve(model_id: ModelId, download: bool) -> tuple[ModelId, Path]:
    """Return ``model_id`` pinned at the commit its revision names, and that snapshot's folder.

    Reads the cache only, unless ``download``: then huggingface_hub fetches what the cache
    lacks (all but ``SKIPPED_FILES``) and records the revision.

    Raises:
        ModelIdError: the cache holds no snapshot of that revision (and ``download`` is
            off, or the download failed), or huggingface_hub is not installed; the
            message names the cache folder and the fix.
    """
    cache = cache_folder()
    from huggingface_hub import snapshot_download

    revision = model_id.revision or "main"
    try:
        folder = snapshot_download(
            model_id.repo,
            revision=model_id.revision,
            local_files_only=not download,
            ignore_patterns=list(SKIPPED_FILES),
        )
    except (OSError, ValueError) as err:
        if download:
            raise ModelIdError(
                f"cannot download model {model_id.repo} (revision {revision}) into the "
                f"Hugging Face cache {cache}: {_first_line(err)}"
            ) from None
        raise ModelIdError(
            f"model {model_id.repo} (revision {revision}) is not in the Hugging Face cache "
            f"{cache}; download it with --download (in a spec: source_download = true), or "
            "set HF_HUB_CACHE to the cache that holds it"
        ) from None
    path = Path(folder)
    return ModelId(model_id.repo, path.name), path


def _first_line(err: Exception) -> str:
    return (str(err).strip().splitlines() or [type(err).__name__])[0]


def _components(
    pipeline: FolderPipeline, overrides: object, defaults: dict[str, Any]
) -> dict[str, dict[str, Any]]:
    """Return each component of ``pipeline`` as a spec table, ``overrides`` applied over
    its folder's options and the pipeline-wide ``defaults`` of options."""
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
        options = {**plan.options, **defaults, **options}
        components[name] = {"kind": plan.kind, **override, "options": options}
    return components
