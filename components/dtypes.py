"""The dtypes a component's floating weights may be built in."""

from __future__ import annotations

from typing import Literal, TypeAlias

import torch

__all__ = ["TORCH_DTYPES", "DType"]

DType: TypeAlias = Literal["float32", "bfloat16", "float16"]
"""A floating dtype a spec may ask for, pipeline-wide or per component."""

TORCH_DTYPES: dict[DType, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
"""Each spec dtype's torch dtype."""
