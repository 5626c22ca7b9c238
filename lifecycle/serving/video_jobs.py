"""Video jobs of a pipeline from a folder that makes videos (design §18): a ``POST
/v1/videos`` body read with the meanings diffusers' ``WanPipeline`` gives its arguments.

The length is ``num_frames``, or ``seconds`` at ``FPS`` frames a second plus the first
frame (OpenAI's ``"4"`` is 65 frames), else the class's default. The recipe refuses what
it cannot make (frames off ``4k + 1``, a size off its grid, an image-to-video request
without an image) before the job is queued. Videos of the same length, size, steps and
guidance batch together (``BatchKey``): each one's noise is drawn from its own seed as
``run`` draws it, and the recipe runs its DiT and its VAE one video at a time, so the
frames are ``run``'s; the batch crosses its stages and its experts' boundary together,
with one hand-over. A scheduler that draws as it steps keeps each video alone.
"""

from __future__ import annotations

import base64
import binascii
import io
from typing import Any

import torch

from components.batch import Batch
from components.recipes.wan import WanRecipe
from lifecycle.pictures.video import FPS
from lifecycle.serving.bodies import VideosBody
from lifecycle.serving.errors import ApiError
from lifecycle.serving.jobs import BatchKey, Job
from lifecycle.serving.limits import ImageSize
from lifecycle.shown import shown
from lifecycle.spec.structs import ServingConfig

__all__ = ["read_reference", "video_frames", "video_job", "video_seconds"]

DATA_URL = "data:"
BASE64 = ";base64,"


def video_frames(recipe: WanRecipe, body: VideosBody) -> int:
    """Return the frames ``body`` asks for: ``num_frames``, ``seconds`` x ``FPS`` + 1, or
    the class's default.

    Raises:
        ApiError: 400 for both given, or ``seconds`` that is no positive number of whole
            frames.
    """
    if body.num_frames is not None and body.seconds is not None:
        raise ApiError(
            400,
            "give seconds or num_frames, not both: num_frames = seconds x "
            f"{FPS} + 1 at {FPS} frames a second",
            param="seconds",
        )
    if body.num_frames is not None:
        return body.num_frames
    if body.seconds is None:
        return recipe.default_frames
    try:
        seconds = float(body.seconds)
    except ValueError:
        seconds = 0.0
    frames = seconds * FPS
    if not 0 < frames < 2**31 or frames != int(frames):
        raise ApiError(
            400,
            f"seconds {shown(str(body.seconds))} is not a positive number of whole frames at "
            f"{FPS} frames a second (a multiple of 1/{FPS}, e.g. '4'); or send num_frames",
            param="seconds",
        )
    return int(frames) + 1


def video_seconds(frames: int) -> str:
    """Return the length of a video of ``frames`` frames in seconds, as OpenAI writes it:
    ``(frames - 1) / FPS`` (``"4"`` for 65 frames)."""
    return f"{(frames - 1) / FPS:g}"


def read_reference(body: VideosBody, upload: bytes | None, settings: ServingConfig) -> Any:
    """Return the video's input image (PIL, RGB): the multipart file ``upload``, or the
    JSON body's ``input_reference.image_url`` (a ``data:`` URL); None when neither.

    Raises:
        ApiError: 400 naming ``input_reference``: a URL the worker would have to fetch,
            bad base64, no image Pillow reads, or a side over ``serving.max_image_side``
            (checked on the header, before the pixels are decoded).
    """
    data = upload
    if body.input_reference is not None:
        url = body.input_reference.image_url
        if not url.startswith(DATA_URL) or BASE64 not in url:
            raise ApiError(
                400,
                f"input_reference.image_url {shown(url)} is not a base64 data: URL; the worker "
                "fetches nothing: send 'data:image/png;base64,...', or the file in a "
                "multipart form",
                param="input_reference",
            )
        try:
            data = base64.b64decode(url.split(BASE64, 1)[1], validate=True)
        except binascii.Error:
            raise ApiError(
                400, "input_reference.image_url holds bad base64", param="input_reference"
            ) from None
    if data is None:
        return None
    from PIL import Image  # diffusers brings Pillow; a folder's pipeline needs diffusers

    try:
        image = Image.open(io.BytesIO(data))
        side = settings.max_image_side
        if max(image.size) > side:
            raise ApiError(
                400,
                f"input_reference is {image.size[0]}x{image.size[1]} pixels, over "
                f"serving.max_image_side = {side}; send a smaller image",
                param="input_reference",
                code="limit_exceeded",
                extra={"limit": "serving.max_image_side"},
            )
        return image.convert("RGB")
    except OSError as err:  # not an image Pillow knows, or a truncated one
        raise ApiError(
            400, f"input_reference is not an image Pillow reads ({err})", param="input_reference"
        ) from None


def video_job(
    recipe: WanRecipe,
    body: VideosBody,
    size: ImageSize | None,
    frames: int,
    steps: int,
    request_id: str,
    seed: int,
    image: Any,
) -> Job:
    """Return the job of ``body`` (``size``: None takes the class's default) for a pipeline
    from a folder that makes videos.

    Raises:
        ApiError: 400 when the class cannot make it: frames off ``4k + 1`` (naming the
            rule), a size off its grid, an input image it does not take or lacks, a
            negative prompt or second guidance scale it would ignore.
    """
    if image is not None and not recipe.takes_images:
        raise ApiError(
            400,
            f"input_reference starts a video from an image, but {recipe.pipeline_class} makes "
            "videos from text alone: drop it, or serve an image-to-video folder",
            param="input_reference",
        )
    batch = Batch(
        generator=torch.Generator().manual_seed(seed),
        steps=steps,
        size=1,
        prompts=[body.prompt],
        negative_prompts=None if body.negative_prompt is None else [body.negative_prompt],
        guidance_scale=body.guidance_scale,
        guidance_scale_2=body.guidance_scale_2,
        image_size=size,
        frames=frames,
        input_images=None if image is None else [image],
    )
    for check, param in (
        (recipe.frames, "num_frames"),
        (recipe.image_size, "size"),
        (recipe.check, None),
    ):
        try:
            check(batch)
        except ValueError as err:  # each names what to change
            raise ApiError(400, str(err), param=param) from None
    height, width = recipe.requested_size(batch)
    latent_h, latent_w = recipe.latent_size((height, width))
    key = BatchKey(
        endpoint="videos",
        steps=steps,
        guidance_scale=recipe.guidance_scale(batch),
        guidance_scale_2=body.guidance_scale_2,
        negative=body.negative_prompt is not None,
        image_size=(height, width),
        alone=request_id if recipe.scheduler_draws else None,
        frames=frames,
    )
    return Job(
        id=request_id,
        key=key,
        prompts=[body.prompt],
        negative_prompt=body.negative_prompt,
        tokens=recipe.latent_frames(batch) * latent_h * latent_w,
        seed=seed,
        priority=body.priority,
        size=(height, width),
        frames=frames,
        input_images=batch.input_images,
    )
