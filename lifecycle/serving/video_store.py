"""The videos of ``/v1/videos``: each one's record while it is made, and its MP4 once made.

A video's id is its request's id, and its status is the request's state (design §15):
``queued`` while the request is queued (or waits at its pipeline's gate),
``in_progress`` while it runs, ``completed`` once its MP4 is kept, ``failed`` when the
request failed, timed out or was cancelled by ``DELETE /v1/requests/{id}``. A finished
video is kept for its pipeline's ``serving.video_ttl`` seconds, and its pipeline's
finished videos within ``serving.video_store_bytes`` (the oldest finished go first);
then it is removed, and its id answers 404. ``DELETE /v1/videos/{id}`` removes it at once.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any, Literal, TypeAlias

from lifecycle.serving.jobs import RequestState, RequestStatus
from lifecycle.spec.structs import ServingConfig

__all__ = ["Video", "VideoStore"]

VideoStatus: TypeAlias = Literal["queued", "in_progress", "completed", "failed"]
FINISHED: frozenset[VideoStatus] = frozenset({"completed", "failed"})


@dataclass
class Video:
    """One video of ``/v1/videos``, from its request to its removal.

    Attributes:
        id: its request id.
        pipeline: the pipeline that makes it (``model``).
        settings: that pipeline's ``[serving]`` table (its ttl and store bytes).
        answer: the fields it is answered with beside its status (prompt, size,
            seconds, frames, seed, steps, created_at).
        status: where it stands once finished; None while its request is in flight.
        content: its MP4 file, once completed.
        error: why it failed (OpenAI's error object), once failed.
        finished: when it finished (``time.monotonic``), or None.
        completed_at: when it finished (Unix seconds), or None.
        task: what makes it (the request and the encoding), while unfinished.
    """

    id: str
    pipeline: str
    settings: ServingConfig
    answer: dict[str, Any]
    status: VideoStatus | None = None
    content: bytes | None = None
    error: dict[str, Any] | None = None
    finished: float | None = None
    completed_at: int | None = None
    task: asyncio.Task[None] | None = field(default=None, repr=False)

    def body(self, request: RequestStatus | None) -> dict[str, Any]:
        """Return the ``video`` object, its progress read off its request's status."""
        status, progress = self.status, 100
        if status is None:
            status, progress = progress_of(request)
        expires = None
        if self.completed_at is not None:
            expires = self.completed_at + round(self.settings.video_ttl)
        return {
            "id": self.id,
            "object": "video",
            "status": status,
            "progress": progress,
            "model": self.pipeline,
            **self.answer,
            "completed_at": self.completed_at,
            "expires_at": expires,
            "error": self.error,
            "remixed_from_video_id": None,
        }


def progress_of(request: RequestStatus | None) -> tuple[VideoStatus, int]:
    """Return an unfinished video's status and progress (percent) from its request's state:
    the denoising steps done, 99 while it decodes (None: not queued yet, at a gate)."""
    if request is None or request.state is RequestState.QUEUED:
        return "queued", 0
    if request.stage == "decode" or request.state is RequestState.DONE:
        return "in_progress", 99  # done: its MP4 is being written
    return "in_progress", min(99, 100 * request.step // max(request.steps, 1))


class VideoStore:
    """Every video not yet removed, by id."""

    def __init__(self) -> None:
        self.videos: dict[str, Video] = {}

    def add(self, video: Video) -> None:
        """Keep ``video`` (its id is new: the route checks)."""
        self.videos[video.id] = video

    def get(self, video_id: str) -> Video | None:
        """Return the video ``video_id`` once expired ones are removed; None when gone."""
        self.expire()
        return self.videos.get(video_id)

    def remove(self, video_id: str) -> Video | None:
        """Remove a video; return it (None when there was none)."""
        return self.videos.pop(video_id, None)

    def finish(self, video: Video, status: VideoStatus) -> None:
        """Mark ``video`` finished now and keep its pipeline within its store bytes."""
        video.status = status
        video.finished = time.monotonic()
        video.completed_at = int(time.time())
        video.task = None
        self.expire()
        self._fit(video.pipeline, video.settings.video_store)

    def expire(self) -> None:
        """Remove the finished videos kept longer than their ``serving.video_ttl``."""
        now = time.monotonic()
        for video in list(self.videos.values()):
            if video.finished is not None and now - video.finished >= video.settings.video_ttl:
                del self.videos[video.id]

    def _fit(self, pipeline: str, limit: int) -> None:
        """Remove ``pipeline``'s oldest finished videos until its MP4s fit ``limit`` bytes."""
        kept = sorted(
            (v for v in self.videos.values() if v.pipeline == pipeline and v.content),
            key=lambda v: v.finished or 0.0,
        )
        held = sum(len(v.content or b"") for v in kept)
        for video in kept:
            if held <= limit:
                return
            held -= len(video.content or b"")
            del self.videos[video.id]
