"""Bounds on a connection that uvicorn's httptools protocol does not set itself.

uvicorn closes an idle keep-alive connection (``timeout_keep_alive``) and answers
503 beyond ``limit_concurrency``, but that count is taken once a request's headers
have arrived; with httptools it caps neither the size of the headers nor the time a
client may take to send them or its body. A client that opens connections and
trickles a byte at a time (slowloris) is never closed. ``guarded_protocol`` adds:

- ``serving.max_header_bytes``: a request line and headers beyond it are answered
  431 and the connection closed, having buffered at most that much;
- ``serving.header_timeout``: a client has that long, from connecting or from its
  first byte after a response, to finish its headers; else 408 and closed;
- ``serving.body_timeout``: once its headers arrived, that long to send the whole
  body; else the connection is closed (the application sees a disconnect);
- ``serving.max_connections``: a connection beyond it is answered 503 and closed as
  it is accepted.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from enum import Enum
from typing import Any, ClassVar

import msgspec
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from lifecycle.spec.structs import ServingConfig

__all__ = ["guarded_protocol"]


class _Reading(Enum):
    HEAD = "head"  # a request line and headers, counted and timed
    BODY = "body"  # a body, timed
    IDLE = "idle"  # between requests: uvicorn's keep-alive timeout applies


class GuardedHttpTools(HttpToolsProtocol):
    """uvicorn's httptools protocol with header, body and connection bounds.

    ``guarded_protocol`` makes the subclass that carries the settings.
    """

    settings: ClassVar[ServingConfig] = ServingConfig()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._reading = _Reading.HEAD
        self._head_bytes = 0
        self._deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        """Accept the connection within ``max_connections``; start the header clock."""
        super().connection_made(transport)
        if len(self.connections) > self.settings.max_connections:
            self._refuse(
                503,
                "service_unavailable",
                f"the worker holds serving.max_connections = {self.settings.max_connections} "
                "connections; retry later",
            )
            return
        self._start_head()

    def connection_lost(self, exc: Exception | None) -> None:
        """Stop the clock, then let uvicorn tidy up."""
        self._stop_clock()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        """Feed the parser; a head that grows past ``max_header_bytes`` is refused."""
        if self._reading is _Reading.IDLE:
            self._start_head()  # a new request begins: its headers are on the clock
        if self._reading is not _Reading.HEAD:
            super().data_received(data)
            return
        room = self.settings.max_header_bytes - self._head_bytes
        self._head_bytes += min(len(data), room)
        # feed at most what the head may take: if the head ends inside, the rest is body
        super().data_received(data[:room])
        if self.transport.is_closing():
            return
        if self._reading is _Reading.HEAD and len(data) > room:
            self._refuse(
                431,
                "request_header_fields_too_large",
                f"the request line and headers exceed serving.max_header_bytes = "
                f"{self.settings.max_header_bytes} bytes",
            )
        elif len(data) > room:
            super().data_received(data[room:])

    def on_headers_complete(self) -> None:
        """Stop the header clock and start the body's (a request without one completes now)."""
        self._reading = _Reading.BODY
        self._start_clock(self.settings.body_timeout, self._body_timed_out)
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        """Stop the body clock: the request is read whole."""
        self._reading = _Reading.IDLE
        self._stop_clock()
        super().on_message_complete()

    # -- the clock -------------------------------------------------------------

    def _start_head(self) -> None:
        self._reading = _Reading.HEAD
        self._head_bytes = 0
        self._start_clock(self.settings.header_timeout, self._head_timed_out)

    def _start_clock(self, seconds: float, expired: Callable[[], None]) -> None:
        self._stop_clock()
        self._deadline = self.loop.call_later(seconds, expired)

    def _stop_clock(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _head_timed_out(self) -> None:
        self._refuse(
            408,
            "request_timeout",
            f"the request line and headers took longer than serving.header_timeout = "
            f"{self.settings.header_timeout} s",
        )

    def _body_timed_out(self) -> None:
        # the application is reading the body: closing tells it the client is gone
        if not self.transport.is_closing():
            self.transport.close()

    def _refuse(self, status: int, code: str, message: str) -> None:
        """Answer ``status`` as an OpenAI error object and close, outside any request."""
        self._stop_clock()
        if self.transport.is_closing():
            return
        body = msgspec.json.encode(
            {
                "error": {
                    "message": message,
                    "type": "invalid_request_error",
                    "param": None,
                    "code": code,
                }
            }
        )
        reason = {408: "Request Timeout", 431: "Request Header Fields Too Large"}.get(
            status, "Service Unavailable"
        )
        head = (
            f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
        )
        self.transport.write(head.encode("ascii") + body)
        self.transport.close()


def guarded_protocol(settings: ServingConfig) -> type[GuardedHttpTools]:
    """Return the protocol class for uvicorn's ``http`` setting, bound by ``settings``."""
    return type("ServingHttpTools", (GuardedHttpTools,), {"settings": settings})
