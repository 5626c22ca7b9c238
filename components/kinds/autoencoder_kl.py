"""``autoencoder_kl``: diffusers' ``AutoencoderKL``, which decodes latents into images.

It has no block stack, so it cannot be offloaded layer by layer (``residency =
"layerwise_offload"`` is refused; component offload works). The whole model is
loaded, encoder included, as diffusers loads it: its file holds both halves. The custom
path is our ``AutoencoderKl``, whose mid blocks attend over the latent grid (site
``mid``, a self-attention).
"""

from __future__ import annotations

from functools import cached_property
from typing import Any, ClassVar

import torch
from torch import nn

from attention import AttentionRole
from components.folders.custom import CustomFolderLoader
from components.folders.vae import VaeLoader
from components.models.autoencoder_kl import AutoencoderKl, VaeShape, unsupported
from components.sites import AttentionSite

__all__ = ["AutoencoderKlLoader"]

# B images, L latent channels, h w latent grid, H W image size


class AutoencoderKlLoader(CustomFolderLoader, VaeLoader):
    """Load ``AutoencoderKL``; an auxiliary component, so global fallback is allowed."""

    kind: ClassVar[str] = "autoencoder_kl"
    classes = ("AutoencoderKL",)
    fully_shardable = True

    @cached_property
    def shape(self) -> VaeShape:
        """The VAE's sizes, from ``config.json``."""
        return VaeShape.of(self.config)

    def sites(self) -> tuple[AttentionSite, ...]:
        """Declare ``mid``: the single-head self-attention of both mid blocks (if any)."""
        if not self.shape.attention:
            return ()
        return (AttentionSite(name="mid", role=AttentionRole.SELF, heads=1),)

    def custom_problem(self) -> str | None:
        """Say which block type or activation of the config our module lacks, if any."""
        return unsupported(self.config)

    def custom_module(self) -> AutoencoderKl:
        """Construct our VAE on the ``mid`` site, if its config adds attention."""
        sites = self.sites()
        return AutoencoderKl(self.shape, sites[0] if sites else None)

    def decode(self, module: nn.Module, latents: torch.Tensor) -> torch.Tensor:
        """Decode latents ``(B, L, h, w)`` (unscaled) into images ``(B, 3, H, W)`` in [-1, 1]."""
        if isinstance(module, AutoencoderKl):
            decoded: torch.Tensor = module(latents)  # through forward, where FSDP gathers
            return decoded
        native: Any = module
        images: torch.Tensor = native.decode(latents, return_dict=False)[0]
        return images
