"""The registry of component kinds: built-ins, registered, then entry points."""

from __future__ import annotations

from importlib.metadata import entry_points

from components.generic import GenericLoader
from components.loader import ComponentLoader

ENTRY_POINT_GROUP = "pipeline_lifecycle.components"

_kinds: dict[str, type[ComponentLoader]] = {}
_entry_points_loaded = False


def register_kind(loader: type[ComponentLoader]) -> type[ComponentLoader]:
    """Register ``loader`` under its ``kind``; usable as a class decorator.

    Raises:
        ValueError: another loader already has that kind.
    """
    existing = _kinds.get(loader.kind)
    if existing is not None and existing is not loader:
        raise ValueError(
            f"kind {loader.kind!r} is already registered by {existing.__qualname__}; "
            "pick another kind name"
        )
    _kinds[loader.kind] = loader
    return loader


def unregister_kind(kind: str) -> None:
    """Forget ``kind`` (tests register kinds of their own)."""
    _kinds.pop(kind, None)


def names() -> tuple[str, ...]:
    """Return every known kind."""
    _load_entry_points()
    return tuple(_kinds)


def get(kind: str) -> type[ComponentLoader]:
    """Return the loader of ``kind``; the strict generic loader when it is unknown."""
    _load_entry_points()
    return _kinds.get(kind, GenericLoader)


def _load_entry_points() -> None:
    global _entry_points_loaded
    if _entry_points_loaded:
        return
    _entry_points_loaded = True
    from components import kinds  # noqa: F401  (registers the built-in kinds)

    for entry_point in entry_points(group=ENTRY_POINT_GROUP):
        register_kind(entry_point.load())
