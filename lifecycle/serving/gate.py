"""A gate HTTP requests wait at while their pipeline sleeps or is being replaced.

Threads (an admin route's, a signal's) open and close it; coroutines of the event
loop wait for it to open without holding a thread each.
"""

from __future__ import annotations

import asyncio
import threading

__all__ = ["Gate"]


class Gate:
    """Open or closed, with the reason it is closed; coroutines wait for it to open.

    Args:
        closed_for: why it starts closed (None: open).

    Attributes:
        closed_for: why it is closed now (``sleeping``, ``swapping``, ``removed``), or
            None while open.
    """

    def __init__(self, closed_for: str | None = None) -> None:
        self.closed_for = closed_for
        self._lock = threading.Lock()
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = []

    @property
    def is_open(self) -> bool:
        """Tell whether requests pass."""
        return self.closed_for is None

    @property
    def waiting(self) -> int:
        """Return how many requests wait here now."""
        return len(self._waiters)

    def close(self, why: str) -> None:
        """Stop requests here, saying ``why``."""
        with self._lock:
            self.closed_for = why

    def open(self) -> None:
        """Let requests pass, and wake every one waiting."""
        with self._lock:
            self.closed_for = None
            self._wake_all()

    def wake_waiters(self) -> None:
        """Wake every waiting request without opening (its pipeline went away: it looks again)."""
        with self._lock:
            self._wake_all()

    def _wake_all(self) -> None:
        waiters, self._waiters = self._waiters, []
        for loop, future in waiters:
            loop.call_soon_threadsafe(_settle, future)

    async def wait(self, timeout: float | None) -> bool:
        """Wait up to ``timeout`` seconds (None: no limit) to be woken; tell if it is open."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[None] = loop.create_future()
        with self._lock:
            if self.closed_for is None:
                return True
            self._waiters.append((loop, future))
        try:
            await asyncio.wait_for(future, timeout)
        except TimeoutError:
            with self._lock:
                if (loop, future) in self._waiters:
                    self._waiters.remove((loop, future))
        return self.is_open


def _settle(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)
