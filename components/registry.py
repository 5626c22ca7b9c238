"""The registry of component kinds: built-ins, registered, then installed packages.

Out-of-tree kinds come only from installed packages, through the entry-point group
``pipeline_lifecycle.kinds`` (read once, lazily, with ``importlib.metadata``): an entry
point names a ``ComponentLoader`` subclass, or a plain callable returning an
``nn.Module``, which loads through the strict generic loader under the entry point's
name. A spec only ever names a kind; it never names a module.
"""

from __future__ import annotations

from importlib.metadata import EntryPoint, entry_points

import structlog

from components.generic import GenericLoader
from components.loader import ComponentLoader

ENTRY_POINT_GROUP = "pipeline_lifecycle.kinds"

_log = structlog.get_logger("components")
_kinds: dict[str, type[ComponentLoader]] = {}
_failed: dict[str, str] = {}
_entry_points_loaded = False


class UnknownKindError(KeyError):
    """No installed or registered kind has this name; the message lists the known ones.

    Attributes:
        kind: the name asked for.
        known: every known kind.
        failed: entry point -> why it did not load.
    """

    def __init__(self, kind: str, known: tuple[str, ...], failed: dict[str, str]) -> None:
        self.kind = kind
        self.known = known
        self.failed = dict(failed)
        super().__init__(kind, known, self.failed)

    def __str__(self) -> str:
        broken = "".join(
            f"; entry point '{name}' failed to load ({why})" for name, why in self.failed.items()
        )
        return (
            f"unknown component kind {self.kind!r}; installed: {', '.join(self.known)}"
            f"{broken}; a package adds kinds through the entry-point group '{ENTRY_POINT_GROUP}'"
        )


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
    """Return every known kind: built-ins, then registered and installed ones."""
    _load_entry_points()
    return tuple(_kinds)


def get(kind: str) -> type[ComponentLoader]:
    """Return the loader of ``kind``.

    Raises:
        UnknownKindError: no kind has that name; the message lists the installed ones.
    """
    _load_entry_points()
    found = _kinds.get(kind)
    if found is None:
        raise UnknownKindError(kind, tuple(_kinds), _failed)
    return found


def _load_entry_points() -> None:
    global _entry_points_loaded
    if _entry_points_loaded:
        return
    # Set first: a plugin that registers itself on import must not recurse here.
    _entry_points_loaded = True
    from components import kinds  # noqa: F401  (registers the built-in kinds)

    for entry in entry_points(group=ENTRY_POINT_GROUP):
        try:
            register_kind(_loader_of(entry))
        except Exception as err:  # a broken plugin must not hide the working ones
            _failed[entry.name] = f"{type(err).__name__}: {err}"
            _log.warning(
                "components.kind_load_failed",
                entry_point=entry.name,
                value=entry.value,
                error=_failed[entry.name],
            )


def _loader_of(entry: EntryPoint) -> type[ComponentLoader]:
    """Return the loader an entry point names, or a generic one around its factory.

    Raises:
        TypeError: the entry point names neither a loader nor a callable.
        ValueError: its loader's ``kind`` is not the entry point's name.
    """
    target = entry.load()
    if isinstance(target, type) and issubclass(target, ComponentLoader):
        if target.kind != entry.name:
            raise ValueError(
                f"entry point '{entry.name}' names {target.__qualname__}, whose kind is "
                f"{target.kind!r}; name the entry point after the kind"
            )
        return target
    if callable(target):
        return GenericLoader.for_factory(entry.name, target)
    raise TypeError(
        f"entry point '{entry.name}' names {target!r}, neither a ComponentLoader subclass "
        "nor a callable returning an nn.Module"
    )
