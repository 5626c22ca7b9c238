"""Know every attention backend: the built-ins, then out-of-tree ones in registration order.

Out-of-tree backends come from the entry-point group ``pipeline_lifecycle.backends``
(each entry point names an ``AttentionBackend`` subclass), read lazily and once, and from
``register_backend(...)``. The module functions use one process-wide registry,
``default_registry``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgspec

from attention.backend import AttentionBackend, AttentionImpl
from attention.backends import BUILTIN_BACKENDS
from attention.errors import UnknownBackendError
from attention.plugins import PluginRegistry

__all__ = ["decode_options", "get", "names", "out_of_tree", "register_backend"]

ENTRY_POINT_GROUP = "pipeline_lifecycle.backends"


class BackendRegistry(PluginRegistry[type[AttentionBackend]]):
    """Hold the built-in backends and the out-of-tree ones (``attention.plugins``).

    Args:
        distributions: the distributions whose entry points are read; None (the default)
            reads every installed one.
    """

    group = ENTRY_POINT_GROUP
    unknown_error = UnknownBackendError
    load_failed_event = "attention.backend_load_failed"
    builtins = BUILTIN_BACKENDS

    def name_of(self, plugin: type[AttentionBackend]) -> str:
        """Return the backend's ``name``."""
        return plugin.name

    def checked(self, plugin: object) -> type[AttentionBackend]:
        """Return ``plugin`` once it is a complete ``AttentionBackend`` subclass.

        Raises:
            TypeError: it is not; the message says what it lacks.
        """
        return _check_backend(plugin)


def _check_backend(backend_cls: object) -> type[AttentionBackend]:
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
    return backend_cls


default_registry = BackendRegistry()


def names() -> tuple[str, ...]:
    """Return every known backend name: built-ins first, then out-of-tree ones."""
    return default_registry.names()


def get(name: str) -> type[AttentionBackend]:
    """Return the backend class called ``name``.

    Raises:
        UnknownBackendError: no backend has that name; the message lists the known ones.
    """
    return default_registry.get(name)


def decode_options(name: str, raw: Mapping[str, Any]) -> msgspec.Struct:
    """Validate ``[attention.backend_options.<name>]`` into the backend's options Struct.

    Raises:
        UnknownBackendError: no backend has that name.
        msgspec.ValidationError: an option is unknown or has a bad value.
    """
    return msgspec.convert(dict(raw), get(name).options_type)


def out_of_tree() -> tuple[type[AttentionBackend], ...]:
    """Return the registered (not built-in) backends in registration order."""
    return default_registry.out_of_tree()


def register_backend(backend_cls: type[AttentionBackend]) -> type[AttentionBackend]:
    """Add an out-of-tree backend; its capabilities are read from its ``impl_cls``.

    Registering the same class twice is a no-op, so it works as a class decorator too.

    Raises:
        TypeError: the class is not a complete ``AttentionBackend``.
        ValueError: another backend already has its name.
    """
    return default_registry.register(backend_cls)


def unregister_backend(name: str) -> None:
    """Remove an out-of-tree backend (tests use it to leave the registry as they found it).

    Raises:
        ValueError: ``name`` is a built-in backend.
        UnknownBackendError: no out-of-tree backend has that name.
    """
    default_registry.unregister(name)
