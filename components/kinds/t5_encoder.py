"""``t5_encoder``: transformers' ``T5EncoderModel`` from a pipeline folder (PixArt, Flux, SD3).

Its tokenizer closes each prompt with ``</s>`` and pads it to the pipeline's fixed
length; PixArt masks the padding, Flux and SD3 let every token attend to it (so the
embeddings depend on that length, and a recipe always pads to it). The custom path is
our ``T5Encoder``: one ``self`` site that adds T5's relative position bias to the scores
(``additive_bias``), split by heads under tensor parallel.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import cached_property
from typing import Any, ClassVar, NamedTuple

import torch
from torch import nn

from attention import AttentionRequirements, AttentionRole
from components.batch import Port, device_of
from components.folders.custom import CustomFolderLoader
from components.folders.text import TextEncoderLoader
from components.mesh import ComponentParallel
from components.models.t5 import ACTIVATIONS, T5Encoder, T5Shape
from components.sites import AttentionSite

__all__ = ["T5EncoderLoader", "T5Ports"]

# B texts, L tokens, E width

BIASED = AttentionRequirements(additive_bias=True)


class T5Encoding(NamedTuple):
    """What T5 makes of a batch of texts."""

    hidden: torch.Tensor  # (B, L, E), the last layer's normalised output
    mask: torch.Tensor  # (B, L) int64, 1 = real token


class T5Ports:
    """The blocks and ports of a T5-family encoder's config (T5, UMT5): prompts in, the
    token context ``d_model`` wide out."""

    config: dict[str, Any]

    def block_count(self) -> int:
        """Return the encoder's layers (``num_layers``)."""
        return int(self.config["num_layers"])

    def reads(self) -> tuple[Port, ...]:
        """Read the prompts."""
        return (Port(field="prompts"),)

    def writes(self) -> tuple[Port, ...]:
        """Write the token context, ``d_model`` wide."""
        return (Port(field="context", width=int(self.config["d_model"])),)


class T5EncoderLoader(T5Ports, CustomFolderLoader, TextEncoderLoader):
    """Load ``T5EncoderModel``; its blocks (``encoder.block``) stream under layerwise offload."""

    kind: ClassVar[str] = "t5_encoder"
    library = "transformers"
    classes = ("T5EncoderModel",)
    block_stack = "encoder.block"
    tensor_parallel = True
    fully_shardable = True
    float16_keeps_float32 = ("wo",)

    @cached_property
    def shape(self) -> T5Shape:
        """The encoder's sizes, from ``config.json``."""
        return T5Shape.of(self.config)

    def sites(self) -> tuple[AttentionSite, ...]:
        """Declare ``self``: every block's attention, which adds the position bias."""
        return (
            AttentionSite(
                name="self", role=AttentionRole.SELF, heads=self.shape.heads, requirements=BIASED
            ),
        )

    def custom_problem(self) -> str | None:
        """Say which feed-forward activation of the config our module lacks, if any."""
        if self.shape.activation in ACTIVATIONS:
            return None
        return (
            f"its feed-forward activation '{self.shape.activation}' is not one of "
            f"{', '.join(ACTIVATIONS)} (the custom path implements those)"
        )

    def custom_module(self) -> T5Encoder:
        """Construct our encoder on the ``self`` site."""
        (site,) = self.sites()
        return T5Encoder(self.shape, site)

    def parallelize(self, module: nn.Module, parallel: ComponentParallel) -> None:
        """Split the heads and feed-forward units over the ``tp`` ranks."""
        assert isinstance(module, T5Encoder)
        assert parallel.tensor is not None  # build() calls this for a tensor split only
        module.parallelize(parallel.tensor)

    def encode(
        self, module: nn.Module, texts: Sequence[str], length: int, *, masked: bool
    ) -> T5Encoding:
        """Encode ``texts`` padded to ``length`` tokens; ``masked``: padding is not attended to."""
        device = device_of(module)
        ids, mask = self.tokenize(texts, length)
        keep = mask.to(device) if masked else None
        if isinstance(module, T5Encoder):
            return T5Encoding(module(ids.to(device), keep), mask)
        return T5Encoding(module(ids.to(device), attention_mask=keep)[0], mask)
