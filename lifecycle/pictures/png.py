"""Images as PNG files, written with zlib and struct only (no imaging library needed)."""

from __future__ import annotations

import struct
import zlib
from pathlib import Path

import torch

__all__ = ["encode_png", "write_png"]

_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def encode_png(image: torch.Tensor) -> bytes:
    """Return ``image`` ``(3, H, W)`` with values in [-1, 1] as an 8-bit RGB PNG.

    Pixels are quantised as diffusers' image processor does (``(x / 2 + 0.5).clamp(0, 1)``
    times 255, rounded), so an image equal to a diffusers pipeline's has its very pixels.
    """
    channels, height, width = image.shape
    if channels != 3:
        raise ValueError(f"expected an RGB image (3, H, W), got shape {tuple(image.shape)}")
    pixels = ((image.detach().float().cpu() / 2 + 0.5).clamp(0, 1) * 255).round().to(torch.uint8)
    rows = pixels.permute(1, 2, 0).reshape(height, width * 3)  # (H, W*3), RGB interleaved
    # each scanline starts with its filter type; 0 = none
    raw = torch.cat([torch.zeros(height, 1, dtype=torch.uint8), rows], dim=1).numpy().tobytes()
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)  # 8-bit, truecolour
    return (
        _SIGNATURE
        + _chunk(b"IHDR", header)
        + _chunk(b"IDAT", zlib.compress(raw, 6))
        + _chunk(b"IEND", b"")
    )


def write_png(image: torch.Tensor, path: Path) -> Path:
    """Write ``image`` ``(3, H, W)`` in [-1, 1] to ``path`` as PNG and return the path."""
    path.write_bytes(encode_png(image))
    return path


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
