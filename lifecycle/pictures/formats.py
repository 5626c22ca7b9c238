"""The file formats pictures are written in, as the command line names them; no torch.

``lifecycle diagram --help`` and ``lifecycle run --help`` list these choices without
importing torch or the house.
"""

from __future__ import annotations

from typing import Literal, get_args

__all__ = ["DIAGRAM_FORMATS", "VIDEO_FORMATS", "VideoFormat"]

VideoFormat = Literal["mp4", "webp", "png"]
VIDEO_FORMATS: tuple[VideoFormat, ...] = get_args(VideoFormat)

DIAGRAM_FORMATS: dict[str, tuple[str, ...]] = {
    "mermaid": (".mmd",),
    "dot": (".dot",),
    "svg": (".svg",),
    "all": (".mmd", ".dot", ".svg", ".md"),
}
"""What ``lifecycle diagram --format`` writes: the file endings of each choice."""
