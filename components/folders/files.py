"""The weights of one component folder: safetensors files, sharded or not, read by header.

diffusers writes ``diffusion_pytorch_model.safetensors`` and transformers
``model.safetensors``; a large model is split into shards listed by a
``*.safetensors.index.json`` (its ``weight_map``: tensor name -> shard file). A hub
repository may also ship *variant* files beside them, the same weights in half
precision: ``diffusion_pytorch_model.fp16.safetensors``, or shards listed by
``model.safetensors.index.bf16.json``. A variant is read only when asked for, and
an asked one is never replaced by another. Only safetensors are ever read: a folder
whose weights are only pickled files (``.bin``, ``.pt``, ...) is refused, since
unpickling runs whatever code the file names; anything else there (a README,
``.gitattributes``, other frameworks' weights) is not looked at.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Literal

from components.weights import StoredTensor, read_header

__all__ = ["UnsafeWeightsError", "Variant", "VariantError", "stored_tensors", "weight_files"]

WEIGHT_NAMES = ("diffusion_pytorch_model", "model")
"""The stems diffusers and transformers give a component's weights."""
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
Variant = Literal["fp16", "bf16"]
"""The variants of a component's weight files that may be asked for (diffusers' ``variant``)."""

_SAFETENSORS = re.compile(
    rf"^(?:{'|'.join(WEIGHT_NAMES)})"
    r"(?:\.(?P<file>[A-Za-z0-9_]+))?(?:-\d+-of-\d+)?\.safetensors$"
    rf"|^(?:{'|'.join(WEIGHT_NAMES)})\.safetensors\.index(?:\.(?P<index>[A-Za-z0-9_]+))?\.json$"
)
"""A safetensors weights file or shard index, and the variant in its name, if any."""


class UnsafeWeightsError(ValueError):
    """A component folder holds its weights only in pickled files, which are never read.

    Attributes:
        folder: the component folder.
        files: the pickled files found there.
    """

    def __init__(self, folder: Path, files: list[Path]) -> None:
        self.folder = folder
        self.files = files
        names = ", ".join(f.name for f in files)
        super().__init__(
            f"{folder} holds its weights only as pickled files ({names}); loading them would "
            "run code from the file, so only safetensors are read"
        )


class VariantError(ValueError):
    """A component folder has safetensors weights, but not of the variant asked for.

    Attributes:
        folder: the component folder.
        variant: the variant asked for; None for the full-precision files.
        variants: the variants its safetensors files are of (None: no variant), sorted
            with None first.
        files: every weights file there, safetensors or pickled, by name.
    """

    def __init__(
        self, folder: Path, variant: str | None, variants: list[str | None], files: list[str]
    ) -> None:
        self.folder = folder
        self.variant = variant
        self.variants = variants
        self.files = files
        if variant is None:
            message = f"{folder} holds its weights only in variant files ({', '.join(files)})"
        else:
            message = f"{folder} has no {variant} variant of its weights: its weights files "
            message += f"are {', '.join(files)}"
        super().__init__(message)


def weight_files(folder: Path, variant: Variant | None = None) -> tuple[Path, ...]:
    """Return the safetensors files of ``variant`` holding the weights of the component in
    ``folder`` (None: the files without a variant).

    A sharded index wins over a single file, as in diffusers; every shard it lists
    must exist.

    Raises:
        UnsafeWeightsError: the only weights there are pickled files.
        VariantError: there are safetensors weights, but none of ``variant``.
        FileNotFoundError: there are no weights at all, or a listed shard is missing
            (the message names the path).
        ValueError: the shard index is not valid JSON with a ``weight_map``.
    """
    infix = "" if variant is None else f".{variant}"
    for stem in WEIGHT_NAMES:
        index = folder / f"{stem}.safetensors.index{infix}.json"
        if index.is_file():
            return _shards(index)
        single = folder / f"{stem}{infix}.safetensors"
        if single.is_file():
            return (single,)
    found = sorted(folder.iterdir()) if folder.is_dir() else []
    variants = {_variant(path.name) for path in found if _SAFETENSORS.match(path.name)}
    pickled = [path for path in found if path.suffix in PICKLE_SUFFIXES]
    if variants and variant not in variants:
        named = sorted(p.name for p in found if _SAFETENSORS.match(p.name) or p in pickled)
        raise VariantError(folder, variant, sorted(variants, key=lambda v: v or ""), named)
    if pickled:
        raise UnsafeWeightsError(folder, pickled)
    expected = " or ".join(f"{stem}.safetensors" for stem in WEIGHT_NAMES)
    raise FileNotFoundError(
        f"{folder} holds no weights: expected {expected} (or a sharded .safetensors.index.json)"
    )


def _variant(name: str) -> str | None:
    """Return the variant a safetensors weights file's name carries, None for none."""
    found = _SAFETENSORS.match(name)
    assert found is not None
    return found["file"] or found["index"]


def _shards(index: Path) -> tuple[Path, ...]:
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (ValueError, KeyError, TypeError) as err:
        raise ValueError(
            f"shard index {index} is not JSON with a 'weight_map' object ({err}); "
            "write it with save_pretrained"
        ) from err
    shards = tuple(index.parent / name for name in dict.fromkeys(weight_map.values()))
    for shard in shards:
        if not shard.is_file():
            raise FileNotFoundError(f"shard {shard} listed in {index} does not exist")
    return shards


def stored_tensors(files: tuple[Path, ...]) -> dict[str, tuple[StoredTensor, Path]]:
    """Return every tensor of ``files`` by name, with the file that holds it, from headers.

    Raises:
        OSError: a file cannot be read.
        ValueError: a file is not safetensors, or two files hold the same tensor.
    """
    found: dict[str, tuple[StoredTensor, Path]] = {}
    for path in files:
        for name, tensor in read_header(path).items():
            if name in found:
                raise ValueError(
                    f"tensor '{name}' is stored twice, in {found[name][1]} and {path}; "
                    "keep one shard per tensor"
                )
            found[name] = (tensor, path)
    return found
