"""``POST /v1/embeddings``: sentence embeddings, OpenAI's shape."""

from __future__ import annotations

import base64
from typing import Any

import msgspec
from fastapi import APIRouter, Request
from fastapi.responses import Response

from lifecycle.serving.auth import API_KEY
from lifecycle.serving.bodies import EmbeddingsBody, decode_body, documented
from lifecycle.serving.dispatch import (
    check_ready,
    job_response,
    not_served,
    request_timeout,
    run_job,
)
from lifecycle.serving.jobs import BatchKey, Job, estimate_tokens
from lifecycle.serving.limits import check_embeddings
from lifecycle.serving.worker import Worker

__all__ = ["embeddings_routes"]

EMBEDDINGS = BatchKey(endpoint="embeddings")
"""Every embeddings job's batch key: any two may share a batch."""

EMBEDDINGS_BODY = msgspec.json.Decoder(EmbeddingsBody)


def embeddings_routes(worker: Worker) -> APIRouter:
    """Return the embeddings endpoint."""
    router = APIRouter()

    @router.post("/v1/embeddings", openapi_extra=documented(EmbeddingsBody), dependencies=API_KEY)
    async def embeddings(request: Request) -> Response:
        body = decode_body(EMBEDDINGS_BODY, await request.body())
        served = check_ready(worker, body.model)
        prompts = check_embeddings(body, served.settings)
        if not served.shapes.embeddings:
            raise not_served(served, "sentence embeddings", "examples/minilm_embed.toml")
        timeout = request_timeout(served, body.priority, body.timeout)
        job = Job(
            id=request.state.id,
            key=EMBEDDINGS,
            prompts=prompts,
            tokens=estimate_tokens(prompts),
            priority=body.priority,
        )
        done = await run_job(worker, served, job, request.receive, timeout)
        assert done.output is not None
        rows = _encoded_rows(done.output, body.encoding_format)
        data = [{"object": "embedding", "index": i, "embedding": row} for i, row in enumerate(rows)]
        usage = {"prompt_tokens": done.prompt_tokens, "total_tokens": done.prompt_tokens}
        content = {
            "object": "list",
            "data": data,
            "model": served.name,
            "usage": usage,
            "truncated_inputs": done.truncated,  # cut to the text encoder's longest input
        }
        return job_response(content, done)

    return router


def _encoded_rows(output: Any, encoding_format: str) -> list[list[float]] | list[str]:
    """Return each embedding ``(B, E)`` row as floats, or as base64 of little-endian float32."""
    if encoding_format == "base64":
        raw = output.float().numpy().astype("<f4")
        return [base64.b64encode(row.tobytes()).decode() for row in raw]
    rows: list[list[float]] = output.tolist()  # one call: iterating the tensor costs more
    return rows
