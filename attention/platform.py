"""Say which device a process runs on, which backends run there and which it prefers."""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

import torch

from attention import registry
from attention.backend import DeviceKind

__all__ = ["Platform"]

# The order a fallback tries dense built-in backends in, best first (design §4.2).
_PREFERENCE: dict[DeviceKind, tuple[str, ...]] = {
    "cpu": ("torch_sdpa", "torch_flash"),
    "cuda": ("flash_attn", "torch_flash", "torch_sdpa"),
}


class Platform:
    """Describe a device kind and the attention backends it can run.

    Build one explicitly (``Platform("cpu")``) to make selection reproducible, or call
    ``Platform.detect()``. Availability is asked of each backend (``unavailable_reason``);
    ``unavailable`` adds reasons of the caller's own (an operator ban, a test).

    Args:
        kind: ``"cpu"`` or ``"cuda"``.
        unavailable: backend name -> why it may not run here, on top of the backends' own.
    """

    __slots__ = ("_unavailable", "kind", "preference")

    def __init__(self, kind: DeviceKind, *, unavailable: Mapping[str, str] | None = None) -> None:
        if kind not in _PREFERENCE:
            raise ValueError(f"platform kind must be one of {', '.join(_PREFERENCE)}, got {kind!r}")
        self.kind: DeviceKind = kind
        self.preference: tuple[str, ...] = _PREFERENCE[kind]
        self._unavailable = MappingProxyType(dict(unavailable or {}))

    @classmethod
    def detect(cls) -> Platform:
        """Return the platform of this process: cuda where a CUDA device is visible, else cpu."""
        return cls("cuda" if torch.cuda.is_available() else "cpu")

    def unavailable_reason(self, name: str) -> str | None:
        """Say why backend ``name`` cannot run here, or None when it can.

        Raises:
            UnknownBackendError: ``name`` is not a known backend.
        """
        return self._unavailable.get(name) or registry.get(name).unavailable_reason(self.kind)

    def is_available(self, name: str) -> bool:
        """Tell whether backend ``name`` can run here."""
        return self.unavailable_reason(name) is None

    @property
    def default_backend(self) -> str:
        """Return the platform default: the first available backend of ``preference``.

        When none is available it is the last one, so that selection reports why.
        """
        for name in self.preference:
            if self.is_available(name):
                return name
        return self.preference[-1]

    def __repr__(self) -> str:
        extra = f", unavailable={dict(self._unavailable)!r}" if self._unavailable else ""
        return f"Platform({self.kind!r}{extra})"
