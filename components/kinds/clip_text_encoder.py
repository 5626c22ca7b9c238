"""``clip_text_encoder``: transformers' ``CLIPTextModel`` or ``CLIPTextModelWithProjection``.

Flux uses the pooled output of a ``CLIPTextModel`` (the final normalised state of the
end token); SD3 uses two ``CLIPTextModelWithProjection``, each for its projected pooled
output and its penultimate layer's states. Prompts are padded to the tokenizer's length
(77): the attention is causal, so padding never changes the real tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar, NamedTuple

import torch
from torch import nn

from components.batch import Port, device_of
from components.folders.text import TextEncoderLoader

# B texts, L tokens, E width, P pooled width


class ClipEncoding(NamedTuple):
    """What CLIP makes of a batch of texts."""

    pooled: torch.Tensor  # (B, P): pooler output, or its projection (text_embeds)
    penultimate: torch.Tensor  # (B, L, E): the states the last layer reads


class ClipTextEncoderLoader(TextEncoderLoader):
    """Load a CLIP text encoder; its layers (``text_model.encoder.layers``) stream."""

    kind: ClassVar[str] = "clip_text_encoder"
    library = "transformers"
    classes = ("CLIPTextModel", "CLIPTextModelWithProjection")
    block_stack = "text_model.encoder.layers"

    @property
    def has_projection(self) -> bool:
        """Whether the pooled output is projected (``CLIPTextModelWithProjection``)."""
        return self.class_name == "CLIPTextModelWithProjection"

    def blocks(self, module: nn.Module) -> nn.ModuleList | None:
        """Return the encoder's layers, inside ``text_model`` where the class keeps its tower.

        transformers 5 builds ``CLIPTextModel`` as the tower itself (``encoder.layers``)
        and ``CLIPTextModelWithProjection`` around one (``text_model.encoder.layers``).
        """
        inside = "text_model." if hasattr(module, "text_model") else ""
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
        out = module(ids.to(device), output_hidden_states=True)
        pooled = out.text_embeds if self.has_projection else out.pooler_output
        return ClipEncoding(pooled, out.hidden_states[-2])
