"""Wan image to video: the text, the input image's CLIP states and its encoded frame guide the DiT.

As diffusers' ``WanImageToVideoPipeline`` calls them with its defaults, beside what
``WanPipeline`` does: the input image (and a last image, where one is given) is resized
to the video's size by diffusers' video processor; the VAE encodes the video it starts
(the image, then zeros, then the last image) into the condition, whose frames a mask
marks as given; the DiT reads the noise and the condition side by side (36 channels).
Wan 2.1 I2V's DiT also cross-attends to the penultimate states of a CLIP image encoder
(``image_encoder``); Wan 2.2 A14B I2V has none, and two experts.

The encode stage uses the VAE too (for the condition): under an offload it is onloaded
for encode and again for decode. The condition's video is made one chunk at a time, so
the encoder never holds the whole clip of zeros.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from functools import cached_property
from typing import Any, ClassVar

import torch
from torch import nn

from components.batch import Batch, device_of
from components.folders.index import INDEX_FILE, PipelineIndex
from components.folders.problems import Problem
from components.kinds.clip_vision_encoder import ClipVisionEncoderLoader
from components.recipes.base import DECODE, DENOISE, ENCODE, RecipeError, Stage, width
from components.recipes.wan import EXPERTS, WanDenoising, WanRecipe

__all__ = ["WanImageToVideoRecipe"]

# C latent channels, f latent frames, h w latent grid, F frames, H W frame size

IMAGE_ENCODER = "image_encoder"
MASK_CHANNELS = 4
"""The mask's channels: one per video frame of a latent frame (the temporal factor)."""


