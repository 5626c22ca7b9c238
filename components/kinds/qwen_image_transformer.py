"""``qwen_image_transformer``: diffusers' ``QwenImageTransformer2DModel`` (Qwen-Image's MMDiT).

Text and image tokens run in two streams that attend jointly in its
``transformer_blocks``, which stream under layerwise offload. It reads the language
model's last hidden states (``joint_attention_dim`` wide, of any length, masked where
padded) and latents packed two by two into tokens. The custom path (the default) is
``components.models.dit.qwen_image``; ``loader = "native"`` builds diffusers' class.
"""

from __future__ import annotations

from typing import ClassVar

from components.batch import Port
from components.kinds.dit_loader import DitLoader
from components.models.dit.qwen_image import QwenImageTransformer, unsupported

__all__ = ["QwenImageTransformerLoader"]

PACKING = 4
"""Latent positions per token: 2 x 2 patches of the VAE's latents are packed into one."""


class QwenImageTransformerLoader(DitLoader):
    """Load ``QwenImageTransformer2DModel``: the denoiser, strict about global backends."""

    kind: ClassVar[str] = "qwen_image_transformer"
    classes = ("QwenImageTransformer2DModel",)
    block_stack = "transformer_blocks"

    def block_count(self) -> int:
        """Return the MMDiT's blocks (``num_layers``)."""
        return int(self.config["num_layers"])

    def custom_problem(self) -> str | None:
        """Name the edit models' flags, which the custom path does not build."""
        flags = unsupported(self.config)
        return None if flags is None else f"the custom Qwen-Image DiT does not build {flags}"

    def custom_module(self) -> QwenImageTransformer:
        """Build the project's Qwen-Image DiT on the ``self`` site."""
        return QwenImageTransformer(self.config, self.self_site())

    def reads(self) -> tuple[Port, ...]:
        """Read the text's hidden states and unpacked latents."""
        return (
            Port(field="context", width=int(self.config["joint_attention_dim"])),
            Port(field="latents", width=int(self.config["in_channels"]) // PACKING),
        )

    def writes(self) -> tuple[Port, ...]:
        """Write latents of ``out_channels``."""
        return (Port(field="latents", width=int(self.config["out_channels"])),)
