"""Hand a decoded request to the worker, and map what comes back to HTTP."""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import Future
from typing import Any

import msgspec
from fastapi.responses import Response
from starlette.types import Receive

from lifecycle.logs import get_logger
from lifecycle.refusals import RequestRefused, TransitionFailed, TransitionRefused
from lifecycle.serving.batcher import Draining, DuplicateRequest, QueueFull
from lifecycle.serving.errors import ApiError
from lifecycle.serving.jobs import Job, JobCancelled, RequestState, RequestStatus
from lifecycle.serving.served import ServedPipeline
from lifecycle.serving.worker import Asleep, Phase, UnknownModel, Worker

__all__ = [
    "check_finite",
    "check_ready",
    "gate_passed",
    "job_error",
    "job_response",
    "not_served",
    "request_timeout",
    "run_job",
    "submit_job",
    "unknown_model",
]

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


def request_timeout(served: ServedPipeline, priority: int, timeout: float | None) -> float:
    """Check a request's ``priority`` and ``timeout`` against ``[serving]``; return its timeout.

    Raises:
        ApiError: 400 naming the field and the key that bounds it.
    """
    settings = served.settings
    if priority > settings.max_priority:
        raise ApiError(
            400,
            f"priority {priority} is above serving.max_priority = {settings.max_priority}; "
            f"send 0 to {settings.max_priority} (higher first)",
            param="priority",
        )
    if timeout is not None and timeout > settings.max_request_seconds:
        raise ApiError(
            400,
            f"timeout {timeout:g} s is above serving.max_request_seconds = "
            f"{settings.max_request_seconds:g}; send at most that, or leave it out",
            param="timeout",
        )
    return settings.max_request_seconds if timeout is None else timeout


def submit_job(worker: Worker, served: ServedPipeline, job: Job) -> Future[Job]:
    """Queue ``job`` on ``served``; map the queue's refusals to HTTP errors."""
    try:
        return served.submit(job)
    except (QueueFull, DuplicateRequest, Draining) as err:
        raise job_error(worker, served, job, err) from None


async def gate_passed(worker: Worker, served: ServedPipeline, job: Job) -> ServedPipeline:
    """Wait at ``served``'s gate (see ``Worker.pass_gate``); return the pipeline open now."""
    try:
        return await worker.pass_gate(served, time.monotonic() + served.settings.wake_timeout)
    except (Asleep, UnknownModel, Draining) as err:
        raise job_error(worker, served, job, err) from None


async def run_job(
    worker: Worker, served: ServedPipeline, job: Job, receive: Receive, timeout: float
) -> Job:
    """Queue ``job`` on ``served`` once its gate is open, and wait for it; map the
    worker's errors to HTTP ones.

    The job is cancelled when its client disconnects (``receive`` says so) or after
    ``timeout`` seconds, and when the handler itself is cancelled (server shutdown),
    also while it waits at its pipeline's gate.
    """
    done = asyncio.ensure_future(worker.run(served, job))
    gone = asyncio.ensure_future(disconnected(receive))
    try:
        finished, _ = await asyncio.wait(
            (done, gone), timeout=timeout, return_when=asyncio.FIRST_COMPLETED
        )
    except asyncio.CancelledError:
        _cancel(worker, job, done, "disconnected")
        raise
    finally:
        gone.cancel()
    if done not in finished:
        reason = "disconnected" if gone in finished else "timeout"
        if _cancel(worker, job, done, reason) is None:  # it waited at the gate: never queued
            status = RequestStatus(id=job.id, state=RequestState.CANCELLED, steps=job.key.steps)
            raise job_error(worker, served, job, JobCancelled(job.id, reason, status))
    try:
        return await done
    except Exception as err:
        raise job_error(worker, served, job, err) from None


