"""The built-in backends, one module each, in the order ``registry.names()`` lists them."""

from __future__ import annotations

from attention.backend import AttentionBackend
from attention.backends.flash_attn import FlashAttnBackend
from attention.backends.reference import ReferenceBackend
from attention.backends.sliding_window import SlidingWindowBackend, SlidingWindowOptions
from attention.backends.torch_flash import TorchFlashBackend
from attention.backends.torch_sdpa import TorchSdpaBackend

BUILTIN_BACKENDS: tuple[type[AttentionBackend], ...] = (
    TorchSdpaBackend,
    TorchFlashBackend,
    ReferenceBackend,
    SlidingWindowBackend,
    FlashAttnBackend,
)

__all__ = [
    "BUILTIN_BACKENDS",
    "FlashAttnBackend",
    "ReferenceBackend",
    "SlidingWindowBackend",
    "SlidingWindowOptions",
    "TorchFlashBackend",
    "TorchSdpaBackend",
]
