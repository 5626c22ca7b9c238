"""What the worker runs: jobs, which of them may share a batch, and how a batch is made.

A job is one HTTP request's work. Jobs with the same ``BatchKey`` run as one
orchestrator request on one merged ``Batch``: every random input is drawn from each
job's own seed before merging, and the kinds pack the merged requests (the DiT as one
varlen sequence, the text encoders as one padded batch), so each job's output equals
its output run alone, up to float rounding (``OUTPUT_TOLERANCE``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Literal, TypeAlias

import msgspec
import torch

from components.batch import Batch
from components.cache import CacheSteps, count_steps
from components.models.dit.base import PackedTransformer
from components.recipes import Recipe
from components.recipes.wan import WanRecipe
from lifecycle.orchestrator import Orchestrator
from lifecycle.serving.preview import PreviewMap, fit_preview

__all__ = [
    "BatchKey",
    "Job",
    "JobCancelled",
    "JobSteps",
    "RequestState",
    "RequestStatus",
    "Shapes",
    "cache_answer",
    "estimate_tokens",
    "job_rows",
    "merged_batch",
    "split_outputs",
    "warm_up",
]

# B prompts, N latent tokens, C latent channels, E embedding width, H, W image size

Endpoint: TypeAlias = Literal["embeddings", "images", "videos"]

JobSteps: TypeAlias = Callable[[int, int, list[torch.Tensor]], None]
"""Called on the runner thread after each denoising step of a job's batch with the step
done, the steps in all and the job's own latents ``(N, C)``, one per image."""

OUTPUT_TOLERANCE = 1e-5
"""Largest absolute difference between a job's output batched and run alone (float32;
seen: under 1e-6 for MiniLM embeddings, under 2e-6 for tiny-t2i pixels in [-1, 1])."""


