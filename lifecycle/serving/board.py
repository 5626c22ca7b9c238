"""The worker's status board: the orchestrator's events fanned out to event-stream clients.

Attached to each served pipeline's orchestrator as an observer (``observer``), the
board encodes every typed event once, as one server-sent event, and hands it to every
subscribed client, in the order the orchestrator emitted them. It keeps the last
``HISTORY`` moves and ``REFUSALS`` refusals, so that a page opened later still draws
the recent timeline and refusals: a new client gets them first, atomically with its
subscription, so that it misses no event and sees none twice.

Every event carries its ``seq``, its place in that order. A pipeline's snapshot
(``serving.status``) carries the ``seq`` of the last event it already shows: the
snapshot is read on the event loop, after events that may still wait in a client's
buffer, and those are at or below it (``StatusBoard.seq``).

Each client has a bounded buffer (``CLIENT_BUFFER`` messages), filled on the
orchestrator's threads and emptied by the client's stream on the event loop. A client
that falls that far behind (a stalled connection) overflows: its buffer is dropped,
its stream ends with one ``stream.overflowed`` event, and its browser reconnects and
starts again from a fresh history and snapshot. So a slow client costs at most
``CLIENT_BUFFER`` messages of memory, and never slows the orchestrator.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections import deque

import msgspec

from lifecycle.events import Event, MemoryWait, Move, Observer, TriggerRefused

__all__ = ["CLIENT_BUFFER", "Overflowed", "StatusBoard", "server_sent"]

HISTORY = 120
"""Moves kept per pipeline for a page that connects later (its timeline's bars)."""

REFUSALS = 20
"""Refusals kept for a page that connects later."""

CLIENT_BUFFER = 1024
"""Messages one client may have waiting before its stream is dropped (it reconnects)."""


class StreamEvent(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One orchestrator event as the stream carries it.

    Attributes:
        seq: its place in the order the board published every event in, from 1.
        pipeline: the pipeline whose orchestrator emitted it.
        event: the typed event; it encodes with its log event's name under ``type``.
    """

    seq: int
    pipeline: str
    event: Event


class Overflowed(
    msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True, tag="stream.overflowed"
):
    """The last message of a client's stream that fell ``limit`` messages behind.

    Attributes:
        limit: the messages it may have waiting (``CLIENT_BUFFER``).
    """

    limit: int


def server_sent(data: bytes) -> bytes:
    """Return ``data`` (one line of JSON) as one server-sent event."""
    return b"data: " + data + b"\n\n"


class Subscription:
    """One client's bounded buffer of server-sent events.

    Filled from any thread (``push``, ``touch``, ``close``); emptied on the event loop
    that subscribed (``next``).

    Args:
        loop: the event loop the client's stream runs on.
        limit: the messages it may have waiting.

    Attributes:
        overflowed: it fell ``limit`` messages behind; its stream ends.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, limit: int) -> None:
        self._loop = loop
        self._limit = limit
        self._items: deque[bytes] = deque()
        self._lock = threading.Lock()
        self._ready = asyncio.Event()
        self._woken = False  # a wake-up is on its way to the loop: no second one is sent
        self._stale = False
        self._ended = False
        self.overflowed = False

    def push(self, message: bytes) -> None:
        """Queue ``message``, and note that the state it reports changed."""
        with self._lock:
            if self._ended:
                return
            if len(self._items) < self._limit:
                self._items.append(message)
            else:
                self._items.clear()
                self.overflowed = self._ended = True
            self._stale = True
        self._wake()

    def touch(self) -> None:
        """Note that the state changed without an event (a job queued or a batch started)."""
        with self._lock:
            self._stale = True
        self._wake()

    def close(self) -> None:
        """End the stream once what is queued has been sent."""
        with self._lock:
            self._ended = self._stale = True
        self._wake()

    async def next(self) -> tuple[list[bytes], bool, bool]:
        """Wait for news; return the queued messages, whether the state changed, and
        whether the stream ends after them."""
        await self._ready.wait()
        with self._lock:
            self._ready.clear()
            self._woken = False
            items = list(self._items)
            self._items.clear()
            stale, self._stale = self._stale, False
            return items, stale, self._ended

    def _wake(self) -> None:
        with self._lock:
            if self._woken:
                return
            self._woken = True
        with contextlib.suppress(RuntimeError):  # the loop closed: nobody reads any more
            self._loop.call_soon_threadsafe(self._ready.set)


class StatusBoard:
    """Fan every observed event out to the subscribed clients, and keep the recent ones."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._moves: dict[str, deque[tuple[int, Move, bytes]]] = {}
        self._refusals: deque[tuple[int, bytes]] = deque(maxlen=REFUSALS)
        self._count = 0
        self._clients: list[Subscription] = []
        self._closed = False

    def observer(self, pipeline: str) -> Observer:
        """Return the observer to attach to ``pipeline``'s orchestrator."""
        with self._lock:
            self._moves.setdefault(pipeline, deque(maxlen=HISTORY))

        def observe(event: Event) -> None:
            self.publish(pipeline, event)

        return observe

    def publish(self, pipeline: str, event: Event) -> None:
        """Send ``event`` to every client, and keep it when it is a move or a refusal."""
        with self._lock:  # held while pushing: every client gets events in one order
            self._count += 1
            stream_event = StreamEvent(seq=self._count, pipeline=pipeline, event=event)
            message = server_sent(msgspec.json.encode(stream_event))
            if isinstance(event, Move):
                self._moves[pipeline].append((self._count, event, message))
            elif _is_refusal(event):
                self._refusals.append((self._count, message))
            for client in self._clients:
                client.push(message)

    def changed(self) -> None:
        """Tell every client that the state changed without an event (the queue)."""
        with self._lock:
            for client in self._clients:
                client.touch()

    @property
    def seq(self) -> int:
        """Return the ``seq`` of the last event published.

        Read under the device's lock, which every move and transition holds while it is
        published, it says which of them a reading of the components shows: those at or
        below it, and none after.
        """
        with self._lock:
            return self._count

    def recent_moves(self, pipeline: str) -> list[Move]:
        """Return ``pipeline``'s last moves, oldest first."""
        with self._lock:
            return [move for _, move, _ in self._moves.get(pipeline, ())]

    @property
    def subscribers(self) -> int:
        """Return how many clients read the stream now."""
        return len(self._clients)

    def subscribe(self) -> Subscription:
        """Subscribe a client on the running event loop: it gets the recent moves and
        refusals first, then every event from now on. A closed board's stream ends at once.
        """
        with self._lock:
            kept = [(n, message) for found in self._moves.values() for n, _, message in found]
            history = sorted([*kept, *self._refusals])
            # the history never counts against the buffer: it is bounded on its own
            client = Subscription(asyncio.get_running_loop(), CLIENT_BUFFER + len(history))
            for _, message in history:
                client.push(message)
            client.touch()  # its first snapshot follows the history
            if self._closed:
                client.close()
            else:
                self._clients.append(client)
        return client

    def unsubscribe(self, client: Subscription) -> None:
        """Stop sending to ``client`` (its connection ended)."""
        with self._lock:
            if client in self._clients:
                self._clients.remove(client)

    def close(self) -> None:
        """End every client's stream: the worker drained, and the server may stop."""
        with self._lock:
            self._closed = True
            clients, self._clients = self._clients, []
        for client in clients:
            client.close()


def _is_refusal(event: Event) -> bool:
    """Tell whether ``event`` ends something with a refusal (a try that may wait does not)."""
    if isinstance(event, TriggerRefused):
        return not event.may_wait
    return isinstance(event, MemoryWait) and event.outcome == "refused"
