"""Closed sets that describe an attention layer and where its backend request came from."""

from __future__ import annotations

from enum import StrEnum

__all__ = ["AttentionRole", "Provenance"]


class AttentionRole(StrEnum):
    """Say what an attention layer attends to: its own sequence, or another one."""

    SELF = "self"
    CROSS = "cross"


class Provenance(StrEnum):
    """Say who asked for a backend; explicit requests are strict, the others may fall back."""

    EXPLICIT = "explicit"
    AUTOMATIC = "automatic"
    DEFAULT = "default"
