"""``umt5_encoder``: transformers' ``UMT5EncoderModel``, Wan's text encoder.

UMT5 is T5 with a relative position bias of its own in every layer (T5 shares the first
layer's). Wan pads each prompt to 512 tokens, encodes it with the padding masked, then
zeroes the states past the prompt's own tokens; its DiT attends to all 512.

A real token's states do not depend on how much masked padding follows it: the encoder's
position bias is a function of the distance between two tokens alone (bidirectional
buckets, whatever the length), and a masked key's weight is an exact zero after softmax.
So a batch is encoded only up to its longest prompt, rounded up to ``LANES`` tokens, and
its states padded with zeros to 512: a typical prompt of 10-40 tokens costs 16-48 tokens
of encoder work instead of 512.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

import torch
from torch import nn
from torch.nn import functional

from components.batch import device_of
from components.folders.text import TextEncoderLoader
from components.kinds.t5_encoder import T5Ports

__all__ = ["Umt5EncoderLoader"]

# B texts, L tokens, E width

LANES = 16
"""Encoded lengths are multiples of this. CPU kernels sum a row of attention weights in
vectors of 16 floats (AVX-512; two vectors of AVX2's 8): on a multiple of 16 the real
tokens' terms fall in the same lanes as on 512 tokens, and the masked ones add exact
zeros, so in float32 the states equal the 512-token path's to the bit where the matmuls
split their work alike (always on one thread); a shorter tail would sum in another order
(about 1e-6 apart), which a denoising loop amplifies past diffusers' frames' 1e-5."""


class Umt5EncoderLoader(T5Ports, TextEncoderLoader):
    """Load ``UMT5EncoderModel`` (native); its blocks (``encoder.block``) stream."""

    kind: ClassVar[str] = "umt5_encoder"
    library = "transformers"
    classes = ("UMT5EncoderModel",)
    block_stack = "encoder.block"

    def encode(self, module: nn.Module, texts: Sequence[str], length: int) -> torch.Tensor:
        """Return the states ``(B, L, E)`` of ``texts`` padded to ``length`` tokens, the padding
        masked and its states zeroed (as diffusers' Wan pipelines hand them to the DiT);
        encoded up to the longest of them (rounded up to ``LANES``), the rest zeros."""
        device = device_of(module)
        ids, mask = self.tokenize(texts, length, longest=True)
        encoded = min(length, -(-ids.shape[1] // LANES) * LANES)
        # the ids of masked tokens never reach the output: their keys are masked, their
        # states zeroed
        ids = functional.pad(ids, (0, encoded - ids.shape[1]))
        mask = functional.pad(mask, (0, encoded - mask.shape[1])).to(device)
        hidden: torch.Tensor = module(ids.to(device), mask).last_hidden_state
        zeroed = hidden * mask[..., None].to(hidden.dtype)
        return functional.pad(zeroed, (0, 0, 0, length - encoded))
