"""Where a component's weights live between uses."""

from __future__ import annotations

from enum import StrEnum
from typing import Literal, TypeAlias

__all__ = ["OffloadTarget", "OffloadVerify", "ResidencyMode"]


class ResidencyMode(StrEnum):
    """How a component is kept on the device.

    ``RESIDENT`` stays on the device; ``COMPONENT_OFFLOAD`` moves the whole
    component out between uses; ``LAYERWISE_OFFLOAD`` streams its blocks in
    just before they run and out after.
    """

    RESIDENT = "resident"
    COMPONENT_OFFLOAD = "component_offload"
    LAYERWISE_OFFLOAD = "layerwise_offload"


OffloadTarget: TypeAlias = Literal["host", "disk"]
"""Where offloaded weights go: host memory, or safetensors files on disk."""


OffloadVerify: TypeAlias = Literal["checksum", "stat"]
"""How a disk-offload file is verified at onload: a checksum of the data, once per
identity of the file, or only its size, mtime, ctime and inode."""
