"""Weights: made deterministically from a seed, stored and read as safetensors."""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import NamedTuple, Protocol, TypeAlias, cast

import torch
import xxhash
from safetensors import SafetensorError, safe_open
from torch import nn

__all__ = [
    "DeclaredTensor",
    "DeclaredTensors",
    "StoredTensor",
    "TensorChecksum",
    "digest",
    "header_problems",
    "is_floating",
    "load_weights",
    "read_header",
    "seed_weights",
    "stored_bytes",
    "stored_problems",
    "tensor_bytes",
    "tensor_checksums",
]

# Bits per element of each safetensors dtype, under the format's own names.
_DTYPE_BITS = {
    "BOOL": 8,
    "U8": 8,
    "I8": 8,
    "F8_E5M2": 8,
    "F8_E4M3": 8,
    "F8_E8M0": 8,
    "F8_E4M3FNUZ": 8,
    "F8_E5M2FNUZ": 8,
    "I16": 16,
    "U16": 16,
    "F16": 16,
    "BF16": 16,
    "I32": 32,
    "U32": 32,
    "F32": 32,
    "C64": 64,
    "F64": 64,
    "I64": 64,
    "U64": 64,
    "F4": 4,
    "F6_E2M3": 6,
    "F6_E3M2": 6,
}


class DeclaredTensor(NamedTuple):
    """A tensor a kind's module holds, as a weights file must store it.

    Attributes:
        shape: its shape.
        floating: whether it holds floating-point values (a file must store it in a
            floating dtype); False for an integer buffer the checkpoint carries.
    """

    shape: tuple[int, ...]
    floating: bool = True


DeclaredTensors: TypeAlias = dict[str, DeclaredTensor]


class TensorChecksum(NamedTuple):
    """What a weights file stores for one tensor: enough to tell two files' contents equal.

    Attributes:
        name: the tensor's name.
        dtype: its dtype, under the safetensors format's name.
        shape: its shape.
        checksum: the xxh3 checksum of its bytes.
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    checksum: int


_FLOATING = frozenset(d for d in _DTYPE_BITS if d.startswith(("F", "BF")))


class _TensorInfo(Protocol):
    """What ``safe_open(...).get_slice`` tells of a tensor without reading it."""

    def get_dtype(self) -> str: ...

    def get_shape(self) -> list[int]: ...


class _SafetensorsFile(Protocol):
    """The part of an open ``safe_open`` file used here (safetensors ships it untyped)."""

    def keys(self) -> list[str]: ...

    def get_slice(self, name: str) -> _TensorInfo: ...

    def get_tensor(self, name: str) -> torch.Tensor: ...


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


def load_weights(module: nn.Module, path: Path) -> None:
    """Copy the weights in the safetensors file at ``path`` into ``module``, in place.

    Copying into the existing parameters keeps tied weights tied.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: the file is not safetensors, its tensors do not match the
            module's names or shapes, or one holds NaN or infinity.
    """
    with _open(path) as file:
        names = file.keys()  # an open file is not iterable itself
        tensors = {name: file.get_tensor(name) for name in names}
    bad = nonfinite(tensors)
    if bad:
        raise ValueError(
            f"weights in {path}: {_some(bad)} hold NaN or infinity; the file is corrupt "
            "or was written from a diverged model"
        )
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


def digest(tensor: torch.Tensor) -> int:
    """Return the xxh3 checksum of a contiguous tensor's bytes."""
    return xxhash.xxh3_64_intdigest(tensor.reshape(-1).view(torch.uint8).numpy().data)


def tensor_checksums(path: Path) -> tuple[TensorChecksum, ...]:
    """Return each tensor of the safetensors file at ``path`` with its checksum, by name.

    Two files with equal answers hold the same weights, whatever their paths, names
    or header order. Each tensor is read through the file's memory map, one at a time.

    Raises:
        OSError: the file cannot be read.
        ValueError: the file is not safetensors.
    """
    found = []
    with _open(path) as file:
        for name in sorted(file.keys()):
            info = file.get_slice(name)
            tensor = file.get_tensor(name).contiguous()
            found.append(
                TensorChecksum(name, info.get_dtype(), tuple(info.get_shape()), digest(tensor))
            )
    return tuple(found)


def nonfinite(tensors: dict[str, torch.Tensor]) -> list[str]:
    """Return the names of the floating tensors that hold a NaN or an infinity, sorted."""
    return sorted(
        name
        for name, tensor in tensors.items()
        if tensor.is_floating_point() and not _finite(tensor)
    )


