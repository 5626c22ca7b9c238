"""Who may read the status page and its event stream: ``serving.status_page``.

``open``: every client, like ``/healthz``. ``private``: only a client that sends the
worker's API key as ``Authorization: Bearer KEY``. A browser sends no such header by
itself: put the page behind a proxy that adds it, or keep it open on a private network.

The key is read from ``LIFECYCLE_API_KEY`` when the routes are built; this is the
stand-in for the worker's ``--api-key`` (DESIGN §13), whose dependency replaces it.
"""

from __future__ import annotations

import hmac
import os
from collections.abc import Callable

from fastapi import Request

from lifecycle.serving.errors import ApiError
from lifecycle.serving.worker import Worker

API_KEY_ENV = "LIFECYCLE_API_KEY"


def status_access(worker: Worker) -> Callable[[Request], None]:
    """Return the dependency that lets a request read the status page, or answers 401/403."""
    # one page shows every pipeline: it is private when any of them says so
    private = any(o.spec.serving.status_page == "private" for o in worker.orchestrators)
    setting = "private" if private else "open"
    key = os.environ.get(API_KEY_ENV, "")
    expected = f"Bearer {key}".encode()

    def check(request: Request) -> None:
        if setting == "open":
            return
        if not key:
            raise ApiError(
                403,
                "serving.status_page is private, but the worker has no API key: set "
                f'{API_KEY_ENV}, or set serving.status_page = "open"',
                kind="permission_error",
                code="status_page_private",
            )
        sent = request.headers.get("authorization", "").encode()
        if not hmac.compare_digest(sent, expected):
            raise ApiError(
                401,
                "the status page is private (serving.status_page): send the worker's API "
                "key as 'Authorization: Bearer KEY'",
                kind="authentication_error",
                code="invalid_api_key",
            )

    return check
