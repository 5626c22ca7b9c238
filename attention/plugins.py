"""The one registry design: built-ins first, then out-of-tree plugins in registration order.

Attention backends (``attention.registry``) and component kinds (``components.registry``)
are both registries of this shape. Out-of-tree plugins come from an entry-point group,
read once and lazily on the first question, and from code that registers them. A plugin
that fails to load is logged and remembered with why, and never hides the working ones.

By default the entry points are those of every installed distribution; a registry built
over given ``importlib.metadata.Distribution`` objects (a ``PathDistribution`` over a
``*.dist-info`` folder, say) reads only theirs, so a test needs no installed package.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from importlib.metadata import Distribution, EntryPoint, entry_points
from typing import ClassVar, Generic, TypeVar

import structlog

__all__ = ["PluginRegistry", "UnknownPluginError"]

# A plugin is a class: a backend class, a loader class.
Plugin = TypeVar("Plugin", bound=type)


class UnknownPluginError(KeyError):
    """Report a name no built-in or out-of-tree plugin has; the message lists the known ones.

    Attributes:
        name: the name asked for.
        known: every known name, built-ins first.
        failed: entry point -> why it did not load.
    """

    noun: ClassVar[str] = "plugin"
    fix: ClassVar[str] = "register it, or install the package that provides it"

    def __init__(self, name: str, known: tuple[str, ...], failed: dict[str, str]) -> None:
        super().__init__(name)
        self.name = name
        self.known = known
        self.failed = dict(failed)

    @property
    def broken(self) -> str:
        """Say which entry points failed to load and why, each as ``; entry point ...``."""
        return "".join(
            f"; entry point '{entry}' failed to load ({why})" for entry, why in self.failed.items()
        )

    def __str__(self) -> str:
        known = ", ".join(self.known)
        return f"unknown {self.noun} '{self.name}'; known: {known}{self.broken}; {self.fix}"

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (self.name, self.known, self.failed))


class PluginRegistry(Generic[Plugin]):
    """Hold the built-in plugins and the out-of-tree ones, reading entry points once.

    Subclasses say what a plugin is: its ``builtins``, its ``name_of``, how an object is
    ``checked`` into one, and the class attributes below.

    Args:
        distributions: the distributions whose entry points are read; None (the default)
            reads every installed one.
    """

    group: ClassVar[str]
    """The entry-point group out-of-tree plugins come from."""
    unknown_error: ClassVar[type[UnknownPluginError]]
    """Raised for an unknown name; its ``noun`` names a plugin in every message."""
    load_failed_event: ClassVar[str]
    """The event logged when an entry point fails; its wing names the logger."""
    builtins: tuple[Plugin, ...]
    """The built-in plugins, in the order ``names()`` lists them."""

    def __init__(self, distributions: Iterable[Distribution] | None = None) -> None:
        self._distributions = None if distributions is None else tuple(distributions)
        self._builtin = {self.name_of(plugin): plugin for plugin in self.builtins}
        self._registered: dict[str, Plugin] = {}
        self._failed: dict[str, str] = {}
        self._lock = threading.RLock()
        self._entry_points_read = False

    def name_of(self, plugin: Plugin) -> str:
        """Return the name ``plugin`` is registered under."""
        raise NotImplementedError

    def checked(self, plugin: object) -> Plugin:
        """Return ``plugin`` once it is known to be a complete plugin.

        Raises:
            TypeError: it is not; the message says what it lacks.
        """
        raise NotImplementedError

    def from_entry_point(self, entry: EntryPoint) -> Plugin:
        """Return the plugin an entry point names.

        Raises:
            Exception: whatever importing it raises, or ``checked`` refuses.
        """
        return self.checked(entry.load())

    def names(self) -> tuple[str, ...]:
        """Return every known name: built-ins first, then out-of-tree ones."""
        self._read_entry_points()
        return (*self._builtin, *self._registered)

    def get(self, name: str) -> Plugin:
        """Return the plugin called ``name``.

        Raises:
            UnknownPluginError: no plugin has that name; the message lists the known ones.
        """
        found = self._builtin.get(name)
        if found is not None:
            return found
        self._read_entry_points()
        found = self._registered.get(name)
        if found is None:
            raise self.unknown_error(name, self.names(), self._failed)
        return found

    def out_of_tree(self) -> tuple[Plugin, ...]:
        """Return the registered (not built-in) plugins in registration order."""
        self._read_entry_points()
        return tuple(self._registered.values())

    def register(self, plugin: Plugin) -> Plugin:
        """Add an out-of-tree plugin; registering the same one again is a no-op.

        Raises:
            TypeError: it is not a complete plugin.
            ValueError: another plugin already has its name.
        """
        self.checked(plugin)
        self._read_entry_points()
        name = self.name_of(plugin)
        with self._lock:
            taken = self._builtin.get(name) or self._registered.get(name)
            if taken is plugin:
                return plugin
            if taken is not None:
                raise ValueError(
                    f"{self.unknown_error.noun} name '{name}' is taken by {_qualified(taken)}; "
                    f"give {_qualified(plugin)} another name"
                )
            self._registered[name] = plugin
        return plugin

    def unregister(self, name: str) -> None:
        """Remove an out-of-tree plugin.

        Raises:
            ValueError: ``name`` is a built-in.
            UnknownPluginError: no out-of-tree plugin has that name.
        """
        if name in self._builtin:
            raise ValueError(f"built-in {self.unknown_error.noun} '{name}' cannot be unregistered")
        with self._lock:
            if self._registered.pop(name, None) is None:
                raise self.unknown_error(name, self.names(), self._failed)

    def _entry_points(self) -> Iterable[EntryPoint]:
        if self._distributions is None:
            return entry_points(group=self.group)
        return [e for d in self._distributions for e in d.entry_points.select(group=self.group)]

    def _read_entry_points(self) -> None:
        if self._entry_points_read:
            return
        with self._lock:
            if self._entry_points_read:
                return
            # Set first: a plugin that registers itself on import must not recurse here.
            self._entry_points_read = True
            for entry in self._entry_points():
                try:
                    self.register(self.from_entry_point(entry))
                except Exception as err:  # a broken plugin must not hide the working ones
                    self._failed[entry.name] = f"{type(err).__name__}: {err}"
                    wing = self.load_failed_event.partition(".")[0]
                    structlog.get_logger(wing).warning(
                        self.load_failed_event,
                        entry_point=entry.name,
                        value=entry.value,
                        error=self._failed[entry.name],
                    )


def _qualified(plugin: type) -> str:
    """Name a plugin by where it is defined (``module.Qualname``)."""
    return f"{plugin.__module__}.{plugin.__qualname__}"
