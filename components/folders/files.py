"""The weights of one component folder: safetensors files, sharded or not, read by header.

diffusers writes ``diffusion_pytorch_model.safetensors`` and transformers
``model.safetensors``; a large model is split into shards listed by a
``*.safetensors.index.json`` (its ``weight_map``: tensor name -> shard file). Only
safetensors are ever read: a folder whose weights are only pickled files (``.bin``,
``.pt``, ...) is refused, since unpickling runs whatever code the file names.
"""

from __future__ import annotations

import json
from pathlib import Path

from components.weights import StoredTensor, read_header

WEIGHT_NAMES = ("diffusion_pytorch_model", "model")
"""The stems diffusers and transformers give a component's weights."""
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


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


def weight_files(folder: Path) -> tuple[Path, ...]:
    """Return the safetensors files holding the weights of the component in ``folder``.

    A sharded index wins over a single file, as in diffusers; every shard it lists
    must exist.

    Raises:
        UnsafeWeightsError: the only weights there are pickled files.
        FileNotFoundError: there are no weights at all, or a listed shard is missing
            (the message names the path).
        ValueError: the shard index is not valid JSON with a ``weight_map``.
    """
    for stem in WEIGHT_NAMES:
        index = folder / f"{stem}.safetensors.index.json"
        if index.is_file():
            return _shards(index)
        single = folder / f"{stem}.safetensors"
        if single.is_file():
            return (single,)
    pickled = sorted(p for p in folder.glob("*") if p.suffix in PICKLE_SUFFIXES)
    if pickled:
        raise UnsafeWeightsError(folder, pickled)
    expected = " or ".join(f"{stem}.safetensors" for stem in WEIGHT_NAMES)
    raise FileNotFoundError(
        f"{folder} holds no weights: expected {expected} (or a sharded .safetensors.index.json)"
    )


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
