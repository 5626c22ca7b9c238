"""Image jobs of a pipeline from a folder: ``size``, ``steps``, ``seed``, ``guidance_scale``,
``negative_prompt`` and ``n`` with the meanings diffusers' pipeline gives them.

The pipeline class's recipe says what it can honour (its sizes' multiple, whether a
negative prompt acts) before the job is queued, and its defaults stand where the body
names none. Jobs of the same size (of any size, where the DiT packs sizes), steps,
guidance and negative-prompt use batch together; each draws its latents from its own
seed at its own size (``jobs.merged_batch``).
"""

from __future__ import annotations

import torch

from components.batch import Batch
from components.recipes import Recipe
from lifecycle.serving.bodies import ImagesBody
from lifecycle.serving.errors import ApiError
from lifecycle.serving.jobs import BatchKey, Job
from lifecycle.serving.limits import ImageSize

__all__ = ["folder_image_job"]


def folder_image_job(
    recipe: Recipe,
    body: ImagesBody,
    size: ImageSize | None,
    steps: int,
    request_id: str,
    seed: int,
    *,
    mixes_sizes: bool,
) -> Job:
    """Return the job of ``body`` (of ``size``, None: the class's default; of ``steps``) for
    a pipeline from a folder run by ``recipe``.

    Where its DiT packs images of different sizes into one forward (``mixes_sizes``) the
    job carries its size and shares batches with jobs of other sizes; else the size is
    part of its batch key.

    Raises:
        ApiError: 400 when the pipeline class cannot honour the request (a size off its
            grid, naming the multiple; a negative prompt it would ignore), or it asks
            for previews (no preview map is fitted for a pipeline class: its latents
            are not one grid per image size).
    """
    if body.partial_images:
        raise ApiError(
            400,
            "a pipeline from a folder streams each step without previews: ask "
            "partial_images 0 (the default)",
            param="partial_images",
        )
    batch = Batch(
        generator=torch.Generator().manual_seed(seed),
        steps=steps,
        size=body.n,
        prompts=[body.prompt] * body.n,
        negative_prompts=None if body.negative_prompt is None else [body.negative_prompt] * body.n,
        guidance_scale=body.guidance_scale,
        image_size=size,
    )
    try:
        recipe.image_size(batch)
    except ValueError as err:  # it names the multiple a side must be
        raise ApiError(400, str(err), param="size", code="invalid_size") from None
    try:
        recipe.check(batch)  # the body always has a prompt: what is left is the negative one
    except ValueError as err:
        raise ApiError(400, str(err), param="negative_prompt") from None
    height, width = recipe.requested_size(batch)
    latent_h, latent_w = recipe.latent_size(recipe.binned((height, width)))
    key = BatchKey(
        endpoint="images",
        steps=steps,
        guidance_scale=recipe.guidance_scale(batch),
        attention_backend=body.attention_backend,
        negative=body.negative_prompt is not None,
        image_size=None if mixes_sizes else (height, width),
        alone=request_id if recipe.scheduler_draws else None,
    )
    return Job(
        id=request_id,
        key=key,
        prompts=batch.prompts or [],
        negative_prompt=body.negative_prompt,
        tokens=body.n * latent_h * latent_w,
        seed=seed,
        priority=body.priority,
        size=(height, width),
        cache=body.cache,
    )
