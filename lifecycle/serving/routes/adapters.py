"""``/v1/adapters``: list the pipeline's adapters (LoRA), add and remove them at run time.

``GET`` answers ``{"data": [{"name", "component", "state", "mode", "scale",
"merged_scale"}], "switches"}``. ``POST`` (an ``[adapters.NAME]`` table with its
``name``) admits and loads one; ``DELETE /v1/adapters/{name}`` unmerges or detaches
it once no request uses its component, and releases it. Both change what requests
may name, so they need the admin key (``LIFECYCLE_ADMIN_KEY``, sent as
``Authorization: Bearer``): without one configured they are disabled (403). A refused
adapter is a 409 with the refusals; nothing stays of it.
"""

from __future__ import annotations

import hmac
import os
from collections.abc import Mapping

import msgspec
from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response
from starlette.concurrency import run_in_threadpool

from lifecycle.config import AdapterSpec
from lifecycle.refusals import TransitionRefused
from lifecycle.serving.bodies import AdapterBody, decode_body, documented
from lifecycle.serving.errors import ApiError
from lifecycle.serving.worker import Worker

ADMIN_KEY_VARIABLE = "LIFECYCLE_ADMIN_KEY"
ADAPTER_BODY = msgspec.json.Decoder(AdapterBody)


def require_admin(request: Request) -> None:
    """Let only a request carrying the admin key through (403 without one configured)."""
    key = os.environ.get(ADMIN_KEY_VARIABLE)
    if not key:
        raise ApiError(
            403,
            f"adding and removing adapters is disabled: set {ADMIN_KEY_VARIABLE} for the "
            "worker and send it as 'Authorization: Bearer <admin key>'",
            code="admin_disabled",
        )
    offered = request.headers.get("authorization", "").removeprefix("Bearer ")
    if not hmac.compare_digest(offered.encode(), key.encode()):
        raise ApiError(401, "a missing or wrong admin key", code="invalid_admin_key")


def adapters_routes(worker: Worker) -> APIRouter:
    """Return the adapter endpoints."""
    router = APIRouter()
    orchestrator = worker.orchestrator

    @router.get("/v1/adapters")
    async def listed() -> Response:
        views = orchestrator.adapters()
        body = {"data": views, "switches": orchestrator.adapter_switches}
        return Response(msgspec.json.encode(body), media_type="application/json")

    @router.post(
        "/v1/adapters",
        dependencies=[Depends(require_admin)],
        openapi_extra=documented(AdapterBody),
    )
    async def add(request: Request) -> Response:
        body = decode_body(ADAPTER_BODY, await request.body())
        spec = AdapterSpec(
            path=body.path,
            component=msgspec.UNSET if body.component is None else body.component,
            scale=body.scale,
            mode=body.mode,
        )
        try:
            view = await run_in_threadpool(orchestrator.add_adapter, body.name, spec)
        except TransitionRefused as err:
            raise _refused(err) from None
        except (ValueError, LookupError) as err:
            raise ApiError(409, str(err), param="name", code="adapter_not_added") from None
        return Response(msgspec.json.encode(view), media_type="application/json")

    @router.delete("/v1/adapters/{name}", dependencies=[Depends(require_admin)])
    async def remove(name: str) -> Response:
        try:
            await run_in_threadpool(orchestrator.remove_adapter, name)
        except KeyError as err:
            raise ApiError(404, err.args[0], param="name", code="adapter_not_found") from None
        except TransitionRefused as err:
            raise _refused(err) from None
        return Response(msgspec.json.encode({"name": name, "removed": True}))

    return router


def adapter_set(
    worker: Worker, lora: Mapping[str, float | None] | None
) -> tuple[tuple[str, float], ...]:
    """Return a request's ``lora`` as a batch key's adapter set (400 naming the known ones)."""
    if not lora:
        return ()
    views = {view.name: view for view in worker.orchestrator.adapters()}
    usable = sorted(
        name for name, view in views.items() if view.state.value in ("loaded", "active")
    )
    for name in lora:
        if name not in usable:
            raise ApiError(
                400,
                f"unknown adapter {name!r} in lora; known adapters: {', '.join(usable) or 'none'}",
                param="lora",
                code="unknown_adapter",
            )
    return tuple(
        sorted(
            (name, views[name].scale if scale is None else scale) for name, scale in lora.items()
        )
    )


def _refused(err: TransitionRefused) -> ApiError:
    return ApiError(
        409,
        str(err),
        code=err.refusals[0].code.value if err.refusals else "refused",
        extra={"refusals": msgspec.to_builtins(err.refusals)},
    )