def _finite(tensor: torch.Tensor) -> bool:
    # A NaN or an infinity anywhere makes the sum non-finite, so a finite sum settles it
    # in one fast reduction; only a sum that overflowed needs the element-wise test.
    return bool(torch.isfinite(tensor.sum())) or bool(torch.isfinite(tensor).all())


class StoredTensor(NamedTuple):
    """What a safetensors header says of one tensor.

    Attributes:
        dtype: its dtype, as safetensors names it (``F32``, ``BF16``, ``I64`` ...).
        shape: its shape.
    """

    dtype: str
    shape: tuple[int, ...]


def read_header(path: Path) -> dict[str, StoredTensor]:
    """Return each tensor of the safetensors file at ``path`` by name, from its header alone.

    Raises:
        OSError: the file cannot be read.
        ValueError: the file is not safetensors (its message says so, naming the file).
    """
    with _open(path) as file:
        names = file.keys()
        stored = {name: file.get_slice(name) for name in names}
        return {n: StoredTensor(t.get_dtype(), tuple(t.get_shape())) for n, t in stored.items()}


def header_problems(path: Path, declared: DeclaredTensors | None) -> list[str]:
    """Say how the weights file at ``path`` fails the declaration, from its header alone.

    Raises:
        OSError: the file cannot be read.
        ValueError: the file is not safetensors (its message says so, naming the file).
    """
    return stored_problems(read_header(path), declared)


def stored_problems(
    header: Mapping[str, StoredTensor], declared: DeclaredTensors | None
) -> list[str]:
    """Say how the stored tensors of ``header`` fail the declaration.

    Every stored tensor must be floating point unless the kind declares it an integer
    buffer; with a declaration, the names and shapes must be exactly the declared ones
    (``declared`` None: a kind that cannot say, whose names are checked at load).
    """
    problems = []
    if declared is not None:
        missing = sorted(declared.keys() - header.keys())
        unexpected = sorted(header.keys() - declared.keys())
        if missing:
            problems.append(f"missing {_some(missing)}")
        if unexpected:
            problems.append(f"unexpected {_some(unexpected)}")
    for name, (dtype, shape) in header.items():
        want = declared.get(name) if declared is not None else None
        if want is not None and shape != want.shape:
            problems.append(
                f"'{name}' has shape {list(shape)}, the kind declares {list(want.shape)}"
            )
        if (want is None or want.floating) and dtype not in _FLOATING:
            problems.append(f"'{name}' is stored as {dtype}, not a floating-point dtype")
    return problems


def _some(names: list[str], shown: int = 5) -> str:
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return ", ".join(f"'{n}'" for n in names[:shown]) + more


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
        ValueError: the file is not safetensors, or a tensor has a dtype this version
            cannot size.
    """
    return sum(tensor_bytes(name, tensor, path) for name, tensor in read_header(path).items())


def tensor_bytes(name: str, tensor: StoredTensor, path: Path) -> int:
    """Return the bytes ``tensor`` (``name`` in the file at ``path``) takes as stored.

    Raises:
        ValueError: its dtype is one this version cannot size.
    """
    if tensor.dtype not in _DTYPE_BITS:
        raise ValueError(
            f"weights file {path}: tensor '{name}' has dtype {tensor.dtype}, which this "
            f"version cannot size; store it as one of {', '.join(sorted(_DTYPE_BITS))}"
        )
    bits = math.prod(tensor.shape) * _DTYPE_BITS[tensor.dtype]
    return (bits + 7) // 8  # each tensor starts on a byte


def is_floating(tensor: StoredTensor) -> bool:
    """Tell whether ``tensor`` is stored in a floating-point dtype."""
    return tensor.dtype in _FLOATING


@contextmanager
def _open(path: Path) -> Iterator[_SafetensorsFile]:
    """Open the safetensors file at ``path``; a malformed file is a ValueError naming it.

    safetensors validates the whole header when the file opens (its JSON, each tensor's
    offsets against the file's length) and refuses a header longer than 100 MB, so a
    corrupt length never makes us allocate it.
    """
    try:
        file = safe_open(path, framework="pt")
    except SafetensorError as err:
        raise ValueError(
            f"weights file {path} is not a valid safetensors file ({err}); write it with "
            "safetensors (save_file or save_model), or point options.weights at another file"
        ) from err
    with file:
        yield cast("_SafetensorsFile", file)
