"""The OpenAI-compatible HTTP surface of the worker (FastAPI).

``POST /v1/embeddings`` and ``POST /v1/images/generations`` queue jobs on the
worker's batcher; ``GET /v1/models``, ``/v1/pipeline``, ``/healthz``, ``/readyz``
and ``/metrics`` read its state. Errors are OpenAI error objects: 400 for bad input
or a refused override, 404 for an endpoint the pipeline does not serve, 429 when
the queue is full, 503 while starting or draining. Every response carries the
request id (``x-request-id``) that the logs use; jobs that shared a batch ran as
one orchestrator request whose id joins theirs (``x-batch-id``).
"""

from __future__ import annotations

import asyncio
import base64
import re
import secrets
import time
from typing import Annotated, Any, Literal, TypeVar

import msgspec
import structlog
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from msgspec import Meta
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from lifecycle.logs import get_logger
from lifecycle.png import encode_png
from lifecycle.refusals import RequestRefused, TransitionFailed, TransitionRefused
from lifecycle.serving.batcher import Draining, QueueFull
from lifecycle.serving.jobs import BatchKey, Job, estimate_tokens
from lifecycle.serving.worker import Phase, Worker

log = get_logger("lifecycle")

DEFAULT_LATENT_SIDE = 4
"""The latent grid side of an image when the request gives no ``size``."""

EMBEDDINGS = BatchKey(endpoint="embeddings")
"""Every embeddings job's batch key: any two may share a batch."""


