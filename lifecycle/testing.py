"""Helpers for tests that assert on the project's structured events and observed values."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator, MutableMapping
from contextlib import contextmanager
from typing import Any, TypeVar

import structlog

from lifecycle.events import Event
from lifecycle.logs import reconfigure, saved_logging

__all__ = ["E", "EventRecorder", "capture_events", "events_named"]

E = TypeVar("E", bound=Event)


@contextmanager
def capture_events() -> Iterator[list[MutableMapping[str, Any]]]:
    """Collect every event logged inside the block, at every level, with its bound context.

    The project's loggers follow the capture, and the configuration found is put
    back afterwards.
    """
    capture = structlog.testing.LogCapture()
    with saved_logging():
        reconfigure(
            processors=[structlog.contextvars.merge_contextvars, capture],
            wrapper_class=structlog.make_filtering_bound_logger(logging.NOTSET),
        )
        yield capture.entries


def events_named(
    events: list[MutableMapping[str, Any]], name: str
) -> list[MutableMapping[str, Any]]:
    """Return the captured events whose name is ``name``, in order."""
    return [e for e in events if e.get("event") == name]


class EventRecorder:
    """An observer that keeps every event it receives, in order (from any thread).

    Attributes:
        events: every event so far.
    """

    def __init__(self) -> None:
        self.events: list[Event] = []
        self._lock = threading.Lock()

    def __call__(self, event: Event) -> None:
        with self._lock:
            self.events.append(event)

    def of(self, kind: type[E]) -> list[E]:
        """Return the events of type ``kind``, in order."""
        with self._lock:
            return [event for event in self.events if isinstance(event, kind)]

    def clear(self) -> None:
        """Forget every event so far."""
        with self._lock:
            self.events.clear()
