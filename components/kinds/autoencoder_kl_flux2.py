"""``autoencoder_kl_flux2``: diffusers' ``AutoencoderKLFlux2``, Flux.2's VAE.

Flux.2's DiT works on latents patchified two by two and normalised by the VAE's batch
norm statistics (``bn.running_mean``, ``bn.running_var``, stored with its weights); the
recipe undoes both before decoding. It has no block stack: component offload only.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import nn

from components.folders.vae import VaeLoader

__all__ = ["AutoencoderKlFlux2Loader"]

# B images, C latent channels, h w latent grid


class AutoencoderKlFlux2Loader(VaeLoader):
    """Load ``AutoencoderKLFlux2`` (native path)."""

    kind: ClassVar[str] = "autoencoder_kl_flux2"
    classes = ("AutoencoderKLFlux2",)

    def denormalize(self, module: nn.Module, patches: torch.Tensor) -> torch.Tensor:
        """Undo the batch norm of patchified latents ``(B, 4C, h/2, w/2)``, as Flux.2 does."""
        native: Any = module
        mean = native.bn.running_mean.view(1, -1, 1, 1).to(patches.device, patches.dtype)
        eps = float(self.config.get("batch_norm_eps", 1e-4))
        std = torch.sqrt(native.bn.running_var.view(1, -1, 1, 1) + eps)
        denormalized: torch.Tensor = patches * std.to(patches.device, patches.dtype) + mean
        return denormalized

    def decode(self, module: nn.Module, latents: torch.Tensor) -> torch.Tensor:
        """Decode latents ``(B, C, h, w)`` into images ``(B, 3, H, W)`` in [-1, 1]."""
        native: Any = module
        images: torch.Tensor = native.decode(latents, return_dict=False)[0]
        return images