class EmbeddingsBody(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The body of ``POST /v1/embeddings`` (OpenAI's fields this worker honours)."""

    input: str | Annotated[list[str], Meta(min_length=1)]
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    user: str | None = None


class ImagesBody(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The body of ``POST /v1/images/generations``, with this worker's extra fields."""

    prompt: str
    model: str | None = None
    n: Annotated[int, Meta(ge=1)] = 1
    size: str | None = None
    response_format: Literal["b64_json"] = "b64_json"
    user: str | None = None
    steps: Annotated[int, Meta(ge=1, le=1000)] = 4
    seed: Annotated[int, Meta(ge=0, le=2**63 - 1)] | None = None
    guidance_scale: Annotated[float, Meta(ge=0)] = 1.0
    negative_prompt: str | None = None
    attention_backend: str | None = None


Body = TypeVar("Body", EmbeddingsBody, ImagesBody)

EMBEDDINGS_BODY = msgspec.json.Decoder(EmbeddingsBody)
IMAGES_BODY = msgspec.json.Decoder(ImagesBody)
_AT_FIELD = re.compile(r"at `\$\.(\w+)|field `(\w+)`")
"""The body field a msgspec error names: ``... - at `$.n` `` or ``unknown field `colour` ``."""


class ApiError(Exception):
    """An error answered as OpenAI's error object.

    Args:
        status: the HTTP status.
        message: what is wrong and how to fix it.
        kind: OpenAI's error ``type``.
        code: a stable code (a refusal code where there is one).
        param: the body field at fault, if any.
        extra: more fields for the error object (e.g. the refusals).
    """

    def __init__(
        self,
        status: int,
        message: str,
        *,
        kind: str = "invalid_request_error",
        code: str | None = None,
        param: str | None = None,
        extra: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.body = {"message": message, "type": kind, "param": param, "code": code}
        self.body.update(extra or {})


def create_app(worker: Worker) -> FastAPI:
    """Build the FastAPI app serving ``worker``'s pipeline."""
    app = FastAPI(title=f"lifecycle serve: {worker.name}", docs_url=None, redoc_url=None)
    metrics = worker.metrics

    app.add_middleware(RequestIds, worker=worker)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, err: ApiError) -> JSONResponse:
        headers = {"retry-after": "1"} if err.status in (429, 503) else None
        return JSONResponse({"error": err.body}, status_code=err.status, headers=headers)

    @app.get("/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/readyz")
    async def readyz() -> JSONResponse:
        status = 200 if worker.phase is Phase.READY else 503
        body = {"status": worker.phase.value, "error": worker.error}
        return JSONResponse(body, status_code=status)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {
            "object": "list",
            "data": [{"id": worker.name, "object": "model", "created": 0, "owned_by": "lifecycle"}],
        }

    @app.get("/v1/pipeline")
    async def pipeline() -> Response:
        snapshot = msgspec.json.encode(worker.orchestrator.snapshot())
        return Response(snapshot, media_type="application/json")

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4")

    @app.post("/v1/embeddings", openapi_extra=_documented(EmbeddingsBody))
    async def embeddings(request: Request) -> Response:
        body = _decode(EMBEDDINGS_BODY, await request.body())
        _check_ready(worker, body.model)
        if not worker.shapes.embeddings:
            raise _not_served(worker, "sentence embeddings", "examples/minilm_embed.toml")
        prompts = [body.input] if isinstance(body.input, str) else body.input
        job = Job(
            id=request.state.id,
            key=EMBEDDINGS,
            prompts=prompts,
            tokens=estimate_tokens(prompts),
        )
        done = await _run(worker, job)
        assert done.output is not None
        rows = _encoded_rows(done.output, body.encoding_format)
        data = [{"object": "embedding", "index": i, "embedding": row} for i, row in enumerate(rows)]
        usage = {"prompt_tokens": done.prompt_tokens, "total_tokens": done.prompt_tokens}
        content = {"object": "list", "data": data, "model": worker.name, "usage": usage}
        return _json(content, done)

    @app.post("/v1/images/generations", openapi_extra=_documented(ImagesBody))
    async def images(request: Request) -> Response:
        body = _decode(IMAGES_BODY, await request.body())
        _check_ready(worker, body.model)
        if not worker.shapes.images:
            raise _not_served(worker, "images", "examples/tiny_t2i.toml")
        latent_size = _latent_size(worker, body.size, body.n)
        seed = secrets.randbelow(2**31) if body.seed is None else body.seed
        key = BatchKey(
            endpoint="images",
            steps=body.steps,
            guidance_scale=body.guidance_scale,
            attention_backend=body.attention_backend,
            latent_size=latent_size,
            negative=body.negative_prompt is not None,
        )
        job = Job(
            id=request.state.id,
            key=key,
            prompts=[body.prompt] * body.n,
            negative_prompt=body.negative_prompt,
            tokens=body.n * latent_size[0] * latent_size[1],
            seed=seed,
        )
        done = await _run(worker, job)
        assert done.output is not None
        data = [{"b64_json": base64.b64encode(encode_png(image)).decode()} for image in done.output]
        content = {"created": int(time.time()), "data": data, "seed": seed}
        return _json(content, done)

    return app


class RequestIds:
    """Give every request an id (``x-request-id``, bound in the logs) and count it.

    Pure ASGI, not ``BaseHTTPMiddleware``: it adds no task or stream per request.
    An exception no handler answered becomes a 500 error object, with the id.

    Args:
        app: the application it wraps.
        worker: the worker (ids, metrics).
    """

    def __init__(self, app: ASGIApp, worker: Worker) -> None:
        self.app = app
        self.worker = worker

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Serve one request with its id; count it by route and status."""
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        rid = self.worker.next_id()
        scope.setdefault("state", {})["id"] = rid
        started = time.perf_counter()
        status = 500
        answered = False

        async def send_with_id(message: Message) -> None:
            nonlocal status, answered
            if message["type"] == "http.response.start":
                status, answered = message["status"], True
                message["headers"] = [*message.get("headers", []), (b"x-request-id", rid.encode())]
            await send(message)

        # bind and reset rather than bound_contextvars(): no generator per request
        bound = structlog.contextvars.bind_contextvars(http_request_id=rid)
        try:
            await self.app(scope, receive, send_with_id)
        except Exception as err:
            log.error("serving.failed_request", error=f"{type(err).__name__}: {err}")
            if answered:
                raise
            await _failure(err)(scope, receive, send_with_id)
        finally:
            structlog.contextvars.reset_contextvars(**bound)
        endpoint = getattr(scope.get("route"), "path", "unrouted")  # bounded label values
        self.worker.metrics.observe_request(endpoint, status, time.perf_counter() - started)


def _json(content: dict[str, Any], done: Job) -> Response:
    """Answer ``content`` as JSON (msgspec: fast on long float lists) with the batch id."""
    return Response(
        msgspec.json.encode(content),
        media_type="application/json",
        headers={"x-batch-id": done.batch_id},
    )


def _failure(err: Exception) -> JSONResponse:
    body = {
        "message": f"{type(err).__name__}: {err}",
        "type": "server_error",
        "param": None,
        "code": "internal_error",
    }
    return JSONResponse({"error": body}, status_code=500)


def _check_ready(worker: Worker, model: str | None) -> None:
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


def _not_served(worker: Worker, what: str, example: str) -> ApiError:
    return ApiError(
        404,
        f"pipeline '{worker.name}' does not produce {what}; serve a pipeline that does, "
        f"such as {example}",
        code="endpoint_not_served",
    )


def _latent_size(worker: Worker, size: str | None, n: int) -> tuple[int, int]:
    """Return the latent grid of ``size`` ("WxH"), checked against the pipeline's range."""
    scale = worker.shapes.image_scale
    settings = worker.orchestrator.spec.serving
    if size is None:
        return DEFAULT_LATENT_SIDE, DEFAULT_LATENT_SIDE
    width, _, height = size.partition("x")
    if not (width.isdigit() and height.isdigit()):
        raise ApiError(400, f"size '{size}' is not WIDTHxHEIGHT, e.g. '16x16'", param="size")
    w, h = int(width), int(height)
    largest = settings.max_batch_tokens // n
    if w % scale or h % scale or not w or not h or (w // scale) * (h // scale) > largest:
        raise ApiError(
            400,
            f"size '{size}' is outside this pipeline's range: width and height must be "
            f"positive multiples of {scale} pixels, with (width/{scale}) x (height/{scale}) "
            f"x n at most serving.max_batch_tokens = {settings.max_batch_tokens}",
            param="size",
        )
    return h // scale, w // scale


def _encoded_rows(output: Any, encoding_format: str) -> list[list[float]] | list[str]:
    """Return each embedding ``(B, E)`` row as floats, or as base64 of little-endian float32."""
    if encoding_format == "base64":
        raw = output.float().numpy().astype("<f4")
        return [base64.b64encode(row.tobytes()).decode() for row in raw]
    rows: list[list[float]] = output.tolist()  # one call: iterating the tensor costs more
    return rows


def _decode(decoder: msgspec.json.Decoder[Body], raw: bytes) -> Body:
    """Decode a request body; a bad one is a 400 naming the field (msgspec's message)."""
    try:
        return decoder.decode(raw)
    except msgspec.DecodeError as err:  # ValidationError included
        found = _AT_FIELD.search(str(err))
        raise ApiError(
            400,
            f"bad request body: {err}",
            param=next((name for name in found.groups() if name), None) if found else None,
            code="invalid_body",
        ) from None


def _documented(body_type: type[msgspec.Struct]) -> dict[str, Any]:
    """Return the OpenAPI ``requestBody`` of a route that decodes ``body_type`` itself."""
    _, components = msgspec.json.schema_components([body_type])
    schema = components[body_type.__name__]  # flat: no references to resolve
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


async def _run(worker: Worker, job: Job) -> Job:
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
