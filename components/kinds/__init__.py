"""The reference component kinds, one module each, in the order ``registry.names()`` lists them."""

from __future__ import annotations

from components.kinds.minilm_text_encoder import MiniLmLoader
from components.kinds.tiny_dit import TinyDitLoader
from components.kinds.tiny_text_encoder import TinyTextEncoderLoader
from components.kinds.tiny_upsampler import TinyUpsamplerLoader
from components.kinds.tiny_vae import TinyVaeLoader
from components.loader import ComponentLoader

BUILTIN_KINDS: tuple[type[ComponentLoader], ...] = (
    TinyTextEncoderLoader,
    TinyDitLoader,
    TinyVaeLoader,
    TinyUpsamplerLoader,
    MiniLmLoader,
)

__all__ = [
    "BUILTIN_KINDS",
    "MiniLmLoader",
    "TinyDitLoader",
    "TinyTextEncoderLoader",
    "TinyUpsamplerLoader",
    "TinyVaeLoader",
]
