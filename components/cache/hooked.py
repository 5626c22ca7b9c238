"""Run a native class's step cache through diffusers' own hook, each row deciding alone.

Diffusers' ``FirstBlockCache`` (``CacheMixin.enable_cache``) decides once for a whole
forward and keeps its state per cache context (``cache_context(name)``). So a row runs
alone in its forward, under a context of its own that lives as long as its ``RowCache``:
its decisions read only its own tensors, as on the custom path. A row that runs no cache
(``cache = False``, or too few steps) runs each step under a fresh context: with nothing
to compare, the hook computes every block and returns their output unchanged.

A context is set on the module, not passed to the call, so forwards of one module under
the hook take turns. States are freed by name: diffusers frees only all of them at once
(``_reset_stateful_cache``), which would drop the rows of a batch running beside.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator, Mapping
from typing import Any
from weakref import WeakKeyDictionary

import torch
from torch import nn

from components.cache.settings import CacheSettings
from components.cache.state import RowCache

__all__ = ["enable", "forward_row", "free", "row_names"]

_TURNS: WeakKeyDictionary[nn.Module, threading.Lock] = WeakKeyDictionary()
_TURNS_LOCK = threading.Lock()


def enable(module: nn.Module, settings: CacheSettings) -> None:
    """Put diffusers' first-block hook with ``settings``' threshold on ``module`` (once; a
    component has one cache, so a hook already there has these settings)."""
    from diffusers.hooks.first_block_cache import FirstBlockCacheConfig

    hooked: Any = module
    if not hooked.is_cache_enabled:
        hooked.enable_cache(FirstBlockCacheConfig(threshold=settings.threshold_value))


def forward_row(
    module: nn.Module, inputs: Mapping[str, Any], row: RowCache | None, step: int
) -> torch.Tensor:
    """Run ``module`` on one row's ``inputs`` at ``step`` under its own context, and count
    the hook's decision in ``row`` (every step of a row without a cache is computed)."""
    cached = row is not None and row.uncached is None
    name = row_names([row])[0] if cached else "uncached"
    hooked: Any = module
    with _turn(module), hooked.cache_context(name):
        prediction: torch.Tensor = module(**inputs, return_dict=False)[0]
        computed = all(state.should_compute for state in _states(module, name))
    if not cached:
        free(module, [name])
    if row is not None:
        row.count(step, computed=computed)
    return prediction


def free(module: nn.Module, names: Iterable[str]) -> None:
    """Drop the hook's state of each context in ``names`` (the others are kept)."""
    for manager in _managers(module):
        for name in names:
            manager._state_cache.pop(name, None)


def row_names(rows: Iterable[RowCache | None]) -> list[str]:
    """Return the context names ``forward_row`` gives ``rows``' cached steps."""
    return [f"row-{id(row)}" for row in rows if row is not None]


def _turn(module: nn.Module) -> threading.Lock:
    with _TURNS_LOCK:
        return _TURNS.setdefault(module, threading.Lock())


def _managers(module: nn.Module) -> Iterator[Any]:
    """Yield the state manager of every stateful hook diffusers put on ``module``."""
    for child in module.modules():
        registry = getattr(child, "_diffusers_hook", None)
        if registry is None:
            continue
        for hook in registry.hooks.values():
            manager = getattr(hook, "state_manager", None)
            if hook._is_stateful and manager is not None:
                yield manager


def _states(module: nn.Module, name: str) -> Iterator[Any]:
    for manager in _managers(module):
        state = manager._state_cache.get(name)
        if state is not None:
            yield state
