"""``umt5_encoder``: transformers' ``UMT5EncoderModel``, Wan's text encoder.

UMT5 is T5 with a relative position bias of its own in every layer (T5 shares the first
layer's). Wan pads each prompt to 512 tokens, encodes it with the padding masked, then
zeroes the states past the prompt's own tokens; its DiT attends to all 512.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

import torch
from torch import nn

from components.batch import device_of
from components.folders.text import TextEncoderLoader
from components.kinds.t5_encoder import T5Ports

__all__ = ["Umt5EncoderLoader"]

# B texts, L tokens, E width


class Umt5EncoderLoader(T5Ports, TextEncoderLoader):
    """Load ``UMT5EncoderModel`` (native); its blocks (``encoder.block``) stream."""

    kind: ClassVar[str] = "umt5_encoder"
    library = "transformers"
    classes = ("UMT5EncoderModel",)
    block_stack = "encoder.block"

    def encode(self, module: nn.Module, texts: Sequence[str], length: int) -> torch.Tensor:
        """Return the states ``(B, L, E)`` of ``texts`` padded to ``length`` tokens, the padding
        masked and its states zeroed (as diffusers' Wan pipelines hand them to the DiT)."""
        device = device_of(module)
        ids, mask = self.tokenize(texts, length)
        hidden: torch.Tensor = module(ids.to(device), mask.to(device)).last_hidden_state
        return hidden * mask.to(device)[..., None].to(hidden.dtype)
