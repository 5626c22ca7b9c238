"""What a pipeline asks of the folder kinds with a custom path, on fixed inputs."""

from __future__ import annotations

import torch
from torch import nn

from components.folders.custom import CustomFolderLoader
from components.kinds.autoencoder_kl import AutoencoderKlLoader
from components.kinds.clip_text_encoder import ClipTextEncoderLoader
from components.kinds.t5_encoder import T5EncoderLoader

TEXTS = ["a red fox leaps over the snow at dawn", "ramen", ""]
T5_LENGTH = 16


def outputs(loader: CustomFolderLoader, module: nn.Module) -> list[torch.Tensor]:
    """Run what a pipeline asks of the kind, on fixed inputs; return every output."""
    if isinstance(loader, T5EncoderLoader):
        return [
            loader.encode(module, TEXTS, T5_LENGTH, masked=masked).hidden
            for masked in (True, False)
        ]
    if isinstance(loader, ClipTextEncoderLoader):
        return list(loader.encode(module, TEXTS))
    assert isinstance(loader, AutoencoderKlLoader)
    draw = torch.Generator().manual_seed(3)
    latents = torch.randn(2, loader.shape.latent_channels, 8, 6, generator=draw)
    return [loader.decode(module, latents.to(loader.dtype))]
