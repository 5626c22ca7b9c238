"""``pixart_transformer``: diffusers' ``PixArtTransformer2DModel`` (PixArt-alpha and -sigma).

A DiT with cross-attention to T5's token states; its ``transformer_blocks`` stream
under layerwise offload. Its output may carry a learned variance beside the noise
(``out_channels`` twice the latent channels), which the recipe drops.
"""

from __future__ import annotations

from typing import ClassVar

from components.batch import Port
from components.folders.loader import FolderLoader


class PixArtTransformerLoader(FolderLoader):
    """Load ``PixArtTransformer2DModel``: the denoiser, strict about global backends."""

    kind: ClassVar[str] = "pixart_transformer"
    library = "diffusers"
    classes = ("PixArtTransformer2DModel",)
    block_stack = "transformer_blocks"
    adapter_rows = True  # diffusers keeps the batch's rows first in every layer

    def block_count(self) -> int:
        """Return the DiT's blocks (``num_layers``)."""
        return int(self.config["num_layers"])

    def reads(self) -> tuple[Port, ...]:
        """Read T5's context, ``caption_channels`` wide, and latents of ``in_channels``."""
        return (
            Port(field="context", width=int(self.config["caption_channels"])),
            Port(field="latents", width=int(self.config["in_channels"])),
        )

    def writes(self) -> tuple[Port, ...]:
        """Write latents of ``in_channels``."""
        return (Port(field="latents", width=int(self.config["in_channels"])),)