class WanImageToVideoRecipe(WanRecipe):
    """Run ``WanImageToVideoPipeline`` (UMT5, a CLIP ``image_encoder`` where the DiT reads
    one, the experts, the VAE)."""

    pipeline_class: ClassVar[str] = "WanImageToVideoPipeline"
    stages = (
        Stage(ENCODE, ("text_encoder", IMAGE_ENCODER, "vae")),
        Stage(DENOISE, EXPERTS),
        Stage(DECODE, ("vae",)),
    )
    optional = frozenset({"transformer_2", IMAGE_ENCODER})
    takes_images = True

    def __init__(self, index: PipelineIndex, *args: Any, **kwargs: Any) -> None:
        super().__init__(index, *args, **kwargs)
        self.image_encoder = (
            self.loader(IMAGE_ENCODER, ClipVisionEncoderLoader)
            if IMAGE_ENCODER in self.loaders
            else None
        )
        problems = []
        if self.config.expand_timesteps:
            problems.append(
                Problem(
                    "pipeline.unsupported_class",
                    "transformer",
                    f"{INDEX_FILE} sets expand_timesteps = true (Wan 2.2 TI2V's image to "
                    "video, a timestep per patch with the first frame's at 0), which this "
                    "recipe does not build",
                    "run the folder with diffusers, or as a WanPipeline (text to video)",
                )
            )
        if self.dit.image_width is not None and self.image_encoder is None:
            problems.append(
                Problem(
                    "pipeline.unsupported_class",
                    IMAGE_ENCODER,
                    f"the transformer cross-attends to image states {self.dit.image_width} "
                    "wide (image_dim), but the folder has no image_encoder to make them",
                    "restore the folder's image_encoder and image_processor",
                )
            )
        if problems:
            raise RecipeError(problems)

    @cached_property
    def video_processor(self) -> Any:
        """diffusers' video processor, which resizes and normalises the input images."""
        from diffusers.video_processor import VideoProcessor

        return VideoProcessor(vae_scale_factor=self.video_vae.scale_factor)

    def check(self, batch: Batch) -> list[str]:
        """Refuse a request without one input image per video, or a last image in a video
        too short to hold it; return the prompts.

        Raises:
            ValueError: as ``WanRecipe.check``, and for the images (the message says what
                to give).
        """
        prompts = super().check(batch)
        for name, images in (
            ("input_images", batch.input_images),
            ("last_images", batch.last_images),
        ):
            if images is not None and len(images) != batch.size:
                raise ValueError(
                    f"the batch carries {len(images)} {name} for {batch.size} videos; give "
                    "one per video"
                )
        if batch.input_images is None:
            raise ValueError(
                f"{self.pipeline_class} starts each video from an image: give one per video "
                "(--image, Batch.input_images)"
            )
        if batch.last_images is not None and self.frames(batch) < 2:
            raise ValueError(
                "a last image needs a video of at least 2 frames to end on; ask for more frames"
            )
        if self.image_encoder is not None and self.dit.image_width is not None:
            pairs = self.dit.reads_image_pairs
            if pairs != (batch.last_images is not None):
                raise ValueError(
                    "this folder's transformer reads the image states of a first and a last "
                    "image (pos_embed_seq_len): give a last image too (--last-image, "
                    "Batch.last_images)"
                    if pairs
                    else "this folder's transformer reads one image's states (it has no "
                    "pos_embed_seq_len for a first and a last): drop the last image, or run a "
                    "first-last-frame folder"
                )
        return prompts

    def encode(self, modules: Mapping[str, nn.Module], batch: Batch) -> None:
        """Embed the prompts, the input images' CLIP states (where the DiT reads them) and
        each video's condition (its encoded first, and last, frame with their mask)."""
        super().encode(modules, batch)
        assert batch.input_images is not None  # check() said so
        lasts = batch.last_images or [None] * batch.size
        pairs = list(zip(batch.input_images, lasts, strict=True))
        if self.image_encoder is not None and self.dit.image_width is not None:
            module = modules[IMAGE_ENCODER]
            batch.image_context = [
                self.image_encoder.encode(module, [first] if last is None else [first, last])
                for first, last in pairs
            ]
        (group,) = self.size_groups(batch)[:1]
        batch.condition = [
            self.condition(modules["vae"], batch, group.size, first, last) for first, last in pairs
        ]

    def condition(
        self, module: nn.Module, batch: Batch, size: tuple[int, int], first: Any, last: Any | None
    ) -> torch.Tensor:
        """Return one video's condition ``(4 + C, f, h, w)``: the mask of its given frames and
        the normalised latents of the video its first (and last) image start."""
        height, width = size
        frames = self.frames(batch)
        device, dtype = device_of(module), self.video_vae.dtype

        def image(picture: Any) -> torch.Tensor:  # (1, 3, 1, H, W) in [-1, 1]
            pixels: torch.Tensor = self.video_processor.preprocess(
                picture, height=height, width=width
            )
            return pixels.to(device, torch.float32).unsqueeze(2).to(dtype)

        def chunks() -> Iterator[torch.Tensor]:
            yield image(first)
            factor = self.video_vae.temporal_factor
            for start in range(1, frames, factor):  # frames 4i - 3 .. 4i
                chunk = torch.zeros((1, 3, factor, height, width), device=device, dtype=dtype)
                if last is not None and start + factor == frames:
                    chunk[:, :, -1:] = image(last)
                yield chunk

        encoded = self.video_vae.encode(module, chunks()).to(torch.float32)
        mean, std = (t.to(encoded) for t in self.video_vae.normalisation)
        latents = (encoded - mean) * (1.0 / std)  # diffusers' arithmetic, to the bit
        return torch.cat([self.mask(frames, last is not None, latents), latents], dim=1)[0]

    def mask(self, frames: int, has_last: bool, latents: torch.Tensor) -> torch.Tensor:
        """Return the mask ``(1, 4, f, h, w)`` of the frames given (1) and made (0), one
        channel per video frame of a latent frame, as diffusers folds it."""
        factor = self.video_vae.temporal_factor
        h, w = latents.shape[-2:]
        given = torch.zeros(1, 1, frames, h, w)
        given[:, :, 0] = 1
        if has_last:
            given[:, :, -1] = 1
        first = torch.repeat_interleave(given[:, :, 0:1], dim=2, repeats=factor)
        folded = torch.concat([first, given[:, :, 1:]], dim=2)  # (1, 1, F + 3, h, w)
        mask: torch.Tensor = folded.view(1, -1, factor, h, w).transpose(1, 2)
        return mask.to(latents.device)

    def model_input(self, latents: torch.Tensor, run: WanDenoising) -> torch.Tensor:
        """Return what the DiT reads: the latents and the condition ``(B_g, 2C + 4, f, h, w)``.

        Raises:
            ValueError: the encode stage made no condition.
        """
        if run.condition is None:
            raise ValueError("the denoise stage needs the encode stage's condition: run it first")
        return torch.cat([latents, run.condition], dim=1)

    def interface_problems(self) -> list[Problem]:
        """Check the VAE, text and image widths, and that the experts read the noise and the
        condition side by side."""
        found = super().interface_problems()
        expected = 2 * self.video_vae.latent_channels + MASK_CHANNELS
        for name, expert in zip(self.expert_names(), self.experts, strict=True):
            reads = int(expert.config["in_channels"])
            if reads != expected:
                found.append(
                    Problem(
                        "pipeline.interface_mismatch",
                        name,
                        f"component '{name}' reads {reads} channels, but image to video "
                        f"hands it the noise, the mask and the condition: {expected}",
                        "pick a DiT trained for image to video with this VAE",
                    )
                )
        if self.image_encoder is not None and self.dit.image_width is not None:
            wrote = width(self.image_encoder, "image_context", written=True)
            if wrote != self.dit.image_width:
                found.append(
                    Problem(
                        "pipeline.interface_mismatch",
                        "transformer",
                        f"component 'transformer' reads image states {self.dit.image_width} "
                        f"wide, but '{IMAGE_ENCODER}' writes them {wrote} wide",
                        "pick an image encoder whose width is the DiT's image_dim",
                    )
                )
        return found
