"""A pipeline folder read as the project sees it: a recipe, and a kind with options per component.

Reading a folder touches its JSON files and safetensors headers' presence only, never the
weights. What makes it unusable as given is said in one of two ways: a path that is
missing or unreadable is an exception naming it (bad input); a folder that is whole but
refused (an unsupported class, code shipped in the folder, pickled weights) is a
``Problem`` for admission to report with all the others.
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

from components import registry
from components.folders.files import UnsafeWeightsError, VariantError, weight_files
from components.folders.index import INDEX_FILE, PIPELINE, Entry, PipelineIndex, malformed_entry
from components.folders.loader import CONFIG_FILE
from components.folders.problems import Problem
from components.loader import ComponentLoader
from components.recipes import RECIPES, Recipe
from components.recipes.base import ENCODE, Stage, scheduler_config

__all__ = ["FolderPipeline"]

TEXT_ENCODER, TOKENIZER = "text_encoder", "tokenizer"
IMAGE_ENCODER, IMAGE_PROCESSOR = "image_encoder", "image_processor"


class ComponentPlan(NamedTuple):
    """How one component of a folder is loaded: its kind and that kind's options."""

    kind: str
    options: dict[str, str]


class FolderPipeline(NamedTuple):
    """A pipeline folder as its recipe runs it.

    Attributes:
        model_index: its ``model_index.json``.
        recipe: the recipe of its pipeline class; None when no recipe supports it.
        components: the kind and options of each component the recipe uses.
        problems: what admission must refuse, each with its code.
    """

    model_index: PipelineIndex
    recipe: type[Recipe] | None
    components: dict[str, ComponentPlan]
    problems: list[Problem]

    @classmethod
    def read(cls, folder: Path) -> FolderPipeline:
        """Read ``folder``: its index, the kind of each component, what must be refused.

        A component that is refused (code of the folder's own, pickled weights, a class no
        kind loads) is left out of ``components``; its problem says why.

        Raises:
            FileNotFoundError: ``model_index.json``, a subfolder the recipe uses, its
                ``config.json``, its tokenizer folder, its weights or the scheduler's
                config are missing (the message names the path).
            ValueError: a JSON file is malformed, the index lacks a component the
                pipeline class needs, or a config entry of the pipeline is wrong (the
                message names it).
        """
        index = PipelineIndex.read(folder)
        custom = {entry.name: entry for entry in index.custom_code()}
        problems = [_custom_code(entry) for entry in custom.values()]
        recipe = RECIPES.get(index.pipeline_class)
        if PIPELINE in custom:
            return cls(index, None, {}, problems)  # its class is the folder's own code
        if recipe is None:
            problems.append(_unsupported_pipeline(index.pipeline_class))
            return cls(index, None, {}, problems)
        scheduler_config(index)
        recipe.check_config(index)
        components = {}
        encoders = next(stage.uses for stage in recipe.stages if stage.name == ENCODE)
        for name in recipe.components_for(index):
            if name in index.config:  # a component's key, but not a [library, class] pair
                raise malformed_entry(folder / INDEX_FILE, name, index.config[name])
            if name not in index.entries:
                raise ValueError(
                    f"{folder / INDEX_FILE} has no '{name}', which {index.pipeline_class} needs"
                )
            entry = index.entries[name]
            path = index.subfolder(name)
            if name in custom:
                continue
            if not (path / CONFIG_FILE).is_file():
                raise FileNotFoundError(f"{path / CONFIG_FILE} does not exist")
            try:
                weight_files(path)
            except UnsafeWeightsError as err:
                problems.append(_unsafe_weights(name, err))
                continue
            except VariantError:
                pass  # safetensors of a variant: admission holds them to the variant asked
            kind = kind_for_class(entry.class_name)
            if kind is None:
                problems.append(_unsupported_component(name, entry.class_name))
                continue
            options = {"path": str(path), "class_name": entry.class_name}
            if name in encoders:
                options |= _helper_options(index, name)
            components[name] = ComponentPlan(kind, options)
        return cls(index, recipe, components, problems)

    def names(self) -> tuple[str, ...]:
        """Return every component the folder has: those its recipe uses, refused or not
        (without a recipe, every entry of its index)."""
        if self.recipe is None:
            return tuple(self.model_index.entries)
        return self.recipe.components_for(self.model_index)

    def stages(self) -> tuple[Stage, ...]:
        """Return the stages its recipe runs on this folder (none without a recipe)."""
        if self.recipe is None:
            return ()
        return self.recipe.stages_for(self.model_index)

    def loaders(self) -> dict[str, ComponentLoader]:
        """Return each component's loader, made from its plan's kind and options."""
        return {
            name: registry.get(plan.kind).from_options(plan.options)
            for name, plan in self.components.items()
        }


