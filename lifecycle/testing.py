"""Helpers for tests that assert on the project's structured events."""

from __future__ import annotations

from collections.abc import Iterator, MutableMapping
from contextlib import contextmanager
from typing import Any

import structlog


@contextmanager
def capture_events() -> Iterator[list[MutableMapping[str, Any]]]:
    """Collect every event logged inside the block, with its bound context."""
    with structlog.testing.capture_logs(
        processors=[structlog.contextvars.merge_contextvars]
    ) as events:
        yield events


def events_named(
    events: list[MutableMapping[str, Any]], name: str
) -> list[MutableMapping[str, Any]]:
    """Return the captured events whose name is ``name``, in order."""
    return [e for e in events if e.get("event") == name]
