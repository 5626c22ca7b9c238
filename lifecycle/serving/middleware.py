"""Request ids and per-route metrics for every HTTP request (pure ASGI)."""

from __future__ import annotations

import time

import structlog
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from lifecycle.logs import get_logger
from lifecycle.serving.errors import server_error
from lifecycle.serving.worker import Worker

log = get_logger("lifecycle")


class RequestIds:
    """Give every request an id (``x-request-id``, bound in the logs) and count it.

    Pure ASGI, not ``BaseHTTPMiddleware``: it adds no task or stream per request.
    An exception no handler answered becomes a 500 error object, with the id.

    Args:
        app: the application it wraps.
        worker: the worker (ids, metrics).
    """

    def __init__(self, app: ASGIApp, worker: Worker) -> None:
        self.app = app
        self.worker = worker

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Serve one request with its id; count it by route and status."""
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        rid = self.worker.next_id()
        scope.setdefault("state", {})["id"] = rid
        started = time.perf_counter()
        status = 500
        answered = False

        async def send_with_id(message: Message) -> None:
            nonlocal status, answered
            if message["type"] == "http.response.start":
                status, answered = message["status"], True
                message["headers"] = [*message.get("headers", []), (b"x-request-id", rid.encode())]
            await send(message)

        # bind and reset rather than bound_contextvars(): no generator per request
        bound = structlog.contextvars.bind_contextvars(http_request_id=rid)
        try:
            await self.app(scope, receive, send_with_id)
        except Exception as err:
            log.error("serving.failed_request", error=f"{type(err).__name__}: {err}")
            if answered:
                raise
            await server_error(err)(scope, receive, send_with_id)
        finally:
            structlog.contextvars.reset_contextvars(**bound)
        endpoint = getattr(scope.get("route"), "path", "unrouted")  # bounded label values
        self.worker.metrics.observe_request(endpoint, status, time.perf_counter() - started)
