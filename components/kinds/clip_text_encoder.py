"""``clip_text_encoder``: transformers' ``CLIPTextModel`` or ``CLIPTextModelWithProjection``.

Flux uses the pooled output of a ``CLIPTextModel`` (the final normalised state of the
end token); SD3 uses two ``CLIPTextModelWithProjection``, each for its projected pooled
output and its penultimate layer's states. Prompts are padded to the tokenizer's length
(77): the attention is causal, so padding never changes the real tokens. The custom path
is our ``ClipTextTransformer``: one ``self`` site, ``causal``, and with
``packed_sequences`` also packed varlen, so that a pooled output alone is computed on
each prompt's own tokens, packed, with no padding at all.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import cached_property
from typing import ClassVar, NamedTuple

import torch
from torch import nn
from torch.nn.functional import pad

from attention import AttentionRequirements, AttentionRole
from components.batch import Port, device_of
from components.folders.custom import CustomFolderLoader
from components.folders.text import TextEncoderLoader, TextEncoderOptions
from components.models.clip_text import (
    ACTIVATIONS,
    ClipShape,
    ClipStates,
    ClipTextModel,
    ClipTextTransformer,
)
from components.sites import AttentionSite

__all__ = ["ClipTextEncoderLoader"]

# B texts, L tokens, E width, P pooled width, T packed tokens

OURS = (ClipTextModel, ClipTextTransformer)
"""The roots our custom path builds (with or without the ``text_model.`` prefix)."""
PREFIX = "text_model."
"""Where ``CLIPTextModelWithProjection`` (and transformers 4's ``CLIPTextModel``) keep the tower."""


class ClipOptions(TextEncoderOptions, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Options of a CLIP text encoder.

    Attributes:
        packed_sequences: the custom path computes a pooled output alone on each prompt's
            own tokens, packed into one varlen sequence (needs a packed-varlen backend);
            states for every padded position still run padded.
    """

    packed_sequences: bool = False


class ClipEncoding(NamedTuple):
    """What CLIP makes of a batch of texts."""

    pooled: torch.Tensor  # (B, P): pooler output, or its projection (text_embeds)
    penultimate: torch.Tensor  # (B, L, E): the states the last layer reads


class ClipTextEncoderLoader(CustomFolderLoader, TextEncoderLoader):
    """Load a CLIP text encoder; its layers (``text_model.encoder.layers``) stream."""

    kind: ClassVar[str] = "clip_text_encoder"
    library = "transformers"
    classes = ("CLIPTextModel", "CLIPTextModelWithProjection")
    block_stack = "text_model.encoder.layers"
    options_type = ClipOptions
    fully_shardable = True

    def __init__(self, options: ClipOptions) -> None:
        super().__init__(options)
        self.options: ClipOptions = options

    @property
    def has_projection(self) -> bool:
        """Whether the pooled output is projected (``CLIPTextModelWithProjection``)."""
        return self.class_name == "CLIPTextModelWithProjection"

    @cached_property
    def shape(self) -> ClipShape:
        """The text model's sizes, from ``config.json``."""
        return ClipShape.of(self.config)

    def sites(self) -> tuple[AttentionSite, ...]:
        """Declare ``self``: causal, and packed varlen under ``packed_sequences``."""
        requirements = AttentionRequirements(
            causal=True, packed_varlen=self.options.packed_sequences
        )
        return (
            AttentionSite(
                name="self",
                role=AttentionRole.SELF,
                heads=self.shape.heads,
                requirements=requirements,
            ),
        )

    def custom_problem(self) -> str | None:
        """Say which activation of the config our module lacks, if any."""
        if self.shape.activation in ACTIVATIONS:
            return None
        return (
            f"its activation '{self.shape.activation}' is not one of {', '.join(ACTIVATIONS)} "
            "(the custom path implements those)"
        )

    def custom_module(self) -> nn.Module:
        """Construct our text model on the ``self`` site, the way the files store it: the
        tower alone, or under ``text_model`` (with the projection of
        ``CLIPTextModelWithProjection``)."""
        (site,) = self.sites()
        if self.has_projection or any(key.startswith(PREFIX) for key in self.stored):
            projection = int(self.config["projection_dim"]) if self.has_projection else None
            return ClipTextModel(self.shape, projection, site)
        return ClipTextTransformer(self.shape, site)

    def blocks(self, module: nn.Module) -> nn.ModuleList | None:
        """Return the encoder's layers, inside ``text_model`` where the class keeps its tower.

        transformers 5 builds ``CLIPTextModel`` as the tower itself (``encoder.layers``)
        and ``CLIPTextModelWithProjection`` around one (``text_model.encoder.layers``); our
        module follows the files.
        """
        inside = PREFIX if hasattr(module, "text_model") else ""
        layers = module.get_submodule(f"{inside}encoder.layers")
        return layers if isinstance(layers, nn.ModuleList) else None

    def block_count(self) -> int:
        """Return the encoder's layers (``num_hidden_layers``)."""
        return int(self.config["num_hidden_layers"])

    def reads(self) -> tuple[Port, ...]:
        """Read the prompts."""
        return (Port(field="prompts"),)

    def writes(self) -> tuple[Port, ...]:
        """Write token states ``hidden_size`` wide, pooled ones ``projection_dim`` if projected."""
        hidden = int(self.config["hidden_size"])
        pooled = int(self.config["projection_dim"]) if self.has_projection else hidden
        return (Port(field="context", width=hidden), Port(field="pooled", width=pooled))

    @property
    def max_tokens(self) -> int:
        """The tokenizer's length: every prompt is padded (or truncated) to it."""
        return int(self.tokenizer.model_max_length)

    def encode(self, module: nn.Module, texts: Sequence[str]) -> ClipEncoding:
        """Encode ``texts`` padded to ``max_tokens``."""
        device = device_of(module)
        ids, _ = self.tokenize(texts, self.max_tokens)
        if isinstance(module, OURS):
            states: ClipStates = module(ids.to(device))
            return ClipEncoding(states.pooled, states.penultimate)
        out = module(ids.to(device), output_hidden_states=True)
        pooled = out.text_embeds if self.has_projection else out.pooler_output
        return ClipEncoding(pooled, out.hidden_states[-2])

    def pooled(self, module: nn.Module, texts: Sequence[str]) -> torch.Tensor:
        """Return the pooled output ``(B, P)`` of ``texts``.

        Under ``packed_sequences`` on the custom path the prompts run unpadded, packed:
        causal attention makes the end token's state independent of what follows it, so
        this equals the padded result.
        """
        if not (self.options.packed_sequences and isinstance(module, OURS)):
            return self.encode(module, texts).pooled
        device = device_of(module)
        ids, keep = self.tokenize(texts, self.max_tokens)
        lengths = keep.sum(-1)  # (B,)
        cu_seqlens = pad(lengths.cumsum(0), (1, 0)).to(torch.int32)
        states: ClipStates = module(ids[keep.bool()].to(device), cu_seqlens.to(device))  # (T,)
        return states.pooled
