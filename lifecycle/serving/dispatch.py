"""Hand a decoded request to the worker, and map what comes back to HTTP."""

from __future__ import annotations

from typing import Any

import msgspec
from fastapi.responses import Response

from lifecycle.logs import get_logger
from lifecycle.refusals import RequestRefused, TransitionFailed, TransitionRefused
from lifecycle.serving.batcher import Draining, QueueFull
from lifecycle.serving.errors import ApiError
from lifecycle.serving.jobs import Job
from lifecycle.serving.served import ServedPipeline
from lifecycle.serving.worker import Asleep, Phase, UnknownModel, Worker

log = get_logger("lifecycle")


def check_ready(worker: Worker, model: str | None) -> ServedPipeline:
    """Return the pipeline ``model`` names (None: the only one), once the worker is ready."""
    if worker.phase is not Phase.READY:
        raise ApiError(
            503,
            f"the worker is {worker.phase.value}; retry once /readyz answers 200",
            kind="service_unavailable",
            code=worker.phase.value,
        )
    try:
        return worker.resolve(model)
    except UnknownModel as err:
        raise unknown_model(err) from None


def unknown_model(err: UnknownModel) -> ApiError:
    """Answer a request naming no served pipeline: 404, or 400 when it names none of several."""
    status = 400 if err.code == "model_required" else 404
    return ApiError(status, str(err), param="model", code=err.code)


def not_served(served: ServedPipeline, what: str, example: str) -> ApiError:
    return ApiError(
        404,
        f"pipeline '{served.name}' does not produce {what}; serve a pipeline that does, "
        f"such as {example}",
        code="endpoint_not_served",
    )


async def run_job(worker: Worker, served: ServedPipeline, job: Job) -> Job:
    """Queue ``job`` on ``served`` and wait for it; map the worker's errors to HTTP ones."""
    try:
        return await worker.run(served, job)
    except QueueFull:
        raise ApiError(
            429,
            f"the queue is full (serving.max_queue = {served.settings.max_queue} requests); "
            "retry later",
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
    except Asleep as err:
        raise ApiError(
            503, f"{err}; retry later", kind="service_unavailable", code="pipeline.asleep"
        ) from None
    except UnknownModel as err:  # removed while the request waited
        raise unknown_model(err) from None
    except RequestRefused as err:
        worker.metrics.refused(tuple(code.value for code in err.codes))
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
