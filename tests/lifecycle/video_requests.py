"""Wan video requests in diffusers' terms, what diffusers' own pipeline makes of them, and
the same requests as ``Batch``es and as ``lifecycle run`` options."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any, NamedTuple

import torch

from components.batch import Batch

PROMPT = "A red fox leaps over the snow at dawn"


class VideoRequest(NamedTuple):
    """One video request, in diffusers' terms (``guidance_scale_2`` for two experts;
    ``image`` and ``last_image`` seeds of the input images, for image to video)."""

    frames: int = 5
    size: tuple[int, int] = (32, 32)
    steps: int = 2
    guidance_scale: float = 4.0
    guidance_scale_2: float | None = None
    negative_prompt: str | None = None
    seed: int = 0
    image: int | None = None
    last_image: int | None = None


VIDEO_REQUESTS = {
    "wan": VideoRequest(frames=5, size=(32, 48), negative_prompt="blurry, dark"),
    # four steps of shift 3 cross the boundary at 875 after the first two
    "wan-a14b": VideoRequest(frames=9, steps=4, guidance_scale_2=2.5, seed=1),
    "wan-ti2v": VideoRequest(frames=5, size=(32, 64), seed=2),
    "wan-i2v": VideoRequest(frames=5, image=0, negative_prompt="grey"),
    "wan-i2v-a14b": VideoRequest(frames=9, steps=3, guidance_scale_2=3.0, image=2, last_image=3),
}
"""One request per Wan folder: frames, size, steps, guidance (of both experts), images."""


def input_image(seed: int) -> Any:
    """Return a seeded RGB image (PIL) 40 x 48, another size than the videos' (diffusers
    resizes it)."""
    from PIL import Image

    noise = torch.rand((40, 48, 3), generator=torch.Generator().manual_seed(seed))
    return Image.fromarray((noise * 255).to(torch.uint8).numpy())


def video_batch(request: VideoRequest) -> Batch:
    """Return the ``Batch`` of ``request`` (one video), seeded as diffusers seeds its
    generator."""
    return Batch(
        generator=torch.Generator("cpu").manual_seed(request.seed),
        steps=request.steps,
        size=1,
        prompts=[PROMPT],
        negative_prompts=None if request.negative_prompt is None else [request.negative_prompt],
        guidance_scale=request.guidance_scale,
        guidance_scale_2=request.guidance_scale_2,
        image_size=request.size,
        frames=request.frames,
        input_images=None if request.image is None else [input_image(request.image)],
        last_images=None if request.last_image is None else [input_image(request.last_image)],
    )


def diffusers_video(folder: Path, request: VideoRequest) -> torch.Tensor:
    """Run diffusers' own pipeline from ``folder`` in float32 on ``request``; return the
    video ``(3, F, H, W)`` in [0, 1].

    diffusers' image-to-video module calls ``ftfy.fix_text`` without importing ftfy where
    it is not installed; it gets the identity there, which is what ftfy does to an ASCII
    prompt (and what our recipe does without ftfy).
    """
    import diffusers.pipelines.wan.pipeline_wan_i2v as image_to_video
    from diffusers import DiffusionPipeline

    if not hasattr(image_to_video, "ftfy"):
        image_to_video.ftfy = SimpleNamespace(fix_text=str)  # type: ignore[attr-defined]
    pipeline: Any = DiffusionPipeline.from_pretrained(str(folder), torch_dtype=torch.float32)
    pipeline.set_progress_bar_config(disable=True)
    extra: dict[str, Any] = {}
    if request.negative_prompt is not None:
        extra["negative_prompt"] = request.negative_prompt
    if request.guidance_scale_2 is not None:
        extra["guidance_scale_2"] = request.guidance_scale_2
    if request.image is not None:
        extra["image"] = input_image(request.image)
    if request.last_image is not None:
        extra["last_image"] = input_image(request.last_image)
    frames: torch.Tensor = pipeline(
        prompt=PROMPT,
        generator=torch.Generator("cpu").manual_seed(request.seed),
        num_inference_steps=request.steps,
        guidance_scale=request.guidance_scale,
        height=request.size[0],
        width=request.size[1],
        num_frames=request.frames,
        output_type="pt",
        **extra,
    ).frames
    return frames[0].transpose(0, 1)  # (F, 3, H, W) -> (3, F, H, W)


def video_arguments(request: VideoRequest, images: Path) -> list[str]:
    """Return the ``lifecycle run`` options that ask for ``request`` (one video), writing
    its input images as PNG into ``images``."""
    height, width = request.size
    arguments = ["--prompt", PROMPT, "--seed", str(request.seed), "--threads", "1"]
    arguments += ["--size", f"{width}x{height}", "--steps", str(request.steps)]
    arguments += ["--frames", str(request.frames), "--guidance-scale", str(request.guidance_scale)]
    if request.guidance_scale_2 is not None:
        arguments += ["--guidance-scale-2", str(request.guidance_scale_2)]
    if request.negative_prompt is not None:
        arguments += ["--negative-prompt", request.negative_prompt]
    for option, seed in (("--image", request.image), ("--last-image", request.last_image)):
        if seed is not None:
            path = images / f"image-{seed}.png"
            input_image(seed).save(path)
            arguments += [option, str(path)]
    return arguments
