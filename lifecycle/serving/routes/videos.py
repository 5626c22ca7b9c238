"""``/v1/videos``: OpenAI's videos API over a pipeline from a folder that makes videos.

``POST /v1/videos`` (JSON, or the multipart form the openai client sends) checks the
body against ``[serving]`` and the pipeline class, queues the video's request and
answers its ``video`` object at once (``queued``); ``GET /v1/videos/{id}`` follows it
(``openai-poll-after-ms`` paces ``create_and_poll``), ``GET /v1/videos/{id}/content``
answers the MP4 once ``completed``, ``DELETE /v1/videos/{id}`` cancels an unfinished one
as ``DELETE /v1/requests/{id}`` does (design §15) and removes it, or removes a finished
one. The request carries the video's id, so priorities, timeouts and ``GET
/v1/requests/{id}`` apply as to any request (``lifecycle.serving.video_store``).
"""

from __future__ import annotations

import asyncio
import secrets
import time
from typing import Any

import msgspec
from fastapi import APIRouter, Request
from fastapi.responses import Response
from starlette.datastructures import UploadFile

from components.recipes.wan import WanRecipe
from lifecycle.admission.folder import default_steps
from lifecycle.logs import get_logger
from lifecycle.pictures.video import VIDEO_EXTRA, mp4_bytes, mp4_missing
from lifecycle.serving.auth import API_KEY
from lifecycle.serving.bodies import VIDEOS_BODY, VideosBody, convert_form, decode_body
from lifecycle.serving.dispatch import check_finite, check_ready, request_timeout, run_job
from lifecycle.serving.errors import ApiError
from lifecycle.serving.jobs import Job
from lifecycle.serving.limits import JSON_TYPE, ImageSize, check_videos, video_pixels
from lifecycle.serving.served import ServedPipeline
from lifecycle.serving.video_jobs import read_reference, video_frames, video_job, video_seconds
from lifecycle.serving.video_store import Video, VideoStore
from lifecycle.serving.worker import Worker
from lifecycle.shown import shown

__all__ = ["videos_routes"]

log = get_logger("lifecycle")

POLL_AFTER_MS = 250
"""How long the openai client's ``poll`` waits between two GETs (``openai-poll-after-ms``)."""
FORM_FIELDS = 32
"""The most fields a multipart form may carry: the body has 15."""
IMAGE_FIELD = "input_reference"


def videos_routes(worker: Worker) -> APIRouter:
    """Return the videos endpoints, which keep their videos in a store of their own."""
    router = APIRouter()
    store = VideoStore()

    @router.post("/v1/videos", dependencies=API_KEY)
    async def create(request: Request) -> Response:
        body, upload = await _read_body(request, worker)
        served = check_ready(worker, body.model)
        video_id = request.state.id
        if store.get(video_id) is not None:
            raise ApiError(
                409,
                f"a video has the id {shown(video_id)} still; send another x-request-id, or "
                "none and the worker assigns one",
                param="x-request-id",
                code="duplicate_request_id",
            )
        job = _job(served, body, upload, video_id)
        if (missing := mp4_missing()) is not None:
            raise ApiError(
                501,
                f"{missing}: the worker writes no MP4 ({VIDEO_EXTRA} where it runs)",
                kind="server_error",
                code="video_extra_missing",
            )
        timeout = request_timeout(served, body.priority, body.timeout)
        height, width = job.size or (0, 0)
        frames = job.frames or 0
        video = Video(
            id=video_id,
            pipeline=served.name,
            settings=served.settings,
            answer={
                "prompt": body.prompt,
                "size": f"{width}x{height}",
                "seconds": video_seconds(frames),
                "num_frames": frames,
                "seed": job.seed,
                "steps": job.key.steps,
                "created_at": int(time.time()),
            },
        )
        store.add(video)
        video.task = asyncio.ensure_future(_make(worker, served, job, timeout, video, store))
        return _json(video.body(worker.status(video_id)))

    @router.get("/v1/videos/{video_id}", dependencies=API_KEY)
    async def retrieve(video_id: str) -> Response:
        video = _known(store, video_id)
        return _json(video.body(worker.status(video_id)), {"openai-poll-after-ms": POLL_AFTER_MS})

    @router.get("/v1/videos/{video_id}/content", dependencies=API_KEY)
    async def content(video_id: str, variant: str = "video") -> Response:
        video = _known(store, video_id)
        if variant != "video":
            raise ApiError(
                400,
                f"variant {shown(variant)} is not served: the worker keeps the MP4 alone; ask "
                "variant 'video' (the default)",
                param="variant",
            )
        if video.content is None:
            raise ApiError(
                409,
                f"video {shown(video_id)} is {video.body(worker.status(video_id))['status']}: "
                "its MP4 is there once it is completed (GET /v1/videos/{id})",
                code="video_not_ready",
            )
        return Response(video.content, media_type="video/mp4")

    @router.delete("/v1/videos/{video_id}", dependencies=API_KEY)
    async def delete(video_id: str) -> Response:
        video = _known(store, video_id)
        store.remove(video_id)
        # unfinished: cancel its request as DELETE /v1/requests does, or, where it waits at
        # its pipeline's gate (not queued yet), the wait
        if video.task is not None and worker.cancel(video_id, "deleted") is None:
            video.task.cancel()
        return _json({"id": video_id, "object": "video.deleted", "deleted": True})

    return router


