"""Weights: made deterministically from a seed, stored and read as safetensors."""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

import torch
from safetensors.torch import load_file, save_model
from torch import nn


def seed_weights(module: nn.Module, seed: int) -> None:
    """Fill every parameter and persistent buffer of ``module`` from ``seed``.

    Each tensor draws from its own generator, seeded by ``seed`` and the
    tensor's name, so the values do not depend on construction order or on
    which loading path built the module: two modules with the same names and
    shapes get the same weights.
    """
    with torch.no_grad():
        for name, tensor in module.state_dict(keep_vars=True).items():
            if not tensor.is_floating_point():
                continue
            digest = hashlib.blake2b(f"{seed}:{name}".encode(), digest_size=8).digest()
            generator = torch.Generator().manual_seed(int.from_bytes(digest, "little") >> 1)
            values = torch.randn(tensor.shape, generator=generator, dtype=torch.float32)
            if tensor.dim() >= 2:
                # fan-in scaling keeps activations O(1) through the stack
                values /= math.sqrt(tensor[0].numel())
            elif name.endswith("weight"):
                values = 1.0 + 0.1 * values  # norm gains near one
            else:
                values *= 0.02
            tensor.copy_(values.to(tensor.dtype))


def save_weights(module: nn.Module, path: Path) -> None:
    """Write ``module``'s weights to a safetensors file (tied weights stored once)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    save_model(module, str(path))


def load_weights(module: nn.Module, path: Path) -> None:
    """Copy the weights in the safetensors file at ``path`` into ``module``, in place.

    Copying into the existing parameters keeps tied weights tied.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: the file's tensors do not match the module's names or shapes.
    """
    tensors = load_file(str(path))
    own = module.state_dict(keep_vars=True)
    missing = sorted(
        name
        for group in _storage_groups(own).values()
        if tensors.keys().isdisjoint(group)
        for name in group
    )
    unexpected = sorted(set(tensors) - set(own))
    if missing or unexpected:
        raise ValueError(
            f"weights in {path} do not match the module: missing {missing[:5]}, "
            f"unexpected {unexpected[:5]}; write them with the same kind and options"
        )
    with torch.no_grad():
        for name, tensor in tensors.items():
            if own[name].shape != tensor.shape:
                raise ValueError(
                    f"weights in {path}: {name} has shape {tuple(tensor.shape)}, "
                    f"the module expects {tuple(own[name].shape)}"
                )
            own[name].copy_(tensor)


def _storage_groups(tensors: dict[str, torch.Tensor]) -> dict[int, list[str]]:
    """Group names by the storage they share; tied weights form one group."""
    groups: dict[int, list[str]] = {}
    for name, tensor in tensors.items():
        key = tensor.untyped_storage().data_ptr() if tensor.numel() else id(tensor)
        groups.setdefault(key, []).append(name)
    return groups


def stored_bytes(path: Path) -> int:
    """Return the bytes of the tensors in the safetensors file at ``path``, from its header.

    Only the header is read: sizing a component for admission never loads it.

    Raises:
        OSError: the file cannot be read.
        ValueError: the file is not safetensors.
    """
    with path.open("rb") as file:
        prefix = file.read(8)
        if len(prefix) != 8:
            raise ValueError(f"{path} is not a safetensors file (no header length)")
        header = json.loads(file.read(int.from_bytes(prefix, "little")))
    return sum(
        entry["data_offsets"][1] - entry["data_offsets"][0]
        for name, entry in header.items()
        if name != "__metadata__"
    )
