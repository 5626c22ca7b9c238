"""``stream: true`` on image generation: server-sent events of every denoising step.

The events take the shapes of OpenAI's image streaming. After each denoising step
the job's images each get one ``image_generation.partial_image`` event with the
``step`` done, the ``total`` steps and the seconds ``elapsed`` since the request
came; on at most ``partial_images`` of those steps, spread evenly, the event also
carries a cheap preview (``b64_json``, ``partial_image_index``; see
``lifecycle.serving.preview``). Then each image gets one
``image_generation.completed`` event with the final PNG, as the non-streamed answer
has it. An error after the stream began is an ``error`` event with OpenAI's error
object.

A client that disconnects cancels the job (Starlette stops the stream, and the
generator's ``finally`` cancels it), as does the request's ``timeout``.
"""

from __future__ import annotations

import asyncio
import base64
import math
import time
from collections.abc import AsyncIterator
from concurrent.futures import Future
from typing import Any

import msgspec
import torch
from fastapi.responses import StreamingResponse

from lifecycle.pictures.png import encode_png
from lifecycle.serving.dispatch import check_finite, job_error, submit_job
from lifecycle.serving.errors import ApiError, server_error_body
from lifecycle.serving.jobs import Job, cache_answer
from lifecycle.serving.preview import preview_png
from lifecycle.serving.served import ServedPipeline
from lifecycle.serving.worker import Worker

__all__ = ["stream_images"]


def preview_steps(steps: int, previews: int) -> frozenset[int]:
    """Return the steps (1 to ``steps``) whose events carry a preview, at most ``previews``."""
    return frozenset(max(1, (i + 1) * steps // (previews + 1)) for i in range(previews))


def sse(kind: str, data: dict[str, Any]) -> bytes:
    """Return one server-sent event of type ``kind`` with ``data`` as JSON."""
    return b"event: " + kind.encode() + b"\ndata: " + msgspec.json.encode(data) + b"\n\n"


def stream_images(
    worker: Worker,
    served: ServedPipeline,
    job: Job,
    timeout: float,
    partial_images: int,
    seed: int,
) -> StreamingResponse:
    """Queue ``job`` on ``served`` and answer with its events as they come.

    Raises:
        ApiError: the queue refused the job (before any event was sent).
    """
    loop = asyncio.get_running_loop()
    events: asyncio.Queue[bytes | None] = asyncio.Queue()  # None: the job's future is done
    started = time.monotonic()
    latent_size = job.key.latent_size
    scale = served.shapes.image_scale
    height, width = (
        job.size or job.key.image_size or (latent_size[0] * scale, latent_size[1] * scale)
    )
    common = {
        "size": f"{width}x{height}",
        "output_format": "png",
        "quality": "auto",
        "background": "opaque",
    }
    previews = preview_steps(job.key.steps, partial_images)
    mapping = served.shapes.preview

    def stepped(step: int, steps: int, latents: list[torch.Tensor]) -> None:
        """Make this step's events (on the runner thread) and hand them to the stream."""
        elapsed = round(time.monotonic() - started, 6)
        for index, latent in enumerate(latents):
            data: dict[str, Any] = {
                "type": "image_generation.partial_image",
                "created_at": int(time.time()),
                **common,
                "image_index": index,
                "step": step,
                "total": steps,
                "elapsed": elapsed,
            }
            if step in previews:
                png = preview_png(latent, mapping, latent_size, scale)
                data["b64_json"] = base64.b64encode(png).decode()
                data["partial_image_index"] = sorted(previews).index(step)
            loop.call_soon_threadsafe(events.put_nowait, sse(data["type"], data))

    job.on_step = stepped
    future = submit_job(worker, served, job)
    future.add_done_callback(lambda _: loop.call_soon_threadsafe(events.put_nowait, None))
    body = _events(worker, served, job, future, events, loop.time() + timeout, common, seed)
    return StreamingResponse(body, media_type="text/event-stream")


async def _events(
    worker: Worker,
    served: ServedPipeline,
    job: Job,
    future: Future[Job],
    events: asyncio.Queue[bytes | None],
    deadline: float,
    common: dict[str, Any],
    seed: int,
) -> AsyncIterator[bytes]:
    """Yield the job's step events, then its images or its error; cancel it if left early."""
    loop = asyncio.get_running_loop()
    try:
        while True:
            try:
                event = await asyncio.wait_for(events.get(), deadline - loop.time())
            except TimeoutError:
                worker.cancel(job.id, "timeout")  # its future fails: None follows
                deadline = math.inf
                continue
            if event is None:
                break
            yield event
        try:
            done = future.result()
            check_finite(done)
        except Exception as err:
            error = job_error(worker, served, job, err)
            body = error.body if isinstance(error, ApiError) else server_error_body(error)
            yield sse("error", {"type": "error", "error": body})
            return
        assert done.output is not None
        usage = {"input_tokens": done.prompt_tokens, "output_tokens": 0}
        usage["total_tokens"] = done.prompt_tokens
        for index, image in enumerate(done.output):
            data = {
                "type": "image_generation.completed",
                "created_at": int(time.time()),
                **common,
                "image_index": index,
                "b64_json": base64.b64encode(encode_png(image)).decode(),
                "usage": usage,
                "seed": seed,
                "truncated_prompt": bool(done.truncated),
                "cache": cache_answer(done),
            }
            yield sse(data["type"], data)
    finally:
        if not future.done():  # the client went away (the stream was cancelled)
            worker.cancel(job.id, "disconnected")
