"""``sd3_transformer``: diffusers' ``SD3Transformer2DModel`` (the MMDiT of Stable Diffusion 3).

Text and image tokens attend jointly in its ``transformer_blocks``, which stream under
layerwise offload. It reads the text of both CLIP encoders and T5, joined along the
sequence, and the two CLIP pooled vectors side by side.
"""

from __future__ import annotations

from typing import ClassVar

from components.batch import Port
from components.folders.loader import FolderLoader


class Sd3TransformerLoader(FolderLoader):
    """Load ``SD3Transformer2DModel``: the denoiser, strict about global backends."""

    kind: ClassVar[str] = "sd3_transformer"
    library = "diffusers"
    classes = ("SD3Transformer2DModel",)
    block_stack = "transformer_blocks"

    def block_count(self) -> int:
        """Return the MMDiT's blocks (``num_layers``)."""
        return int(self.config["num_layers"])

    def reads(self) -> tuple[Port, ...]:
        """Read the joined text context, the joined pooled vectors and the latents."""
        return (
            Port(field="context", width=int(self.config["joint_attention_dim"])),
            Port(field="pooled", width=int(self.config["pooled_projection_dim"])),
            Port(field="latents", width=int(self.config["in_channels"])),
        )

    def writes(self) -> tuple[Port, ...]:
        """Write latents of ``out_channels``."""
        return (Port(field="latents", width=int(self.config["out_channels"])),)
