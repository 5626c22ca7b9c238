"""Health, readiness, metrics and what the worker serves: open to every client."""

from __future__ import annotations

from typing import Any

import msgspec
from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response

from lifecycle.serving.worker import Phase, Worker


def health_routes(worker: Worker) -> APIRouter:
    """Return ``/healthz``, ``/readyz``, ``/metrics``, ``/v1/models`` and ``/v1/pipeline``."""
    router = APIRouter()

    @router.get("/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @router.get("/readyz")
    async def readyz() -> JSONResponse:
        status = 200 if worker.phase is Phase.READY else 503
        body = {"status": worker.phase.value, "error": worker.error}
        return JSONResponse(body, status_code=status)

    @router.get("/metrics")
    async def prometheus() -> Response:
        return Response(worker.metrics.render(), media_type="text/plain; version=0.0.4")

    @router.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {
            "object": "list",
            "data": [{"id": worker.name, "object": "model", "created": 0, "owned_by": "lifecycle"}],
        }

    @router.get("/v1/pipeline")
    async def pipeline() -> Response:
        snapshot = msgspec.json.encode(worker.orchestrator.snapshot())
        return Response(snapshot, media_type="application/json")

    return router
