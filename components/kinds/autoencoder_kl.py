"""``autoencoder_kl``: diffusers' ``AutoencoderKL``, which decodes latents into images.

It has no block stack, so it cannot be offloaded layer by layer (``residency =
"layerwise_offload"`` is refused; component offload works). The whole model is
loaded, encoder included, as diffusers loads it: its file holds both halves.
"""

from __future__ import annotations

from typing import ClassVar

from components.batch import RGB, Port
from components.folders.loader import FolderLoader


class AutoencoderKlLoader(FolderLoader):
    """Load ``AutoencoderKL``; an auxiliary component, so global fallback is allowed."""

    kind: ClassVar[str] = "autoencoder_kl"
    library = "diffusers"
    classes = ("AutoencoderKL",)
    allows_global_fallback = True

    @property
    def scale_factor(self) -> int:
        """Image pixels per latent position along each side: 2 per block after the first."""
        return int(2 ** (len(self.config["block_out_channels"]) - 1))

    def reads(self) -> tuple[Port, ...]:
        """Read latents of ``latent_channels``."""
        return (Port(field="latents", width=int(self.config["latent_channels"])),)

    def writes(self) -> tuple[Port, ...]:
        """Write RGB images."""
        return (Port(field="images", width=RGB),)
