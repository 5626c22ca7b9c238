"""Know every attention backend: the built-ins, then out-of-tree ones in registration order.

Out-of-tree backends come from the entry-point group ``pipeline_lifecycle.backends``
(each entry point names an ``AttentionBackend`` subclass), read lazily and once, and from
``register_backend(...)``. The module functions use one process-wide registry.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from importlib.metadata import entry_points
from typing import Any

import msgspec
import structlog

from attention.backend import AttentionBackend, AttentionImpl
from attention.backends import BUILTIN_BACKENDS
from attention.errors import UnknownBackendError

ENTRY_POINT_GROUP = "pipeline_lifecycle.backends"


class BackendRegistry:
    """Hold the built-in backends and the out-of-tree ones, loading entry points once.

    Args:
        group: the entry-point group out-of-tree backends are read from.
    """

    def __init__(self, group: str = ENTRY_POINT_GROUP) -> None:
        self.group = group
        self._builtin = {cls.name: cls for cls in BUILTIN_BACKENDS}
        self._registered: dict[str, type[AttentionBackend]] = {}
        self._failed: dict[str, str] = {}
        self._lock = threading.RLock()
        self._entry_points_read = False

    def names(self) -> tuple[str, ...]:
        """Return every known backend name: built-ins first, then out-of-tree ones."""
        self._read_entry_points()
        return (*self._builtin, *self._registered)

    def get(self, name: str) -> type[AttentionBackend]:
        """Return the backend class called ``name``.

        Raises:
            UnknownBackendError: no backend has that name; the message lists the known ones.
        """
        found = self._builtin.get(name)
        if found is not None:
            return found
        self._read_entry_points()
        found = self._registered.get(name)
        if found is None:
            raise UnknownBackendError(name, self.names(), self._failed)
        return found

    def out_of_tree(self) -> tuple[type[AttentionBackend], ...]:
        """Return the registered (not built-in) backends in registration order."""
        self._read_entry_points()
        return tuple(self._registered.values())

    def register(self, backend_cls: type[AttentionBackend]) -> type[AttentionBackend]:
        """Add an out-of-tree backend; registering the same class again is a no-op.

        Raises:
            TypeError: the class is not a complete ``AttentionBackend``.
            ValueError: another backend already has its name.
        """
        _check_backend(backend_cls)
        self._read_entry_points()
        with self._lock:
            taken = self._builtin.get(backend_cls.name) or self._registered.get(backend_cls.name)
            if taken is backend_cls:
                return backend_cls
            if taken is not None:
                raise ValueError(
                    f"attention backend name '{backend_cls.name}' is taken by "
                    f"{taken.__module__}.{taken.__qualname__}; give "
                    f"{backend_cls.__qualname__} another name"
                )
            self._registered[backend_cls.name] = backend_cls
        return backend_cls

    def unregister(self, name: str) -> None:
        """Remove an out-of-tree backend.

        Raises:
            ValueError: ``name`` is a built-in backend.
            UnknownBackendError: no out-of-tree backend has that name.
        """
        if name in self._builtin:
            raise ValueError(f"built-in attention backend '{name}' cannot be unregistered")
        with self._lock:
            if self._registered.pop(name, None) is None:
                raise UnknownBackendError(name, self.names(), self._failed)

    def _read_entry_points(self) -> None:
        if self._entry_points_read:
            return
        with self._lock:
            if self._entry_points_read:
                return
            # Set first: a plugin that registers itself on import must not recurse here.
            self._entry_points_read = True
            for entry in entry_points(group=self.group):
                try:
                    self.register(entry.load())
                except Exception as err:  # a broken plugin must not hide the working ones
                    self._failed[entry.name] = f"{type(err).__name__}: {err}"
                    structlog.get_logger("attention").warning(
                        "attention.backend_load_failed",
                        entry_point=entry.name,
                        value=entry.value,
                        error=self._failed[entry.name],
                    )


def _check_backend(backend_cls: object) -> None:
    if not (isinstance(backend_cls, type) and issubclass(backend_cls, AttentionBackend)):
        raise TypeError(f"register_backend takes an AttentionBackend subclass, got {backend_cls!r}")
    where = f"attention backend {backend_cls.__qualname__}"
    name = getattr(backend_cls, "name", None)
    if not isinstance(name, str) or not name:
        raise TypeError(f"{where} needs a class attribute name: str")
    impl_cls = getattr(backend_cls, "impl_cls", None)
    if not (isinstance(impl_cls, type) and issubclass(impl_cls, AttentionImpl)):
        raise TypeError(f"{where} needs a class attribute impl_cls: an AttentionImpl subclass")
    if impl_cls.forward is AttentionImpl.forward:
        raise TypeError(f"{where}: {impl_cls.__qualname__} must implement forward")
    if not issubclass(backend_cls.options_type, msgspec.Struct):
        raise TypeError(f"{where}: options_type must be a msgspec.Struct subclass")


_default = BackendRegistry()


def names() -> tuple[str, ...]:
    """Return every known backend name: built-ins first, then out-of-tree ones."""
    return _default.names()


def get(name: str) -> type[AttentionBackend]:
    """Return the backend class called ``name``.

    Raises:
        UnknownBackendError: no backend has that name; the message lists the known ones.
    """
    return _default.get(name)


def decode_options(name: str, raw: Mapping[str, Any]) -> msgspec.Struct:
    """Validate ``[attention.backend_options.<name>]`` into the backend's options Struct.

    Raises:
        UnknownBackendError: no backend has that name.
        msgspec.ValidationError: an option is unknown or has a bad value.
    """
    return msgspec.convert(dict(raw), get(name).options_type)


def out_of_tree() -> tuple[type[AttentionBackend], ...]:
    """Return the registered (not built-in) backends in registration order."""
    return _default.out_of_tree()


def register_backend(backend_cls: type[AttentionBackend]) -> type[AttentionBackend]:
    """Add an out-of-tree backend; its capabilities are read from its ``impl_cls``.

    Registering the same class twice is a no-op, so it works as a class decorator too.

    Raises:
        TypeError: the class is not a complete ``AttentionBackend``.
        ValueError: another backend already has its name.
    """
    return _default.register(backend_cls)


def unregister_backend(name: str) -> None:
    """Remove an out-of-tree backend (tests use it to leave the registry as they found it).

    Raises:
        ValueError: ``name`` is a built-in backend.
        UnknownBackendError: no out-of-tree backend has that name.
    """
    _default.unregister(name)
