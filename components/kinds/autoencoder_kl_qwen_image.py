"""``autoencoder_kl_qwen_image``: diffusers' ``AutoencoderKLQwenImage``, Qwen-Image's VAE.

A causal video VAE (Wan's design) that Qwen-Image runs on one frame: latents gain a frame
axis of one before decoding, and the image loses it after. Its ``latents_mean`` and
``latents_std`` undo the normalisation the DiT's latents live in (the recipe applies
them). It has no block stack: component offload only.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import nn

from components.folders.vae import VaeLoader

__all__ = ["AutoencoderKlQwenImageLoader"]

# B images, C latent channels, h w latent grid


class AutoencoderKlQwenImageLoader(VaeLoader):
    """Load ``AutoencoderKLQwenImage`` (native path)."""

    kind: ClassVar[str] = "autoencoder_kl_qwen_image"
    classes = ("AutoencoderKLQwenImage",)

    @property
    def scale_factor(self) -> int:
        """Image pixels per latent: 2 per temporal stage (each halves the sides too)."""
        return int(2 ** len(self.config["temperal_downsample"]))

    @property
    def latent_channels(self) -> int:
        """C: ``z_dim``."""
        return int(self.config["z_dim"])

    def decode(self, module: nn.Module, latents: torch.Tensor) -> torch.Tensor:
        """Decode one frame of latents ``(B, C, h, w)`` into images ``(B, 3, H, W)``."""
        native: Any = module
        frames: torch.Tensor = native.decode(latents[:, :, None], return_dict=False)[0]
        return frames[:, :, 0]
