"""``GET`` and ``DELETE /v1/requests/{id}``: where a request stands, and cancelling it."""

from __future__ import annotations

import msgspec
from fastapi import APIRouter
from fastapi.responses import Response

from lifecycle.serving.auth import API_KEY
from lifecycle.serving.errors import ApiError
from lifecycle.serving.jobs import RequestState, RequestStatus
from lifecycle.serving.worker import Worker
from lifecycle.shown import shown

__all__ = ["requests_routes"]


def requests_routes(worker: Worker) -> APIRouter:
    """Return the request status and cancel endpoints."""
    router = APIRouter()

    @router.get("/v1/requests/{request_id}", dependencies=API_KEY)
    async def status(request_id: str) -> Response:
        """Answer ``{"id", "state", "stage", "step", "steps", "queue_position"}``."""
        return _answer(_known(worker.status(request_id), request_id))

    @router.delete("/v1/requests/{request_id}", dependencies=API_KEY)
    async def cancel(request_id: str) -> Response:
        """Cancel a queued or running request; answer its status (state ``cancelled``).

        A request that is done already is answered 409 with its status.
        """
        found = _known(worker.cancel(request_id, "deleted"), request_id)
        if found.state is RequestState.DONE:
            raise ApiError(
                409,
                f"request {request_id!r} is done already; there is nothing to cancel",
                code="request_done",
                extra={"request": msgspec.to_builtins(found)},
            )
        return _answer(found)

    return router


def _known(found: RequestStatus | None, request_id: str) -> RequestStatus:
    if found is None:
        raise ApiError(
            404,
            f"no queued, running or recent request has the id {shown(request_id)}; ids are "
            "the x-request-id of the request's answer",
            param="request_id",
            code="request_not_found",
        )
    return found


def _answer(found: RequestStatus) -> Response:
    return Response(msgspec.json.encode(found), media_type="application/json")