class BatchKey(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """What jobs must share to run as one batch.

    Attributes:
        endpoint: embeddings, images or videos.
        steps: denoising steps.
        guidance_scale: classifier-free guidance scale.
        guidance_scale_2: the guidance scale of a second expert's steps (videos), or None.
        attention_backend: the per-request backend override, or None.
        latent_size: the latent grid (h, w) of an image job; (0, 0) for embeddings.
        negative: its images are guided away from a negative prompt (a job without one
            guides away from the empty prompt: the two never share a batch).
        image_size: the images' (height, width) in pixels, for a pipeline from a folder
            whose batches keep to one size; None where each job carries its ``size``.
        alone: the job's own id where it must run alone (its scheduler draws noise for a
            whole batch as it steps); None where it may share.
        frames: the frames of each video of a video job (videos of one batch share their
            length and size: one latent grid, one decode); None for others.
        adapters: the adapters it runs with their scales, by name (design §14): jobs
            with the same set batch together.
    """

    endpoint: Endpoint
    steps: int = 0
    guidance_scale: float | None = None
    guidance_scale_2: float | None = None
    attention_backend: str | None = None
    latent_size: tuple[int, int] = (0, 0)
    negative: bool = False
    image_size: tuple[int, int] | None = None
    alone: str | None = None
    frames: int | None = None
    adapters: tuple[tuple[str, float], ...] = ()


class Shapes(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """What the pipeline produces, read off its first warm-up request.

    Attributes:
        embeddings: it writes sentence embeddings.
        images: it writes images.
        videos: it writes videos (a folder's video pipeline class).
        latent_channels: C of each latent token (0 without a denoiser).
        image_scale: image pixels per latent position along each side (0 without images).
        preview: the linear map from a latent token to its RGB colour, ``C + 1`` rows
            (one per channel, then the bias) of 3, fitted at warm-up
            (``lifecycle.serving.preview``); empty without images.
        mixes_sizes: its DiT packs images of different sizes into one forward (a
            folder's transformer on its custom path): jobs of any size share a batch.
    """

    embeddings: bool
    images: bool
    videos: bool = False
    latent_channels: int = 0
    image_scale: int = 0
    preview: PreviewMap = ()
    mixes_sizes: bool = False


@dataclass
class Job:
    """One HTTP request's work and, once run, its output.

    Attributes:
        id: the request id on the response and in the logs.
        key: what it must share with the jobs it is batched with.
        prompts: its prompts (one per image or embedding).
        negative_prompt: the text its images are guided away from, or None.
        tokens: its size against ``serving.max_batch_tokens``.
        seed: the seed of its random inputs.
        output: its embeddings ``(B, E)`` or images ``(B, 3, H, W)``, once run.
        prompt_tokens: the real tokens its prompts took (usage), once run.
        batch_id: the orchestrator request it ran in (its members' ids joined by ``+``),
            the ``request_id`` of the transitions and moves it caused.
        batch_size: how many jobs shared that batch.
        priority: its place in the queue (higher first, with ageing).
        on_step: hears of each denoising step (a streamed request), or None.
        queued_turn: the batches the worker had started when it was queued.
        started_turn: the batches it had started when this job's batch started:
            ``started_turn - queued_turn`` batches passed it over
            (``lifecycle.device.priorities`` bounds them).
        truncated: the indices of its prompts a text encoder cut, once run.
        non_finite: whether its output, or the latents its images were decoded from,
            holds NaN or infinity (never answered as a result), once run.
        size: its images' (height, width) in pixels, for a pipeline from a folder whose
            batches mix sizes (its DiT packs them); None where the key says.
        cache: whether its images run the denoiser's step cache (design §17); jobs that
            differ here still share a batch.
        cache_steps: the image steps the step cache computed and skipped for it, once
            run; None where its images ran none.
        uncached: why its images ran every step though they asked for the cache (too
            few steps to skip any), once run; None otherwise.
        frames: the frames of its video (a video job); None: not a video.
        input_images: the image its video starts from (PIL), for image to video.
    """

    id: str
    key: BatchKey
    prompts: list[str]
    tokens: int
    negative_prompt: str | None = None
    seed: int = 0
    output: torch.Tensor | None = None
    prompt_tokens: int = 0
    batch_id: str = ""
    batch_size: int = 1
    priority: int = 0
    on_step: JobSteps | None = None
    queued_turn: int = 0
    started_turn: int = 0
    truncated: list[int] = field(default_factory=list)
    non_finite: bool = False
    size: tuple[int, int] | None = None
    cache: bool = True
    cache_steps: CacheSteps | None = None
    uncached: str | None = None
    frames: int | None = None
    input_images: list[Any] | None = None


class RequestState(StrEnum):
    """Where a job stands (``GET /v1/requests/{id}``)."""

    QUEUED = "queued"
    RUNNING = "running"
    DONE = "done"
    CANCELLED = "cancelled"


class RequestStatus(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A job's progress, as ``GET /v1/requests/{id}`` answers it.

    Attributes:
        id: the request id.
        state: queued, running, done or cancelled.
        stage: the stage it runs in (or stopped in); None while queued.
        step: denoising steps done in that stage.
        steps: denoising steps it asked for (0 for embeddings).
        queue_position: the jobs that start before it, while queued; else None.
    """

    id: str
    state: RequestState
    stage: str | None = None
    step: int = 0
    steps: int = 0
    queue_position: int | None = None


class JobCancelled(Exception):
    """A job was cancelled before it finished (design §15).

    Attributes:
        job_id: the job's request id.
        reason: why: ``disconnected``, ``deleted`` or ``timeout``.
        status: where it stood when cancelled.
    """

    def __init__(self, job_id: str, reason: str, status: RequestStatus) -> None:
        where = (
            "while queued"
            if status.stage is None
            else (f"at stage {status.stage!r}, step {status.step} of {status.steps}")
        )
        super().__init__(f"request {job_id!r} was cancelled ({reason}) {where}")
        self.job_id = job_id
        self.reason = reason
        self.status = status


def estimate_tokens(prompts: Sequence[str]) -> int:
    """Return a prompt's size in tokens, estimated without the tokenizer: words + 2."""
    return sum(len(text.split()) + 2 for text in prompts)


def merged_batch(jobs: Sequence[Job], shapes: Shapes, recipe: Recipe | None = None) -> Batch:
    """Return one ``Batch`` carrying every job's prompts and its own seeded latents.

    A pipeline from a folder (``recipe``) draws each job's latents as diffusers draws
    them for ``generator=torch.Generator("cpu").manual_seed(seed)`` and
    ``num_images_per_prompt=n``, at the job's own ``size`` (else the key's
    ``image_size``); the batch carries every image's size (``Batch.image_sizes``), so
    jobs of different sizes may share it.
    """
    key = jobs[0].key
    prompts = [text for job in jobs for text in job.prompts]
    latents = None
    image_sizes = None
    generator = torch.Generator().manual_seed(jobs[0].seed)  # unused unless drawn from
    if recipe is not None and key.endpoint == "images":
        latents, image_sizes = [], []
        for job in jobs:
            size = _size(job)
            # a job alone keeps drawing from its generator (a scheduler that draws as it
            # steps runs its jobs alone: ``BatchKey.alone``)
            generator = torch.Generator().manual_seed(job.seed)
            latents += recipe.draw_latents(generator, len(job.prompts), size)
            image_sizes += [size] * len(job.prompts)
    elif isinstance(recipe, WanRecipe) and key.endpoint == "videos":
        # each video's noise drawn from its own seed, as ``run`` draws it for that seed
        latents = [recipe.video_noise(job.seed, _size(job), job.frames or 1) for job in jobs]
    elif key.endpoint == "images":
        h, w = key.latent_size
        latents = []
        for job in jobs:
            drawn = torch.Generator().manual_seed(job.seed)
            latents += [
                torch.randn(h * w, shapes.latent_channels, generator=drawn) for _ in job.prompts
            ]  # (N, C) each
    return Batch(
        generator=generator,
        steps=max(key.steps, 1),
        guidance_scale=key.guidance_scale,
        negative_prompts=[job.negative_prompt or "" for job in jobs for _ in job.prompts]
        if key.negative
        else None,
        size=len(prompts),
        latent_size=key.latent_size if key.endpoint == "images" else (4, 4),
        prompts=prompts,
        latents=latents,
        image_size=key.image_size,
        image_sizes=image_sizes,
        adapters=[dict(key.adapters)] * len(prompts) if key.adapters else None,
        cache=_cache_flags(jobs),
        frames=key.frames,
        guidance_scale_2=key.guidance_scale_2,
        input_images=[image for job in jobs for image in job.input_images or ()] or None,
    )


def _cache_flags(jobs: Sequence[Job]) -> bool | list[bool]:
    """Return whether the merged batch's rows run the step cache: one flag, or one per row."""
    flags = {job.cache for job in jobs}
    if len(flags) == 1:
        return flags.pop()
    return [job.cache for job in jobs for _ in job.prompts]


def _size(job: Job) -> tuple[int, int]:
    size = job.size or job.key.image_size
    if size is None:
        raise ValueError(f"image job '{job.id}' has no size: give the job or its key one")
    return size


def job_rows(jobs: Sequence[Job]) -> list[range]:
    """Return each job's rows of their merged batch, in order."""
    rows = []
    start = 0
    for job in jobs:
        rows.append(range(start, start + len(job.prompts)))
        start += len(job.prompts)
    return rows


def split_outputs(jobs: Sequence[Job], batch: Batch) -> None:
    """Hand each job its rows of the merged batch's output, and its token usage.

    A job whose rows left the batch (cancelled) gets no output.

    Raises:
        ValueError: the pipeline did not produce what the jobs' endpoint returns.
    """
    endpoint = jobs[0].key.endpoint
    produced = {
        "embeddings": batch.sentence_embeddings,
        "images": batch.images,
        "videos": batch.videos,
    }[endpoint]
    if produced is None:
        raise ValueError(f"the pipeline produced no {endpoint}")
    context = batch.context or []
    latents = batch.latents or []
    truncated = batch.truncated or [False] * len(produced)
    position = {row: index for index, row in enumerate(batch.rows)}
    for job, rows in zip(jobs, job_rows(jobs), strict=True):
        if rows.start not in position:
            continue  # cancelled: its rows left the batch
        here = slice(position[rows.start], position[rows.start] + len(rows))
        mine = produced[here]  # one job's images share a size, so a list of them stacks
        job.output = (torch.stack(mine) if isinstance(mine, list) else mine).detach().cpu()
        job.prompt_tokens = sum(int(c.shape[0]) for c in context[here])
        job.truncated = [i for i, cut in enumerate(truncated[here]) if cut]
        job.non_finite = not bool(job.output.isfinite().all()) or any(
            not bool(latent.isfinite().all()) for latent in latents[here]
        )
        if batch.cache_rows is not None and job.cache:
            caches = batch.cache_rows[here]
            job.cache_steps = count_steps(caches)
            job.uncached = next((c.uncached for c in caches if c is not None), None)


def cache_answer(job: Job) -> dict[str, object] | None:
    """Return what a response says of the job's step cache: its steps computed and skipped,
    and why it ran uncached if it did; None where its images ran no cache."""
    if job.cache_steps is None:
        return None
    answer: dict[str, object] = {
        "computed": job.cache_steps.computed,
        "skipped": job.cache_steps.skipped,
    }
    if job.uncached is not None:
        answer["uncached"] = job.uncached
    return answer


WARM_UP_LATENT_SIZE = (8, 8)
"""The warm-up image's latent grid: 64 tokens to fit the preview map on."""


def warm_up(orchestrator: Orchestrator, requests: int) -> Shapes:
    """Run ``requests`` (at least one) through every stage; read what the pipeline produces.

    The first tells the shapes, and fits the preview map of a pipeline that makes
    images; later ones warm what a first run leaves cold (allocator pools, kernel
    choices, caches). A pipeline from a folder warms up on its smallest image (its
    sizes' multiple a side), unfitted.
    """
    shapes = _shapes_of(_warm_request(orchestrator, 1), orchestrator)
    for number in range(2, requests + 1):
        _warm_request(orchestrator, number)
    return shapes


def _warm_request(orchestrator: Orchestrator, number: int) -> Batch:
    recipe = orchestrator.recipe
    batch = Batch(
        generator=torch.Generator().manual_seed(0),
        steps=1,
        prompts=["warm up"],
        latent_size=WARM_UP_LATENT_SIZE,
        image_size=None if recipe is None else (recipe.multiple, recipe.multiple),
    )
    if recipe is not None and recipe.makes_videos:
        batch.frames = 1  # the shortest video: one latent frame
    if recipe is not None and recipe.takes_images:
        from PIL import Image  # diffusers brings Pillow; a folder's pipeline needs diffusers

        batch.input_images = [Image.new("RGB", (recipe.multiple, recipe.multiple))]
    with orchestrator.request(f"warm-up-{number}") as request:
        request.run_all(batch)
    return batch


def _shapes_of(batch: Batch, orchestrator: Orchestrator) -> Shapes:
    """Return what the pipeline produces, as warm-up ``batch`` (or its recipe) shows."""
    recipe = orchestrator.recipe
    if recipe is not None:
        return Shapes(
            embeddings=False,
            images=not recipe.makes_videos,
            videos=recipe.makes_videos,
            latent_channels=recipe.channels,
            image_scale=recipe.vae.scale_factor,
            mixes_sizes=isinstance(orchestrator.module("transformer"), PackedTransformer),
        )
    latents = batch.latents or []
    images = batch.images
    scale = 0 if images is None else int(images[0].shape[-1]) // batch.latent_size[1]
    preview: PreviewMap = ()
    if images is not None and latents:
        preview = fit_preview(latents[0], images[0], batch.latent_size, scale)
    return Shapes(
        embeddings=batch.sentence_embeddings is not None,
        images=images is not None,
        latent_channels=int(latents[0].shape[-1]) if latents else 0,
        image_scale=scale,
        preview=preview,
    )
