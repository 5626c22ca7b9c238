"""A pipeline folder's ``model_index.json``: the pipeline class and its entries.

``{"_class_name": "FluxPipeline", "transformer": ["diffusers",
"FluxTransformer2DModel"], "image_encoder": [null, null], ...}``: each entry names the
library and class of one subfolder (a model, a tokenizer, a scheduler); keys starting
with ``_`` are metadata and ``[null, null]`` marks a component the folder lacks.
Nothing here imports a library: the index is read as JSON.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import NamedTuple

INDEX_FILE = "model_index.json"
LIBRARIES = ("diffusers", "transformers")
"""The libraries whose classes a folder may name; anything else is a module to import."""


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
        pipeline_class: the diffusers pipeline class (``FluxPipeline``).
        entries: the subfolders it has, by name (null entries left out).
    """

    folder: Path
    pipeline_class: str
    entries: dict[str, Entry]

    @classmethod
    def read(cls, folder: Path) -> PipelineIndex:
        """Read the ``model_index.json`` of ``folder``.

        Raises:
            FileNotFoundError: the folder or its ``model_index.json`` does not exist.
            ValueError: the file is not JSON, lacks ``_class_name``, or an entry is not a
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
        if not isinstance(raw, dict) or not isinstance(raw.get("_class_name"), str):
            raise ValueError(
                f"{path} has no '_class_name' string: it must name the pipeline class, "
                'e.g. "_class_name": "FluxPipeline"'
            )
        entries = {}
        for name, value in raw.items():
            if name.startswith("_") or value in ([None, None], None):
                continue
            if not (
                isinstance(value, list)
                and len(value) == 2
                and all(isinstance(part, str) for part in value)
            ):
                raise ValueError(
                    f"{path}: entry '{name}' is {json.dumps(value)}; expected a "
                    '["library", "ClassName"] pair or [null, null]'
                )
            entries[name] = Entry(name, value[0], value[1])
        return cls(folder, raw["_class_name"], entries)

    def custom_code(self) -> list[Entry]:
        """Return the entries whose library is a Python module shipped in the folder.

        diffusers would import such a module from the folder (code the folder brings);
        it is never imported here.
        """
        return [
            entry
            for entry in self.entries.values()
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
