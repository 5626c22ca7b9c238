"""Hand a decoded request to the worker, and map what comes back to HTTP."""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec
from fastapi.responses import Response

from lifecycle.logs import get_logger
from lifecycle.refusals import RequestRefused, TransitionFailed, TransitionRefused
from lifecycle.serving.batcher import Draining, QueueFull
from lifecycle.serving.errors import ApiError
from lifecycle.serving.jobs import Job
from lifecycle.serving.worker import Phase, Worker

log = get_logger("lifecycle")


def check_ready(worker: Worker, model: str | None) -> None:
    if worker.phase is not Phase.READY:
        raise ApiError(
            503,
            f"the worker is {worker.phase.value}; retry once /readyz answers 200",
            kind="service_unavailable",
            code=worker.phase.value,
        )
    if model is not None and model != worker.name:
        raise ApiError(
            404,
            f"model '{model}' is not served here; this worker serves '{worker.name}'",
            param="model",
            code="model_not_found",
        )


def not_served(worker: Worker, what: str, example: str) -> ApiError:
    return ApiError(
        404,
        f"pipeline '{worker.name}' does not produce {what}; serve a pipeline that does, "
        f"such as {example}",
        code="endpoint_not_served",
    )


async def run_job(worker: Worker, job: Job) -> Job:
    """Queue ``job`` and wait for it; map the worker's errors to HTTP ones."""
    try:
        future = worker.submit(job)
    except QueueFull:
        raise ApiError(
            429,
            f"the queue is full (serving.max_queue = "
            f"{worker.orchestrator.spec.serving.max_queue} requests); retry later",
            kind="rate_limit_error",
            code="queue_full",
        ) from None
    except Draining:
        raise ApiError(
            503,
            "the worker is draining; send the request to another worker",
            kind="service_unavailable",
            code="draining",
        ) from None
    try:
        return await asyncio.wrap_future(future)
    except RequestRefused as err:  # the orchestrator's observer counted it (lifecycle.refused)
        raise ApiError(
            400,
            "; ".join(f"{r.message}; fix: {r.hint}" for r in err.refusals),
            param="attention_backend",
            code=err.refusals[0].code.value,
            extra={"refusals": [msgspec.to_builtins(r) for r in err.refusals]},
        ) from None
    except TransitionRefused as err:
        worker.metrics.refused(tuple(code.value for code in err.codes))
        raise ApiError(
            503,
            str(err),
            kind="service_unavailable",
            code=err.refusals[0].code.value if err.refusals else "refused",
        ) from None
    except TransitionFailed as err:
        log.error("serving.job_failed", request_id=job.id, error=str(err))
        raise ApiError(500, str(err), kind="server_error", code="transition_failed") from None


def job_response(content: dict[str, Any], done: Job) -> Response:
    """Answer ``content`` as JSON (msgspec: fast on long float lists) with the batch id."""
    return Response(
        msgspec.json.encode(content),
        media_type="application/json",
        headers={"x-batch-id": done.batch_id},
    )
