"""``flux_transformer``: diffusers' ``FluxTransformer2DModel``.

Two stacks run in turn, double-stream ``transformer_blocks`` (text and image tokens
apart, attending jointly) then single-stream ``single_transformer_blocks``; layerwise
offload streams the first then the second. The DiT reads latents packed two by two
(``in_channels`` is four times the VAE's latent channels) and CLIP's pooled vector.
The custom path (the default) is ``components.models.dit.flux``; ``loader = "native"``
builds diffusers' class.
"""

from __future__ import annotations

from typing import ClassVar

from components.batch import Port
from components.kinds.dit_loader import DitLoader
from components.models.dit.flux import FluxTransformer

__all__ = ["FluxTransformerLoader"]

PACKING = 4
"""Latent positions per token: 2 x 2 patches of the VAE's latents are packed into one."""


class FluxTransformerLoader(DitLoader):
    """Load ``FluxTransformer2DModel``: the denoiser, strict about global backends."""

    kind: ClassVar[str] = "flux_transformer"
    classes = ("FluxTransformer2DModel",)
    block_stack = ("transformer_blocks", "single_transformer_blocks")
    adapter_rows = True  # diffusers keeps the batch's rows first in every layer

    def block_count(self) -> int:
        """Return the blocks of both stacks (``num_layers + num_single_layers``)."""
        return int(self.config["num_layers"]) + int(self.config["num_single_layers"])

    def custom_module(self) -> FluxTransformer:
        """Build the project's Flux DiT on the ``self`` site."""
        return FluxTransformer(self.config, self.self_site())

    def reads(self) -> tuple[Port, ...]:
        """Read T5's context, CLIP's pooled vector, and unpacked latents."""
        return (
            Port(field="context", width=int(self.config["joint_attention_dim"])),
            Port(field="pooled", width=int(self.config["pooled_projection_dim"])),
            Port(field="latents", width=int(self.config["in_channels"]) // PACKING),
        )

    def writes(self) -> tuple[Port, ...]:
        """Write unpacked latents."""
        return (Port(field="latents", width=int(self.config["in_channels"]) // PACKING),)
