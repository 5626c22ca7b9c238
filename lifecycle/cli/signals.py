"""SIGINT and SIGTERM during ``lifecycle run``: stop cleanly, never with a stack trace.

The first signal lets the request in flight finish and starts no other one. A
request is short (milliseconds to seconds) and finishing it leaves every
component where its plan says, with its result counted; cutting it short
would waste the work already done. A second signal abandons that request at
once: the transition in progress is rolled back and the request's components
are put back, as for any error. Either way the caller then releases every
component, removes the offload folder and prints what completed.
"""

from __future__ import annotations

import os
import signal
import threading
from types import FrameType, TracebackType
from typing import Any

__all__ = ["Abandoned", "StopOnSignal"]

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Abandoned(BaseException):
    """A second stop signal arrived: the request in flight is given up.

    A ``BaseException``, like ``KeyboardInterrupt``: a transition's rollback
    re-raises it instead of reporting it as a failed transition.
    """


class StopOnSignal:
    """Catch SIGINT and SIGTERM while a run goes on; restore the old handlers on exit."""

    def __init__(self) -> None:
        self.received: signal.Signals | None = None
        self._may_abandon = True
        self._previous: dict[signal.Signals, Any] = {}

    @property
    def exit_code(self) -> int | None:
        """Return the shell's code for the signal received (130, 143), or None."""
        return None if self.received is None else 128 + self.received.value

    def should_stop(self) -> bool:
        """Tell whether a stop signal arrived (asked before each request)."""
        return self.received is not None

    def settle(self) -> None:
        """Stop abandoning: from now on (release, cleanup, summary) signals are only noted."""
        self._may_abandon = False

    def __enter__(self) -> StopOnSignal:
        if threading.current_thread() is not threading.main_thread():
            return self  # only the main thread may handle signals; elsewhere none are caught
        for number in STOP_SIGNALS:
            self._previous[number] = signal.signal(number, self._handle)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        for number, handler in self._previous.items():
            signal.signal(number, handler)

    def _handle(self, number: int, frame: FrameType | None) -> None:
        if self.received is not None:
            if self._may_abandon:
                self._may_abandon = False
                _say(f"{signal.Signals(number).name} again: abandoning the request in flight")
                raise Abandoned
            return
        self.received = signal.Signals(number)
        if self._may_abandon:
            _say(
                f"{self.received.name} received: finishing the request in flight, then "
                "stopping (send it again to abandon that request)"
            )


def _say(text: str) -> None:
    # os.write, not print: the handler may run while the main code is inside a
    # buffered write to stderr, and a re-entrant buffered write raises
    os.write(2, f"lifecycle run: {text}\n".encode())