def _helper_options(index: PipelineIndex, name: str) -> dict[str, str]:
    """Return the options naming what encoder ``name`` reads its input with: a text encoder
    its tokenizer (``text_encoder_2``: ``tokenizer_2``), an image encoder its image
    processor; none for another component of the encode stage.

    Raises:
        ValueError: the index lacks the tokenizer or processor (named).
    """
    if name.startswith(TEXT_ENCODER):
        helper, option = name.replace(TEXT_ENCODER, TOKENIZER, 1), "tokenizer"
    elif name == IMAGE_ENCODER:
        helper, option = IMAGE_PROCESSOR, "processor"
    else:
        return {}
    if helper not in index.entries:
        what = "tokenize" if option == "tokenizer" else "prepare its images"
        raise ValueError(
            f"{index.folder / INDEX_FILE} has no '{helper}' for '{name}' to {what} with"
        )
    return {
        option: str(index.subfolder(helper)),
        f"{option}_class": index.entries[helper].class_name,
    }


def kind_for_class(class_name: str) -> str | None:
    """Return the kind that loads ``class_name`` (its ``classes`` name it), or None."""
    for kind in registry.names():
        if class_name in registry.get(kind).classes:
            return kind
    return None


def _custom_code(entry: Entry) -> Problem:
    if entry.name == PIPELINE:
        what, key = "its pipeline class", "_class_name"
    else:
        what, key = f"'{entry.name}'", entry.name
    return Problem(
        "pipeline.custom_code",
        entry.name,
        f"{INDEX_FILE} takes {what} ({entry.class_name}) from module '{entry.library}', code "
        "shipped in the folder; it is never imported (no trust_remote_code)",
        f"use a folder whose '{key}' entry names a diffusers or transformers class",
    )


def _unsafe_weights(name: str, err: UnsafeWeightsError) -> Problem:
    return Problem(
        "loader.unsafe_weights",
        name,
        str(err),
        f"convert {err.folder.name}'s weights to safetensors (for example with "
        "save_pretrained(..., safe_serialization=True)) where you trust them",
    )


NEEDS_PACKAGE = {"QwenImageEdit": "torchvision"}
"""Pipeline classes (by the start of their name) with no recipe because their processors need
a package that is not a dependency: Qwen-Image's edit pipelines resize their input images
with torchvision, whose wheel must match the pinned torch."""


def _unsupported_pipeline(class_name: str) -> Problem:
    needs = [package for head, package in NEEDS_PACKAGE.items() if class_name.startswith(head)]
    why = f" (its image processor needs {needs[0]}, which is not a dependency)" if needs else ""
    return Problem(
        "pipeline.unsupported_class",
        "pipeline",
        f"pipeline class '{class_name}' has no recipe here{why}; supported: {', '.join(RECIPES)}",
        "use a folder of a supported pipeline class",
    )


def _unsupported_component(name: str, class_name: str) -> Problem:
    return Problem(
        "pipeline.unsupported_class",
        name,
        f"no component kind loads class '{class_name}' of '{name}'",
        f"install a package whose kind lists '{class_name}' in ComponentLoader.classes, "
        f"registered through the entry-point group '{registry.ENTRY_POINT_GROUP}'",
    )