def _cancel(
    worker: Worker, job: Job, done: asyncio.Future[Job], reason: str
) -> RequestStatus | None:
    """Cancel ``job``: in its queue (its future then fails), or at its gate (the wait ends)."""
    found = worker.cancel(job.id, reason)
    if found is None:
        done.cancel()
    return found


async def disconnected(receive: Receive) -> None:
    """Return once the client has gone (the request body was read already)."""
    while (await receive())["type"] != "http.disconnect":
        pass


def job_error(worker: Worker, served: ServedPipeline, job: Job, err: Exception) -> Exception:
    """Return the HTTP error that answers a job that failed with ``err`` (else ``err``)."""
    if isinstance(err, QueueFull):
        return ApiError(
            429,
            f"the queue is full for priority {job.priority} (serving.max_queue = "
            f"{served.settings.max_queue} requests of each priority); retry later",
            kind="rate_limit_error",
            code="queue_full",
        )
    if isinstance(err, DuplicateRequest):
        return ApiError(
            409,
            f"a queued or running request already has the id {job.id!r}; send another "
            "x-request-id, or none and the worker assigns one",
            param="x-request-id",
            code="duplicate_request_id",
        )
    if isinstance(err, Draining):
        return ApiError(
            503,
            "the worker is draining; send the request to another worker",
            kind="service_unavailable",
            code="draining",
        )
    if isinstance(err, Asleep):
        return ApiError(
            503, f"{err}; retry later", kind="service_unavailable", code="pipeline.asleep"
        )
    if isinstance(err, UnknownModel):  # removed while the request waited
        return unknown_model(err)
    if isinstance(err, JobCancelled):
        status, code = CANCELLED_STATUS[err.reason]
        return ApiError(
            status,
            f"{err}; {CANCELLED_FIX[err.reason]}",
            kind="invalid_request_error" if status == 409 else "server_error",
            code=code,
            extra={"request": msgspec.to_builtins(err.status)},
        )
    if isinstance(err, RequestRefused):  # the orchestrator's observer counted it
        return ApiError(
            400,
            "; ".join(f"{r.message}; fix: {r.hint}" for r in err.refusals),
            param="attention_backend",
            code=err.refusals[0].code.value,
            extra={"refusals": [msgspec.to_builtins(r) for r in err.refusals]},
        )
    if isinstance(err, TransitionRefused):
        worker.metrics.refused(tuple(code.value for code in err.codes))
        return ApiError(
            503,
            str(err),
            kind="service_unavailable",
            code=err.refusals[0].code.value if err.refusals else "refused",
        )
    if isinstance(err, TransitionFailed):
        log.error("serving.job_failed", request_id=job.id, error=str(err))
        return ApiError(500, str(err), kind="server_error", code="transition_failed")
    return err


CANCELLED_STATUS = {
    "deleted": (409, "request_cancelled"),
    "timeout": (504, "request_timeout"),
    "disconnected": (499, "client_disconnected"),  # nobody reads it: the client left
}
"""The HTTP status and code of a job cancelled for each reason."""

CANCELLED_FIX = {
    "deleted": "DELETE /v1/requests/{id} cancelled it",
    "timeout": "send a larger timeout (at most serving.max_request_seconds), fewer steps, "
    "or retry when the worker is less busy",
    "disconnected": "the client disconnected",
}


def check_finite(done: Job) -> None:
    """Refuse to answer images made from NaN or infinite values (an all-black image).

    Raises:
        ApiError: 500, ``non_finite_output``.
    """
    if done.non_finite:
        raise ApiError(
            500,
            "the pipeline produced NaN or infinite values for this request, so no image "
            "is returned; a lower guidance_scale or fewer steps may keep it finite",
            kind="server_error",
            code="non_finite_output",
        )


def job_response(content: dict[str, Any], done: Job) -> Response:
    """Answer ``content`` as JSON (msgspec: fast on long float lists) with the batch id."""
    return Response(
        msgspec.json.encode(content),
        media_type="application/json",
        headers={"x-batch-id": done.batch_id},
    )
