"""Images as PNG bytes, with zlib and struct only (``b64_json`` responses).

The CLI's ``run --out`` may bring its own encoder to ``lifecycle/``; the worker
then should use that one instead of this.
"""

from __future__ import annotations

import struct
import zlib

import torch

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def png_bytes(image: torch.Tensor) -> bytes:
    """Encode ``image`` ``(3, H, W)``, values in [-1, 1], as an 8-bit RGB PNG.

    Raises:
        ValueError: the image is not ``(3, H, W)``.
    """
    if image.dim() != 3 or image.shape[0] != 3:
        raise ValueError(f"expected an RGB image (3, H, W), got shape {tuple(image.shape)}")
    _, height, width = image.shape
    pixels = ((image.float().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)  # (3, H, W)
    rows = pixels.permute(1, 2, 0).reshape(height, width * 3)  # (H, 3W), RGB interleaved
    scanlines = torch.cat([torch.zeros(height, 1, dtype=torch.uint8), rows], dim=1)  # filter 0
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)  # 8-bit truecolour
    return b"".join(
        (
            PNG_SIGNATURE,
            _chunk(b"IHDR", header),
            _chunk(b"IDAT", zlib.compress(scanlines.numpy().tobytes())),
            _chunk(b"IEND", b""),
        )
    )


def _chunk(tag: bytes, data: bytes) -> bytes:
    crc = zlib.crc32(tag + data)
    return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", crc)
