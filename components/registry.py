"""The registry of component kinds: built-ins, then registered and installed ones.

Out-of-tree kinds come only from installed packages, through the entry-point group
``pipeline_lifecycle.kinds`` (read once, lazily, with ``importlib.metadata``): an entry
point names a ``ComponentLoader`` subclass, or a plain callable returning an
``nn.Module``, which loads through the strict generic loader under the entry point's
name. A spec only ever names a kind; it never names a module. The module functions use
one process-wide registry, ``default_registry``; a ``KindRegistry`` built over given
distributions reads only theirs (``attention.plugins``).
"""

from __future__ import annotations

from importlib.metadata import EntryPoint

from attention.plugins import PluginRegistry, UnknownPluginError
from components.generic import GenericLoader
from components.kinds import BUILTIN_KINDS
from components.loader import ComponentLoader

__all__ = ["ENTRY_POINT_GROUP", "UnknownKindError", "get", "names", "register_kind"]

ENTRY_POINT_GROUP = "pipeline_lifecycle.kinds"


class UnknownKindError(UnknownPluginError):
    """No installed or registered kind has this name; the message lists the known ones.

    Attributes:
        name: the name asked for.
        known: every known kind.
        failed: entry point -> why it did not load.
    """

    noun = "component kind"
    fix = f"a package adds kinds through the entry-point group '{ENTRY_POINT_GROUP}'"


class KindRegistry(PluginRegistry[type[ComponentLoader]]):
    """Hold the built-in kinds and the out-of-tree ones (``attention.plugins``).

    Args:
        distributions: the distributions whose entry points are read; None (the default)
            reads every installed one.
    """

    group = ENTRY_POINT_GROUP
    unknown_error = UnknownKindError
    load_failed_event = "components.kind_load_failed"
    builtins = BUILTIN_KINDS

    def name_of(self, plugin: type[ComponentLoader]) -> str:
        """Return the loader's ``kind``."""
        return plugin.kind

    def checked(self, plugin: object) -> type[ComponentLoader]:
        """Return ``plugin`` once it is a ``ComponentLoader`` subclass.

        Raises:
            TypeError: it is not.
        """
        if isinstance(plugin, type) and issubclass(plugin, ComponentLoader):
            return plugin
        raise TypeError(f"register_kind takes a ComponentLoader subclass, got {plugin!r}")

    def from_entry_point(self, entry: EntryPoint) -> type[ComponentLoader]:
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


default_registry = KindRegistry()


def names() -> tuple[str, ...]:
    """Return every known kind: built-ins, then registered and installed ones."""
    return default_registry.names()


def get(kind: str) -> type[ComponentLoader]:
    """Return the loader of ``kind``.

    Raises:
        UnknownKindError: no kind has that name; the message lists the installed ones.
    """
    return default_registry.get(kind)


def register_kind(loader: type[ComponentLoader]) -> type[ComponentLoader]:
    """Register ``loader`` under its ``kind``; usable as a class decorator.

    Raises:
        TypeError: ``loader`` is not a ``ComponentLoader`` subclass.
        ValueError: another loader already has that kind.
    """
    return default_registry.register(loader)


def unregister_kind(kind: str) -> None:
    """Forget ``kind`` (tests register kinds of their own).

    Raises:
        ValueError: ``kind`` is a built-in.
        UnknownKindError: no out-of-tree kind has that name.
    """
    default_registry.unregister(kind)
