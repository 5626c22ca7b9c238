"""The reference component kinds; importing this package registers them."""

from __future__ import annotations

from components.kinds import (
    minilm_text_encoder,
    tiny_dit,
    tiny_text_encoder,
    tiny_upsampler,
    tiny_vae,
)

__all__ = ["minilm_text_encoder", "tiny_dit", "tiny_text_encoder", "tiny_upsampler", "tiny_vae"]
