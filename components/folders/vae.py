"""``VaeLoader``: the kinds of a folder's VAE, which decode a recipe's latents into images."""

from __future__ import annotations

from abc import abstractmethod

import torch
from torch import nn

from components.batch import RGB, Port
from components.folders.loader import FolderLoader

__all__ = ["VaeLoader"]

# B images, C latent channels, h w latent grid, H W image size


class VaeLoader(FolderLoader):
    """A folder component that decodes latents ``(B, C, h, w)`` into images.

    Subclasses say how their module decodes; how many pixels a latent spans
    (``scale_factor``) and how many channels they read (``latent_channels``) are read from
    the config as diffusers' ``AutoencoderKL`` family writes it, unless a subclass whose
    config says them otherwise overrides them.
    """

    library = "diffusers"
    allows_global_fallback = True  # an auxiliary component (design §4.2)

    @property
    def scale_factor(self) -> int:
        """Image pixels per latent position along each side: 2 per block after the first."""
        return int(2 ** (len(self.config["block_out_channels"]) - 1))

    @property
    def latent_channels(self) -> int:
        """C: ``latent_channels``."""
        return int(self.config["latent_channels"])

    @abstractmethod
    def decode(self, module: nn.Module, latents: torch.Tensor) -> torch.Tensor:
        """Decode latents ``(B, C, h, w)`` (unscaled) into images ``(B, 3, H, W)`` in [-1, 1]."""

    def reads(self) -> tuple[Port, ...]:
        """Read latents of ``latent_channels``."""
        return (Port(field="latents", width=self.latent_channels),)

    def writes(self) -> tuple[Port, ...]:
        """Write RGB images."""
        return (Port(field="images", width=RGB),)
