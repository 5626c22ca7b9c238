"""Helpers for tests that assert on the project's structured events."""

from __future__ import annotations

import logging
from collections.abc import Iterator, MutableMapping
from contextlib import contextmanager
from typing import Any

import structlog

from lifecycle.logs import configuration_changed


@contextmanager
def capture_events() -> Iterator[list[MutableMapping[str, Any]]]:
    """Collect every event logged inside the block, at every level, with its bound context.

    Loggers cached before the block (``cache_logger_on_first_use``) are
    reassembled for it, and again after it, from the configuration it restores.
    """
    wrapper = structlog.get_config()["wrapper_class"]
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.NOTSET))
    configuration_changed()
    try:
        with structlog.testing.capture_logs(
            processors=[structlog.contextvars.merge_contextvars]
        ) as events:
            yield events
    finally:
        structlog.configure(wrapper_class=wrapper)
        configuration_changed()


def events_named(
    events: list[MutableMapping[str, Any]], name: str
) -> list[MutableMapping[str, Any]]:
    """Return the captured events whose name is ``name``, in order."""
    return [e for e in events if e.get("event") == name]
