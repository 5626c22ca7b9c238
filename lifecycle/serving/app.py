"""The OpenAI-compatible HTTP surface of the worker (FastAPI), assembled from its routes.

``POST /v1/embeddings``, ``POST /v1/images/generations`` and ``POST /v1/videos``
queue jobs on the worker's batcher (a video is followed, fetched and deleted at
``/v1/videos/{id}``); ``GET /v1/models``, ``/v1/pipeline``, ``/healthz``, ``/readyz``
and ``/metrics`` read its state; ``GET`` and ``DELETE /v1/requests/{id}`` follow and
cancel a job; ``GET /`` (``/status``) is the status page, live from ``GET /v1/events``.
Errors are OpenAI error objects: 400 for bad input, a refused override or a request
over a ``[serving]`` bound, 401 without the API key (``serving.auth``), 404 for an
endpoint the pipeline does not serve, 409 for a request id already in use (or a
request cancelled by DELETE), 413 and 415 for a body too large or not JSON, 429 when
the queue of the request's priority is full, 503 while starting or draining, 504 past
the request's timeout. Every response carries the request id (``x-request-id``: the
client's own, else one the worker assigns) that the logs use; jobs that shared a
batch ran as one orchestrator request whose id joins theirs (``x-batch-id``).
"""

from __future__ import annotations

from fastapi import FastAPI

from lifecycle.serving.auth import DoorKeys
from lifecycle.serving.errors import add_error_handler
from lifecycle.serving.limits import BodyLimits
from lifecycle.serving.middleware import RequestIds
from lifecycle.serving.routes.adapters import adapters_routes
from lifecycle.serving.routes.embeddings import embeddings_routes
from lifecycle.serving.routes.events import events_routes
from lifecycle.serving.routes.health import health_routes
from lifecycle.serving.routes.images import images_routes
from lifecycle.serving.routes.pipelines import pipelines_routes
from lifecycle.serving.routes.requests import requests_routes
from lifecycle.serving.routes.status import status_routes
from lifecycle.serving.routes.videos import videos_routes
from lifecycle.serving.worker import Worker

__all__ = ["create_app"]


def create_app(worker: Worker, keys: DoorKeys | None = None) -> FastAPI:
    """Build the FastAPI app serving ``worker``'s pipelines, its door locked with ``keys``."""
    title = f"lifecycle serve: {', '.join(worker.names)}"
    app = FastAPI(title=title, docs_url=None, redoc_url=None)
    app.state.door = keys or DoorKeys()
    # the last added runs first: every answer, a refused body's too, carries its id
    app.add_middleware(BodyLimits, limit=worker.bounds.max_body_bytes)
    app.add_middleware(RequestIds, worker=worker)
    add_error_handler(app)
    for routes in (
        health_routes,
        embeddings_routes,
        images_routes,
        videos_routes,
        requests_routes,
        status_routes,
        events_routes,
        pipelines_routes,
        adapters_routes,
    ):
        app.include_router(routes(worker))
    return app
