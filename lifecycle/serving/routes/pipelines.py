"""``/v1/pipelines``: what the worker serves, and the admin routes that change it (design §13).

``GET /v1/pipelines`` lists every pipeline with its state and its components' users.
The routes that change pipelines (add, remove, sleep, wake, reload) are admin routes:
they sit behind ``lifecycle.serving.auth.require_admin`` (the admin key), the
listing behind the API key. A trigger not valid from the pipeline's state and a
guard that says no are answered 409 with the refusal objects; a swap whose new pipeline
failed to load is answered 500 with ``"restored": true`` and the cause once the old one
serves again.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import msgspec
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from lifecycle.refusals import InvalidTransition, Refused, TransitionFailed, TransitionRefused
from lifecycle.serving import changes
from lifecycle.serving.auth import ADMIN, API_KEY
from lifecycle.serving.bodies import PipelineBody, decode_body, documented
from lifecycle.serving.dispatch import unknown_model
from lifecycle.serving.errors import ApiError
from lifecycle.serving.worker import Phase, UnknownModel, Worker
from lifecycle.spec.errors import ConfigError

__all__ = ["pipelines_routes"]

T = TypeVar("T")

PIPELINE_BODY = msgspec.json.Decoder(PipelineBody)


def pipelines_routes(worker: Worker) -> APIRouter:
    """Return ``GET /v1/pipelines`` and the admin routes that change pipelines."""
    router = APIRouter()
    admin = ADMIN

    @router.get("/v1/pipelines", dependencies=API_KEY)
    async def listing() -> dict[str, Any]:
        return worker.listing()

    @router.post("/v1/pipelines", dependencies=admin, openapi_extra=documented(PipelineBody))
    async def add(request: Request) -> JSONResponse:
        body = decode_body(PIPELINE_BODY, await request.body())
        outcome = await _changing(worker, lambda: changes.add(worker, Path(body.path)))
        return _answer(outcome, 201 if outcome.action == "added" else 200)

    @router.delete("/v1/pipelines/{name}", dependencies=admin)
    async def remove(name: str) -> JSONResponse:
        return _answer(await _changing(worker, lambda: changes.remove(worker, name)))

    @router.post("/v1/pipelines/{name}/reload", dependencies=admin)
    async def reload(name: str) -> JSONResponse:
        return _answer(await _changing(worker, lambda: changes.reload(worker, name)))

    @router.post("/v1/pipelines/{name}/sleep", dependencies=admin)
    async def sleep(name: str) -> dict[str, str]:
        served = await _changing(worker, lambda: worker.sleep(name))
        return {"name": served.name, "state": served.state.value}

    @router.post("/v1/pipelines/{name}/wake", dependencies=admin)
    async def wake(name: str) -> dict[str, str]:
        served = await _changing(worker, lambda: worker.wake(name))
        return {"name": served.name, "state": served.state.value}

    return router


async def _changing(worker: Worker, change: Callable[[], T]) -> T:
    """Run ``change`` on a thread (it may drain and load) once the worker is ready; map what
    it raises to HTTP."""
    if worker.phase is not Phase.READY:
        raise ApiError(
            503,
            f"the worker is {worker.phase.value}: its pipelines change only while it serves",
            kind="service_unavailable",
            code=worker.phase.value,
        )
    try:
        return await asyncio.to_thread(change)
    except UnknownModel as err:
        raise unknown_model(err) from None
    except ConfigError as err:
        raise ApiError(400, str(err), param="path", code="invalid_spec") from None
    except InvalidTransition as err:
        raise _conflict(err, "invalid_transition") from None
    except TransitionRefused as err:
        raise _conflict(err, err.refusals[0].code.value if err.refusals else "refused") from None
    except TransitionFailed as err:
        cause = err.__cause__
        if isinstance(cause, Refused):  # a guard's refusal met while the work ran (a wake)
            raise _conflict(cause, cause.refusals[0].code.value, str(err)) from None
        raise ApiError(500, str(err), kind="server_error", code="transition_failed") from None
    except changes.RestoreFailed as err:
        raise ApiError(500, str(err), kind="server_error", code="restore_failed") from None
    except ValueError as err:  # a pipeline not read from a file has nothing to reload
        raise ApiError(400, str(err), code="invalid_request") from None


def _conflict(err: Refused, code: str, message: str | None = None) -> ApiError:
    """Answer a refusal: 409 with every refusal object."""
    return ApiError(
        409,
        message or str(err),
        code=code,
        extra={"refusals": [msgspec.to_builtins(r) for r in err.refusals]},
    )


def _answer(outcome: changes.ChangeOutcome, status: int = 200) -> JSONResponse:
    """Answer a change; one whose new pipeline failed (the old one restored) is a 500."""
    body = msgspec.to_builtins(outcome)
    if outcome.restored:
        error = {
            "message": f"the new pipeline '{outcome.name}' failed to load; the old one was "
            f"loaded again and serves: {outcome.cause}",
            "type": "server_error",
            "param": None,
            "code": "restored",
        }
        return JSONResponse({"error": error, **body}, status_code=500)
    return JSONResponse(body, status_code=status)
