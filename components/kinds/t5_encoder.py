"""``t5_encoder``: transformers' ``T5EncoderModel`` from a pipeline folder (PixArt, Flux, SD3).

Its tokenizer closes each prompt with ``</s>`` and pads it to the pipeline's fixed
length; PixArt masks the padding, Flux and SD3 let every token attend to it (so the
embeddings depend on that length, and a recipe always pads to it).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar, NamedTuple

import torch
from torch import nn

from components.batch import Port, device_of
from components.folders.text import TextEncoderLoader

# B texts, L tokens, E width


class T5Encoding(NamedTuple):
    """What T5 makes of a batch of texts."""

    hidden: torch.Tensor  # (B, L, E), the last layer's normalised output
    mask: torch.Tensor  # (B, L) int64, 1 = real token


class T5EncoderLoader(TextEncoderLoader):
    """Load ``T5EncoderModel``; its blocks (``encoder.block``) stream under layerwise offload."""

    kind: ClassVar[str] = "t5_encoder"
    library = "transformers"
    classes = ("T5EncoderModel",)
    block_stack = "encoder.block"

    def block_count(self) -> int:
        """Return the encoder's layers (``num_layers``)."""
        return int(self.config["num_layers"])

    def reads(self) -> tuple[Port, ...]:
        """Read the prompts."""
        return (Port(field="prompts"),)

    def writes(self) -> tuple[Port, ...]:
        """Write the token context, ``d_model`` wide."""
        return (Port(field="context", width=int(self.config["d_model"])),)

    def encode(
        self, module: nn.Module, texts: Sequence[str], length: int, *, masked: bool
    ) -> T5Encoding:
        """Encode ``texts`` padded to ``length`` tokens; ``masked``: padding is not attended to."""
        device = device_of(module)
        ids, mask = self.tokenize(texts, length)
        out = module(ids.to(device), attention_mask=mask.to(device) if masked else None)
        return T5Encoding(out[0], mask)
