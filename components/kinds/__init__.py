"""The reference component kinds; importing this package registers them."""

from __future__ import annotations

from components.kinds import (
    autoencoder_kl,
    clip_text_encoder,
    flux_transformer,
    minilm_text_encoder,
    pixart_transformer,
    sd3_transformer,
    t5_encoder,
    tiny_dit,
    tiny_text_encoder,
    tiny_upsampler,
    tiny_vae,
)

__all__ = [
    "autoencoder_kl",
    "clip_text_encoder",
    "flux_transformer",
    "minilm_text_encoder",
    "pixart_transformer",
    "sd3_transformer",
    "t5_encoder",
    "tiny_dit",
    "tiny_text_encoder",
    "tiny_upsampler",
    "tiny_vae",
]
