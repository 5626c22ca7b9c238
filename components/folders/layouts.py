"""The layouts this process declared, and the modules built to declare them, by what they
are computed from: a folder admitted again is not built again to declare it, and a module
one admission built is the one the next load of that folder fills.

A folder component's layout (``FolderLoader.layout``: the tensors its module expects and
the module name of each stored tensor) is a pure function of the loader's kind and
options, the folder's ``config.json`` and its weights' headers. Finding it builds the
module on ``meta``, most of what admitting a folder costs; a process often admits one
folder more than once (a budget computed from one admission before the one that loads,
``check`` then ``run`` in one process, a worker that swaps in a pipeline on the folder of
another). The key holds everything the layout is computed from, so an edited config or
a rewritten file is a new key, never a stale layout.

The module built on ``meta`` to declare a layout is left as a spare under its key (and
path): the first build of that key takes it, whichever loader admitted it, so a folder
admitted by one orchestrator and loaded by another is built once, as one admitted and
loaded by the same one is.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from pathlib import Path
from typing import Any, TypeVar

from torch import nn

from components.weights import StoredTensor

__all__ = ["KEPT", "layout_key", "leave_spare", "remembered", "take_spare"]

KEPT = 64
"""Layouts kept, the least recently used dropped first: a layout is a few dictionaries of
names and shapes, and a process admits few distinct folders."""

T = TypeVar("T")

_kept: OrderedDict[Hashable, Any] = OrderedDict()
_spares: OrderedDict[Hashable, nn.Module] = OrderedDict()
_lock = threading.Lock()


def layout_key(
    kind: type,
    options: Hashable,
    config: dict[str, Any],
    stored: dict[str, tuple[StoredTensor, Path]],
) -> Hashable:
    """Return what a layout is computed from: the loader's class and options, the config,
    and each stored tensor's name, dtype, shape and file."""
    headers = tuple((name, tensor, str(path)) for name, (tensor, path) in stored.items())
    return (kind, options, json.dumps(config, sort_keys=True), headers)


def remembered(key: Hashable, compute: Callable[[], T]) -> T:
    """Return the value kept under ``key``, else ``compute()``'s, kept from then on.

    ``compute`` runs outside the lock (it builds a module): two threads that miss one
    key at once both compute it, and equal values are kept.
    """
    with _lock:
        if key in _kept:
            _kept.move_to_end(key)
            value: T = _kept[key]
            return value
    value = compute()
    with _lock:
        _kept[key] = value
        while len(_kept) > KEPT:
            _kept.popitem(last=False)
    return value


def leave_spare(key: Hashable, module: nn.Module) -> None:
    """Keep ``module`` (built on ``meta``, no weights, never changed) for the next build of
    ``key``; a spare already kept there is dropped."""
    with _lock:
        _spares[key] = module
        _spares.move_to_end(key)
        while len(_spares) > KEPT:
            _spares.popitem(last=False)


def take_spare(key: Hashable, build: Callable[[], nn.Module]) -> nn.Module:
    """Return the spare kept for ``key`` and keep it no longer (one build takes it); where
    there is none, ``build()``'s module."""
    with _lock:
        module = _spares.pop(key, None)
    return build() if module is None else module