async def _read_body(request: Request, worker: Worker) -> tuple[VideosBody, bytes | None]:
    """Read a JSON body, or a multipart form (text fields and the ``input_reference`` file);
    return the body and the file's bytes, if any."""
    media_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if media_type == JSON_TYPE:
        return decode_body(VIDEOS_BODY, await request.body()), None
    limit = worker.bounds.max_body_bytes
    async with request.form(max_files=1, max_fields=FORM_FIELDS, max_part_size=limit) as form:
        fields: dict[str, str] = {}
        upload = None
        for name, value in form.multi_items():
            if isinstance(value, UploadFile):
                if name != IMAGE_FIELD:
                    raise ApiError(
                        400, f"only {IMAGE_FIELD} may be a file, not {shown(name)}", param=name
                    )
                upload = await value.read()
            else:
                fields[name] = value
    return convert_form(fields, VideosBody), upload


def _job(served: ServedPipeline, body: VideosBody, upload: bytes | None, video_id: str) -> Job:
    """Return the video's job, once the body is within ``[serving]`` and the class makes it.

    Raises:
        ApiError: 400 naming the model when the pipeline makes no videos, the key of a
            bound exceeded, or what the class cannot make.
    """
    recipe = served.orchestrator.recipe
    if not served.shapes.videos or recipe is None:
        raise ApiError(
            400,
            f"model {shown(served.name)} makes no videos: POST /v1/videos needs a pipeline "
            "that makes them (a Wan folder)",
            param="model",
            code="model_makes_no_videos",
        )
    assert isinstance(recipe, WanRecipe)  # shapes.videos: its recipe makes videos
    settings = served.settings
    size = check_videos(body, settings)
    frames = video_frames(recipe, body)
    image = read_reference(body, upload, settings)
    seed = secrets.randbelow(2**31) if body.seed is None else body.seed
    steps = body.steps or default_steps(recipe)
    job = video_job(recipe, body, size, frames, steps, video_id, seed, image)
    assert job.size is not None  # a video job names its size
    video_pixels(frames, ImageSize(*job.size), settings)
    return job


async def _make(
    worker: Worker,
    served: ServedPipeline,
    job: Job,
    timeout: float,
    video: Video,
    store: VideoStore,
) -> None:
    """Run the video's request, then keep its MP4 (``completed``) or why it failed."""
    try:
        done = await run_job(worker, served, job, _never_disconnects, timeout)
        check_finite(done)
        assert done.output is not None
        data = await asyncio.to_thread(mp4_bytes, done.output[0])
    except ApiError as err:  # timed out, cancelled, refused, failed
        video.error = {key: err.body[key] for key in ("code", "message", "param", "type")}
        store.finish(video, "failed")
        return
    except Exception as err:  # a failure while running: answered as the video's error
        log.error("serving.video_failed", request_id=job.id, error=str(err))
        video.error = {"code": "video_failed", "message": str(err), "type": "server_error"}
        store.finish(video, "failed")
        return
    limit = video.settings.video_store
    if len(data) > limit:
        video.error = {
            "code": "limit_exceeded",
            "message": f"the MP4 is {len(data)} bytes, over serving.video_store_bytes = "
            f"{limit}; ask for fewer frames or pixels, or raise serving.video_store_bytes",
            "param": None,
            "type": "invalid_request_error",
        }
        store.finish(video, "failed")
        return
    video.content = data
    store.finish(video, "completed")
    asyncio.get_running_loop().call_later(video.settings.video_ttl, store.expire)


async def _never_disconnects() -> Any:
    """The ``receive`` of a video's request: it has no client connection to lose."""
    await asyncio.Event().wait()


def _known(store: VideoStore, video_id: str) -> Video:
    video = store.get(video_id)
    if video is None:
        raise ApiError(
            404,
            f"no video has the id {shown(video_id)}: never made, deleted, or removed after "
            "serving.video_ttl or to keep serving.video_store_bytes",
            param="video_id",
            code="video_not_found",
        )
    return video


def _json(content: dict[str, Any], headers: dict[str, Any] | None = None) -> Response:
    return Response(
        msgspec.json.encode(content),
        media_type="application/json",
        headers={key: str(value) for key, value in (headers or {}).items()},
    )
