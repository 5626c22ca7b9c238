"""``pixart_transformer``: diffusers' ``PixArtTransformer2DModel`` (PixArt-alpha and -sigma).

A DiT with cross-attention to T5's token states; its ``transformer_blocks`` stream
under layerwise offload. Its output may carry a learned variance beside the noise
(``out_channels`` twice the latent channels), which the recipe drops. The custom path
(the default) is ``components.models.dit.pixart``; ``loader = "native"`` builds
diffusers' class.
"""

from __future__ import annotations

from typing import ClassVar

from attention import AttentionRole
from components.batch import Port
from components.kinds.dit_loader import DitLoader
from components.models.dit.pixart import PixArtTransformer
from components.sites import AttentionSite

__all__ = ["PixArtTransformerLoader"]

BUILT_NORM = "ada_norm_single"
"""The only block norm diffusers' PixArt class builds (and so the custom path)."""


class PixArtTransformerLoader(DitLoader):
    """Load ``PixArtTransformer2DModel``: the denoiser, strict about global backends."""

    kind: ClassVar[str] = "pixart_transformer"
    classes = ("PixArtTransformer2DModel",)
    block_stack = "transformer_blocks"
    adapter_rows = True  # diffusers keeps the batch's rows first in every layer

    def block_count(self) -> int:
        """Return the DiT's blocks (``num_layers``)."""
        return int(self.config["num_layers"])

    def sites(self) -> tuple[AttentionSite, ...]:
        """Declare ``self`` (image tokens, packed) and ``cross`` (to the request's text)."""
        cross = AttentionSite(name="cross", role=AttentionRole.CROSS, heads=self.heads)
        return (self.self_site(), cross)

    def custom_problem(self) -> str | None:
        """Say which block options of ``config`` the custom path does not build."""
        config = self.config
        built = {
            "norm_type": BUILT_NORM,
            "norm_elementwise_affine": False,
            "attention_type": "default",
            "activation_fn": "gelu-approximate",
            "attention_bias": True,
        }
        asked = {key: config.get(key, value) for key, value in built.items()}
        different = [
            f"{key} = {asked[key]!r}" for key, value in built.items() if asked[key] != value
        ]
        if not different:
            return None
        return f"its custom path builds PixArt blocks without {', '.join(different)}"

    def custom_module(self) -> PixArtTransformer:
        """Build the project's PixArt DiT on the ``self`` and ``cross`` sites."""
        return PixArtTransformer(self.config, self.sites())

    def reads(self) -> tuple[Port, ...]:
        """Read T5's context, ``caption_channels`` wide, and latents of ``in_channels``."""
        return (
            Port(field="context", width=int(self.config["caption_channels"])),
            Port(field="latents", width=int(self.config["in_channels"])),
        )

    def writes(self) -> tuple[Port, ...]:
        """Write latents of ``in_channels``."""
        return (Port(field="latents", width=int(self.config["in_channels"])),)
