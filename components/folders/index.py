"""A pipeline folder's ``model_index.json``: the pipeline class and its entries.

``{"_class_name": "FluxPipeline", "transformer": ["diffusers",
"FluxTransformer2DModel"], "image_encoder": [null, null], ...}``: each entry names the
library and class of one subfolder (a model, a tokenizer, a scheduler); keys starting
with ``_`` are metadata, ``[null, null]`` marks a component the folder lacks, and an entry
that is a number, a boolean or an object is the pipeline's own configuration
(``"is_distilled": true``: what its class was constructed with, which its recipe reads).
Nothing here imports a library: the index is read as JSON.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, NamedTuple, TypeGuard

__all__ = ["INDEX_FILE", "PIPELINE", "Entry", "PipelineIndex", "malformed_entry"]

INDEX_FILE = "model_index.json"
LIBRARIES = ("diffusers", "transformers")
"""The libraries whose classes a folder may name; anything else is a module to import."""
PIPELINE = "pipeline"
"""What the folder's pipeline class is called where a component's name would stand."""


class Entry(NamedTuple):
    """One subfolder of a pipeline folder as ``model_index.json`` names it.

    Attributes:
        name: the key (``text_encoder_2``), which is also the subfolder's name.
        library: the module the class comes from (``transformers``).
        class_name: the class (``T5EncoderModel``).
    """

    name: str
    library: str
    class_name: str


class PipelineIndex(NamedTuple):
    """What ``model_index.json`` says of a pipeline folder.

    Attributes:
        folder: the pipeline folder.
        pipeline_class: the pipeline class (``FluxPipeline``).
        entries: the subfolders it has, by name (null entries left out).
        pipeline_library: the module the pipeline class comes from: ``diffusers``, unless
            ``_class_name`` is a ``[module, class]`` pair naming code of its own.
        config: the pipeline's own configuration: the entries that are numbers, booleans or
            objects.
    """

    folder: Path
    pipeline_class: str
    entries: dict[str, Entry]
    pipeline_library: str = "diffusers"
    config: dict[str, Any] = {}  # noqa: RUF012  (a NamedTuple default, never mutated)

    @classmethod
    def read(cls, folder: Path) -> PipelineIndex:
        """Read the ``model_index.json`` of ``folder``.

        Raises:
            FileNotFoundError: the folder or its ``model_index.json`` does not exist.
            ValueError: the file is not JSON, lacks ``_class_name`` (a class name, or a
                ``[module, class]`` pair), or an entry that is not configuration is not a
                ``[library, class]`` pair (the message names the key).
        """
        path = folder / INDEX_FILE
        if not path.is_file():
            raise FileNotFoundError(
                f"{path} does not exist: a pipeline folder holds a {INDEX_FILE} naming its "
                "pipeline class and components (diffusers' save_pretrained writes one)"
            )
        try:
            raw = json.loads(path.read_text())
        except ValueError as err:
            raise ValueError(f"{path} is not valid JSON ({err})") from err
        pipeline = raw.get("_class_name") if isinstance(raw, dict) else None
        if isinstance(pipeline, str):
            pipeline = ["diffusers", pipeline]
        if not _is_pair(pipeline):
            raise ValueError(
                f"{path} has no '_class_name' string: it must name the pipeline class, "
                'e.g. "_class_name": "FluxPipeline"'
            )
        entries = {}
        config = {}
        for name, value in raw.items():
            if name.startswith("_") or value in ([None, None], None):
                continue
            if isinstance(value, bool | int | float | dict):
                config[name] = value
                continue
            if not _is_pair(value):
                raise malformed_entry(path, name, value)
            entries[name] = Entry(name, value[0], value[1])
        return cls(folder, pipeline[1], entries, pipeline[0], config)

    def custom_code(self) -> list[Entry]:
        """Return the entries whose library is a Python module shipped in the folder.

        diffusers would import such a module from the folder (code the folder brings);
        it is never imported here. A pipeline class of the folder's own code is the
        entry named ``pipeline``.
        """
        pipeline = Entry(PIPELINE, self.pipeline_library, self.pipeline_class)
        return [
            entry
            for entry in (pipeline, *self.entries.values())
            if entry.library not in LIBRARIES
            and any(
                (place / f"{entry.library}.py").is_file()
                for place in (self.folder, self.folder / entry.name)
            )
        ]

    def subfolder(self, name: str) -> Path:
        """Return the subfolder of entry ``name``.

        Raises:
            FileNotFoundError: the subfolder does not exist (the message names it).
        """
        path = self.folder / name
        if not path.is_dir():
            raise FileNotFoundError(
                f"{path} does not exist, but {INDEX_FILE} lists '{name}' "
                f"({self.entries[name].class_name}); restore the subfolder or set the entry "
                "to [null, null]"
            )
        return path


def malformed_entry(path: Path, name: str, value: object) -> ValueError:
    """Return the error of entry ``name`` of ``path``, whose ``value`` names no class."""
    return ValueError(
        f"{path}: entry '{name}' is {json.dumps(value)}; expected a "
        '["library", "ClassName"] pair or [null, null]'
    )


def _is_pair(value: object) -> TypeGuard[list[str]]:
    """Tell whether ``value`` is a ``[library, class]`` pair of strings."""
    return isinstance(value, list) and len(value) == 2 and all(isinstance(v, str) for v in value)
