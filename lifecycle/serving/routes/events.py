"""``GET /v1/events``: the worker's typed observer events as server-sent events.

Each event is one ``data:`` line of JSON: ``{"seq": N, "pipeline": NAME, "event":
{"type": ...}}`` for an orchestrator event (``lifecycle.events``, encoded as its log
line's fields; ``seq`` counts them, in the order every client gets them), and
``{"type": "status.snapshot", ...}`` (``serving.status``) after every burst of news,
so that a client always ends on what the worker holds now. The snapshot is read after
the burst, so events that came meanwhile follow it although it shows them already:
each pipeline's status names its ``seq``, and its events at or below it are not news
(the page skips them). A new client first
gets the recent moves and refusals, then a snapshot. A client that falls
``CLIENT_BUFFER`` messages behind gets ``stream.overflowed`` and the stream ends (its
browser reconnects); when the worker has drained, every stream ends.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import msgspec
from fastapi import APIRouter
from fastapi.responses import StreamingResponse
from prometheus_client import Gauge

from lifecycle.serving.auth import page_door
from lifecycle.serving.board import CLIENT_BUFFER, Overflowed, server_sent
from lifecycle.serving.status import worker_status
from lifecycle.serving.worker import Worker

__all__ = ["events_routes"]

RETRY_MS = 1000
"""How long a browser waits before it reconnects a stream that ended."""


def events_routes(worker: Worker) -> APIRouter:
    """Return the event stream, guarded like the status page (``serving.status_page``)."""
    door = page_door(o.spec.serving.status_page for o in worker.orchestrators)
    router = APIRouter(dependencies=door)
    Gauge(
        "lifecycle_event_streams",
        "clients reading GET /v1/events now (open status pages)",
        registry=worker.metrics.registry,
    ).set_function(lambda: worker.board.subscribers)

    @router.get("/v1/events")
    async def events() -> StreamingResponse:
        return StreamingResponse(
            _stream(worker),
            media_type="text/event-stream",
            headers={"cache-control": "no-cache", "x-accel-buffering": "no"},
        )

    return router


async def _stream(worker: Worker) -> AsyncIterator[bytes]:
    """Yield one client's events until it disconnects, overflows, or the worker drains."""
    board = worker.board
    client = board.subscribe()
    try:
        yield f"retry: {RETRY_MS}\n\n".encode()
        while True:
            messages, stale, ended = await client.next()
            if client.overflowed:
                yield server_sent(msgspec.json.encode(Overflowed(limit=CLIENT_BUFFER)))
                return
            if stale:  # after the events that changed it: the page ends on the present
                messages.append(server_sent(msgspec.json.encode(worker_status(worker))))
            yield b"".join(messages)
            if ended:
                return
    finally:  # the client went away (the response is cancelled), or the stream ended
        board.unsubscribe(client)
