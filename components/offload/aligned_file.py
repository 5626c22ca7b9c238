"""A safetensors file that puts each tensor as far past a 64-byte boundary as its weight lay.

Why: onload on a CPU device maps the offload file, so a weight's address is its
offset in the file, and BLAS kernels may take another path through a product
when an operand is off their vector width (measured: MKL's SSE4.2 kernels give
other bits for a one-row product whose weight lies 8 bytes past a boundary; the
issue's machine gave a six-layer tiny DiT 2.4e-7 of difference). So each tensor
goes at the residue modulo 64 its weight had when the file was written: on a
boundary for every weight torch allocated (it aligns each allocation to 64
bytes), and where a weight mapped from a model's own file lay otherwise (a tiny
folder's Flux DiT lies 24 bytes past one; a file aligned outright would change
its bits instead). ``safetensors.torch.save_file`` pads its header to 8 bytes
only and packs the tensors, so its offsets are whatever the sizes before make.

How, within the format: the JSON header may end in spaces, which brings the data
to a 64-byte boundary; the data must be covered by the tensors' offsets without
holes, so the bytes before a tensor that would start elsewhere are a ``U8``
padding tensor of their own, named under :data:`PADDING`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

__all__ = ["ALIGNMENT", "residue", "write_placed"]

ALIGNMENT = 64
"""The boundary a tensor's offset is placed against: a cache line, and the widest vector
load (AVX-512)."""

PADDING = ".padding."
"""The prefix of padding tensors' names. A module's tensors are named by dotted paths of
non-empty names, so none starts with a dot and a padding tensor never takes a weight's name."""

_DTYPE_NAMES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
    torch.complex64: "C64",
    torch.uint16: "U16",
    torch.uint32: "U32",
    torch.uint64: "U64",
}
"""safetensors' name of each torch dtype an offload file may hold."""


def residue(tensor: torch.Tensor) -> int:
    """Return how many bytes past a multiple of :data:`ALIGNMENT` ``tensor``'s data lies."""
    return tensor.data_ptr() % ALIGNMENT


def placed_after(end: int, wanted: int) -> int:
    """Return the first offset at or after ``end`` that lies ``wanted`` bytes past a boundary."""
    return end + (wanted - end) % ALIGNMENT


def placed_header(tensors: Mapping[str, torch.Tensor], residues: Mapping[str, int]) -> bytes:
    """Return the 8-byte length and the JSON header that lay ``tensors`` out in order.

    Each tensor's offset in the file (the 8 bytes, the header, then its data offset)
    lies ``residues[name]`` bytes past a multiple of :data:`ALIGNMENT`; a padding
    tensor fills each gap before one.

    Raises:
        ValueError: a tensor's dtype has no safetensors name.
    """
    entries: dict[str, Any] = {}
    end = 0
    for name, tensor in tensors.items():
        begin = placed_after(end, residues[name])
        if begin > end:
            entries[f"{PADDING}{end}"] = _entry("U8", [begin - end], end, begin)
        end = begin + tensor.numel() * tensor.element_size()
        entries[name] = _entry(_dtype_name(tensor.dtype), list(tensor.shape), begin, end)
    text = json.dumps(entries, separators=(",", ":")).encode()
    length = placed_after(8 + len(text), 0) - 8  # the data starts at a boundary
    return length.to_bytes(8, "little") + text.ljust(length, b" ")


def write_placed(
    tensors: Mapping[str, torch.Tensor], residues: Mapping[str, int], path: Path
) -> None:
    """Write the contiguous host ``tensors`` to ``path``, each at its residue (``placed_header``).

    Raises:
        ValueError: a tensor's dtype has no safetensors name; nothing was written.
        OSError: the file cannot be written.
    """
    header = placed_header(tensors, residues)
    with open(path, "wb") as file:
        file.write(header)
        for name, tensor in tensors.items():
            end = file.tell()
            file.write(bytes(placed_after(end, residues[name]) - end))  # a padding tensor
            if tensor.numel():
                file.write(tensor.reshape(-1).view(torch.uint8).numpy().data)


def _entry(dtype: str, shape: list[int], begin: int, end: int) -> dict[str, Any]:
    return {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}


def _dtype_name(dtype: torch.dtype) -> str:
    try:
        return _DTYPE_NAMES[dtype]
    except KeyError:
        raise ValueError(
            f"dtype {dtype} has no name in the safetensors format, so it cannot be offloaded "
            "to disk; offload the component to the host, or keep it resident"
        ) from None
