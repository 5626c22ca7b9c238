"""Health, readiness and metrics, open to every client; what the worker serves, behind the key."""

from __future__ import annotations

from typing import Any

import msgspec
from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response

from lifecycle.serving.auth import API_KEY
from lifecycle.serving.dispatch import unknown_model
from lifecycle.serving.worker import Phase, UnknownModel, Worker

__all__ = ["health_routes"]


def health_routes(worker: Worker) -> APIRouter:
    """Return ``/healthz``, ``/readyz``, ``/metrics``, ``/v1/models`` and ``/v1/pipeline``."""
    router = APIRouter()

    @router.get("/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @router.get("/readyz")
    async def readyz() -> JSONResponse:
        status = 200 if worker.phase is Phase.READY else 503
        startup = msgspec.to_builtins(worker.startup)  # by pipeline, once each is served
        body = {"status": worker.phase.value, "error": worker.error, "startup": startup}
        return JSONResponse(body, status_code=status)

    @router.get("/metrics")
    async def prometheus() -> Response:
        return Response(worker.metrics.render(), media_type="text/plain; version=0.0.4")

    @router.get("/v1/models", dependencies=API_KEY)
    async def models() -> dict[str, Any]:
        return {
            "object": "list",
            "data": [
                {"id": name, "object": "model", "created": 0, "owned_by": "lifecycle"}
                for name in worker.names
            ],
        }

    @router.get("/v1/pipeline", dependencies=API_KEY)
    async def pipeline(model: str | None = None) -> Response:
        try:
            served = worker.resolve(model)
        except UnknownModel as err:
            raise unknown_model(err) from None
        snapshot = msgspec.json.encode(served.orchestrator.snapshot())
        return Response(snapshot, media_type="application/json")

    return router
