"""``/v1/adapters``: list the pipeline's adapters (LoRA), add and remove them at run time.

``GET`` answers ``{"data": [{"pipeline", "name", "component", "state", "mode",
"scale", "path", "merged_scale", "switches"}]}`` over every pipeline served. ``POST`` (an
``[adapters.NAME]`` table with its ``name``, and ``model``: the pipeline, needed when
several are served; its ``path`` is a file on the worker's disk, a relative one read from
the worker's working directory, and a missing one is a 400) admits and loads one;
``DELETE /v1/adapters/{name}[?model=]`` unmerges or detaches it once no request uses its
component, and releases it. Both change what requests may name: they are admin routes
(``require_admin``, as the pipeline routes). A refused adapter is a 409 with the
refusals; nothing stays of it.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import msgspec
from fastapi import APIRouter, Request
from fastapi.responses import Response
from starlette.concurrency import run_in_threadpool

from lifecycle.refusals import TransitionRefused
from lifecycle.serving.auth import ADMIN, API_KEY
from lifecycle.serving.bodies import AdapterBody, decode_body, documented
from lifecycle.serving.dispatch import check_ready
from lifecycle.serving.errors import ApiError
from lifecycle.serving.served import ServedPipeline
from lifecycle.serving.worker import Worker
from lifecycle.shown import shown
from lifecycle.spec.reading import adapter_file
from lifecycle.spec.structs import AdapterSpec

__all__ = ["adapter_set", "adapters_routes"]

ADAPTER_BODY = msgspec.json.Decoder(AdapterBody)


def adapters_routes(worker: Worker) -> APIRouter:
    """Return the adapter endpoints."""
    router = APIRouter()
    admin = ADMIN

    @router.get("/v1/adapters", dependencies=API_KEY)
    async def listed() -> Response:
        data = [
            {"pipeline": served.name, **msgspec.to_builtins(view)}
            for served in worker.served()
            for view in served.orchestrator.adapters()
        ]
        return Response(msgspec.json.encode({"data": data}), media_type="application/json")

    @router.post(
        "/v1/adapters",
        dependencies=admin,
        openapi_extra=documented(AdapterBody),
    )
    async def add(request: Request) -> Response:
        body = decode_body(ADAPTER_BODY, await request.body())
        orchestrator = check_ready(worker, body.model).orchestrator
        try:  # a path on the worker's disk, as POST /v1/pipelines takes one
            path = adapter_file(body.path, Path())
        except ValueError as err:
            raise ApiError(
                400,
                f"{err}; a relative path is read from the worker's working directory",
                param="path",
                code="adapter_file_missing",
            ) from None
        spec = AdapterSpec(
            path=path,
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

    @router.delete("/v1/adapters/{name}", dependencies=admin)
    async def remove(name: str, model: str | None = None) -> Response:
        orchestrator = check_ready(worker, model).orchestrator
        try:
            await run_in_threadpool(orchestrator.remove_adapter, name)
        except KeyError as err:
            raise ApiError(404, err.args[0], param="name", code="adapter_not_found") from None
        except TransitionRefused as err:
            raise _refused(err) from None
        return Response(msgspec.json.encode({"name": name, "removed": True}))

    return router


def adapter_set(
    served: ServedPipeline, lora: Mapping[str, float | None] | None
) -> tuple[tuple[str, float], ...]:
    """Return a request's ``lora`` as a batch key's adapter set (400 naming the known ones)."""
    if not lora:
        return ()
    views = {view.name: view for view in served.orchestrator.adapters()}
    usable = sorted(
        name for name, view in views.items() if view.state.value in ("loaded", "active")
    )
    for name in lora:
        if name not in usable:
            raise ApiError(
                400,
                f"unknown adapter {shown(name)} in lora; known adapters: "
                f"{', '.join(usable) or 'none'}",
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
