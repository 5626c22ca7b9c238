"""``POST /v1/images/generations``: text to image, OpenAI's shape (``stream: true``:
server-sent events of every step, ``lifecycle.serving.streaming``)."""

from __future__ import annotations

import base64
import secrets
import time

import msgspec
from fastapi import APIRouter, Request
from fastapi.responses import Response

from lifecycle.admission.folder import default_steps
from lifecycle.pictures.png import encode_png
from lifecycle.serving.auth import API_KEY
from lifecycle.serving.bodies import IMAGES_BODY, ImagesBody, decode_body, documented
from lifecycle.serving.dispatch import (
    check_finite,
    check_ready,
    gate_passed,
    job_response,
    not_served,
    request_timeout,
    run_job,
)
from lifecycle.serving.errors import ApiError
from lifecycle.serving.folder_jobs import folder_image_job
from lifecycle.serving.jobs import BatchKey, Job, cache_answer
from lifecycle.serving.limits import ImageSize, check_images, image_pixels
from lifecycle.serving.routes.adapters import adapter_set
from lifecycle.serving.served import ServedPipeline
from lifecycle.serving.streaming import stream_images
from lifecycle.serving.worker import Worker

__all__ = ["images_routes"]

DEFAULT_LATENT_SIDE = 4
"""The latent grid side of an image when the request gives no ``size``."""


def images_routes(worker: Worker) -> APIRouter:
    """Return the image generation endpoint."""
    router = APIRouter()

    @router.post(
        "/v1/images/generations", openapi_extra=documented(ImagesBody), dependencies=API_KEY
    )
    async def images(request: Request) -> Response:
        body = decode_body(IMAGES_BODY, await request.body())
        served = check_ready(worker, body.model)
        settings = served.settings
        size = check_images(body, settings)
        if not served.shapes.images:
            raise not_served(served, "images", "examples/tiny_t2i.toml")
        timeout = request_timeout(served, body.priority, body.timeout)
        seed = secrets.randbelow(2**31) if body.seed is None else body.seed
        recipe = served.orchestrator.recipe
        steps = body.steps or default_steps(recipe)
        if recipe is None:
            job = _kinds_job(served, body, size, steps, request.state.id, seed)
        else:
            job = folder_image_job(
                recipe,
                body,
                size,
                steps,
                request.state.id,
                seed,
                mixes_sizes=served.shapes.mixes_sizes,
            )
            if size is None:  # the class's default size, known once its recipe chose it
                asked = job.size or job.key.image_size
                assert asked is not None  # a folder's job names its size
                image_pixels(body.n, ImageSize(*asked), settings)
        if body.lora:
            job.key = msgspec.structs.replace(job.key, adapters=adapter_set(served, body.lora))
        if body.stream:
            served = await gate_passed(worker, served, job)
            return stream_images(worker, served, job, timeout, body.partial_images, seed)
        done = await run_job(worker, served, job, request.receive, timeout)
        assert done.output is not None
        check_finite(done)
        data = [{"b64_json": base64.b64encode(encode_png(image)).decode()} for image in done.output]
        content = {
            "created": int(time.time()),
            "data": data,
            "seed": seed,
            "truncated_prompt": bool(done.truncated),  # cut to the text encoder's longest input
            "cache": cache_answer(done),
        }
        return job_response(content, done)

    return router


def _kinds_job(
    served: ServedPipeline,
    body: ImagesBody,
    size: ImageSize | None,
    steps: int,
    request_id: str,
    seed: int,
) -> Job:
    """Return the job of ``body`` (of ``size``, of ``steps``) for a pipeline of kinds (its
    sizes follow the latent grid)."""
    latent_size = _latent_size(served, size, body.n)
    key = BatchKey(
        endpoint="images",
        steps=steps,
        guidance_scale=body.guidance_scale,
        attention_backend=body.attention_backend,
        latent_size=latent_size,
        negative=body.negative_prompt is not None,
    )
    return Job(
        id=request_id,
        key=key,
        prompts=[body.prompt] * body.n,
        negative_prompt=body.negative_prompt,
        tokens=body.n * latent_size[0] * latent_size[1],
        seed=seed,
        priority=body.priority,
        cache=body.cache,
    )


def _latent_size(served: ServedPipeline, size: ImageSize | None, n: int) -> tuple[int, int]:
    """Return the latent grid of ``size`` (None: the default), within the pipeline's range."""
    scale = served.shapes.image_scale
    settings = served.settings
    if size is None:
        side = DEFAULT_LATENT_SIDE * scale
        image_pixels(n, ImageSize(height=side, width=side), settings)
        return DEFAULT_LATENT_SIDE, DEFAULT_LATENT_SIDE
    w, h = size.width, size.height
    largest = settings.max_batch_tokens // n
    if w % scale or h % scale or (w // scale) * (h // scale) > largest:  # check_images: w, h > 0
        raise ApiError(
            400,
            f"size '{w}x{h}' is outside this pipeline's range: width and height must be "
            f"positive multiples of {scale} pixels, with (width/{scale}) x (height/{scale}) "
            f"x n at most serving.max_batch_tokens = {settings.max_batch_tokens}",
            param="size",
            code="invalid_size",
        )
    return h // scale, w // scale
