"""Request ids and per-route metrics for every HTTP request (pure ASGI)."""

from __future__ import annotations

import re
import time

import structlog
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from lifecycle.logs import get_logger
from lifecycle.serving.errors import ApiError, error_response, server_error
from lifecycle.serving.worker import Worker
from lifecycle.shown import shown

__all__ = ["RequestIds"]

log = get_logger("lifecycle")

CLIENT_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")
"""What a client's ``x-request-id`` may be (design §15)."""


class RequestIds:
    """Give every request an id (``x-request-id``, bound in the logs) and count it.

    The id is the client's ``x-request-id`` header when it sends one (1 to 128
    characters of ``[A-Za-z0-9._:-]``; anything else is answered 400), else one the
    worker assigns. A job's id must also be unique among the worker's live jobs
    (409 otherwise, when it is queued). Pure ASGI, not ``BaseHTTPMiddleware``: it adds
    no task or stream per request. An exception no handler answered becomes a 500
    error object, with the id.

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
        sent = _client_id(scope)
        rid = self.worker.next_id() if sent is None or not CLIENT_ID.fullmatch(sent) else sent
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
            if sent is not None and sent != rid:
                await error_response(_bad_id(sent))(scope, receive, send_with_id)
            else:
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


def _client_id(scope: Scope) -> str | None:
    """Return the ``x-request-id`` header the client sent, or None."""
    for name, value in scope["headers"]:
        if name == b"x-request-id":
            return str(value.decode("latin-1"))
    return None


def _bad_id(sent: str) -> ApiError:
    return ApiError(
        400,
        f"header x-request-id {shown(sent)} is not a request id: send 1 to 128 letters, digits "
        "or the characters . _ : - , or leave the header out and the worker assigns one",
        param="x-request-id",
        code="invalid_request_id",
    )
