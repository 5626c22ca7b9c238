"""``z_image_transformer``: diffusers' ``ZImageTransformer2DModel`` (Z-Image's single-stream DiT).

Image tokens pass its ``noise_refiner`` blocks and text tokens its ``context_refiner``
blocks, then both run as one sequence through its main ``layers``: the three stacks
stream in that order under layerwise offload. It takes each request's latents and text
(of any length) as lists, one tensor per image. The custom path (the default) is
``components.models.dit.z_image``; ``loader = "native"`` builds diffusers' class.
"""

from __future__ import annotations

from typing import ClassVar

from components.batch import Port
from components.kinds.dit_loader import DitLoader
from components.models.dit.z_image import ZImageTransformer, unsupported

__all__ = ["ZImageTransformerLoader"]


class ZImageTransformerLoader(DitLoader):
    """Load ``ZImageTransformer2DModel``: the denoiser, strict about global backends."""

    kind: ClassVar[str] = "z_image_transformer"
    classes = ("ZImageTransformer2DModel",)
    block_stack = ("noise_refiner", "context_refiner", "layers")

    @property
    def heads(self) -> int:
        """Return the attention heads of every block (``n_heads``)."""
        return int(self.config["n_heads"])

    def block_count(self) -> int:
        """Return the blocks of the three stacks (two refiners, then the main layers)."""
        return 2 * int(self.config["n_refiner_layers"]) + int(self.config["n_layers"])

    def custom_problem(self) -> str | None:
        """Name what of the config the custom path does not build (Omni, other patches)."""
        problem = unsupported(self.config)
        return None if problem is None else f"the custom Z-Image DiT does not build {problem}"

    def custom_module(self) -> ZImageTransformer:
        """Build the project's Z-Image DiT on the ``self`` site."""
        return ZImageTransformer(self.config, self.self_site())

    def reads(self) -> tuple[Port, ...]:
        """Read the text's hidden states and the latents."""
        return (
            Port(field="context", width=int(self.config["cap_feat_dim"])),
            Port(field="latents", width=int(self.config["in_channels"])),
        )

    def writes(self) -> tuple[Port, ...]:
        """Write latents of ``in_channels`` (it predicts as many as it reads)."""
        return (Port(field="latents", width=int(self.config["in_channels"])),)
