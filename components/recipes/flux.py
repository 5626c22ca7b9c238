"""Flux: CLIP's pooled vector + T5's states -> Flux DiT with its flow-matching scheduler -> VAE.

As diffusers' ``FluxPipeline`` calls them with its defaults: CLIP (``text_encoder``)
gives the pooled vector, T5 (``text_encoder_2``) the token states of the prompt padded
to 512 tokens, attended to whole. Guidance is distilled: the scale enters the DiT as an
embedding (where its config has ``guidance_embeds``), with no unconditional pass, so a
negative prompt has nothing to act on and is refused. Latents are packed two by two
into tokens, the sigmas are shifted by the image's token count (``mu``), and the VAE's
latents are unscaled and shifted before decoding.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import numpy as np
import torch
from torch import nn

from components.batch import Batch
from components.folders.problems import Problem
from components.kinds.clip_text_encoder import ClipTextEncoderLoader
from components.kinds.t5_encoder import T5EncoderLoader
from components.models.dit.flux import FluxInputs
from components.recipes.base import (
    DECODE,
    DENOISE,
    ENCODE,
    Denoising,
    Recipe,
    SizeGroup,
    Stage,
    latent_rows,
    mismatch,
    narrow_scheduler,
    unique_texts,
    width,
)
from components.recipes.shift import flow_shift

__all__ = ["FluxRecipe", "pack", "unpack"]

# B images, C latent channels, h w latent grid, N packed tokens (h/2 * w/2), L tokens

DEFAULT_SAMPLE_SIZE = 128
"""diffusers' ``FluxPipeline.default_sample_size``: the default image side in latents."""
FLUX_MAX_SHIFT = 1.15
"""The shift Flux's pipeline takes when the scheduler's config names none."""


class FluxRecipe(Recipe):
    """Run ``FluxPipeline`` (CLIP ``text_encoder``, T5 ``text_encoder_2``, DiT, VAE)."""

    pipeline_class: ClassVar[str] = "FluxPipeline"
    stages = (
        Stage(ENCODE, ("text_encoder", "text_encoder_2")),
        Stage(DENOISE, ("transformer",)),
        Stage(DECODE, ("vae",)),
    )
    default_steps = 28
    default_guidance = 3.5
    takes_negative_prompt = False
    noise_dtype_of = "text_encoder_2"
    max_tokens: ClassVar[int] = 512

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.clip = self.loader("text_encoder", ClipTextEncoderLoader)
        self.t5 = self.loader("text_encoder_2", T5EncoderLoader)

    @property
    def multiple(self) -> int:
        """Sizes must be multiples of twice the VAE's scale (2 x 2 packing of the latents).

        diffusers cuts other sizes down silently; they are refused here instead.
        """
        return self.vae.scale_factor * 2

    def default_size(self) -> tuple[int, int]:
        """Return 128 latents a side in pixels (diffusers' ``default_sample_size``)."""
        side = DEFAULT_SAMPLE_SIZE * self.vae.scale_factor
        return side, side

    def encode(self, modules: Mapping[str, nn.Module], batch: Batch) -> None:
        """Pool each prompt with CLIP and embed it with T5 (no mask, 512 tokens).

        Raises:
            ValueError: the batch has no prompts, or negative prompts (distilled guidance
                has no unconditional pass to use them).
        """
        distinct, rows = unique_texts(self.check(batch))
        pooled = self.clip.pooled(modules["text_encoder"], distinct)  # (B', P)
        hidden = self.t5.encode(modules["text_encoder_2"], distinct, self.max_tokens, masked=False)
        batch.pooled = pooled[rows]
        batch.context = [hidden.hidden[row] for row in rows]  # (L, E) each
        # T5 reads the prompt; CLIP pools its first 77 tokens, as diffusers does
        cut = self.t5.truncated(distinct, self.max_tokens)
        batch.mark_truncated([cut[row] for row in rows])

    def start(self, batch: Batch, group: SizeGroup, device: torch.device) -> FluxDenoising:
        """Set up one size group: its packed noise, its text, positions and scheduler."""
        return FluxDenoising(self, batch, group, device)

    def set_timesteps(self, scheduler: Any, steps: int, tokens: int, device: torch.device) -> None:
        """Set Flux's sigmas (1 down to 1/steps), shifted by the image's token count."""
        config = scheduler.config
        sigmas = None if config.get("use_flow_sigmas") else np.linspace(1.0, 1 / steps, steps)
        mu = flow_shift(config, tokens, FLUX_MAX_SHIFT)
        if sigmas is None:
            scheduler.set_timesteps(steps, device=device, mu=mu)
        else:
            scheduler.set_timesteps(sigmas=sigmas, device=device, mu=mu)

    def decode_group(self, module: nn.Module, batch: Batch, group: SizeGroup) -> torch.Tensor:
        """Unscale and shift a group's latents as the VAE's config says, and decode them."""
        return self.decode_latents(module, batch, group, shifted=True)

    def text_problems(self) -> list[Problem]:
        """Check T5's width and CLIP's pooled width against the DiT."""
        transformer = self.transformer
        return [
            *mismatch(
                "transformer",
                "context",
                width(transformer, "context", written=False),
                ["text_encoder_2"],
                width(self.t5, "context", written=True),
            ),
            *mismatch(
                "transformer",
                "pooled",
                width(transformer, "pooled", written=False),
                ["text_encoder"],
                width(self.clip, "pooled", written=True),
            ),
        ]


class FluxDenoising(Denoising):
    """One size group of a Flux request: packed latents, distilled guidance, shifted sigmas.

    Args:
        recipe: the pipeline's recipe.
        batch: the batch, with the encode stage's text.
        group: the images of one size.
        device: where the DiT runs.

    Raises:
        ValueError: the encode stage has not run.
    """

    def __init__(
        self, recipe: FluxRecipe, batch: Batch, group: SizeGroup, device: torch.device
    ) -> None:
        if batch.context is None or batch.pooled is None:
            raise ValueError("the denoise stage needs the encode stage's text: run it first")
        super().__init__(group)
        rows = self.rows
        self.h, self.w = recipe.latent_size(group.size)
        self.latents = pack(recipe.noise(batch, group)).to(device)  # (B_g, N, 4C)
        self.context = torch.stack([batch.context[row] for row in rows]).to(device)  # (B_g, L, E)
        self.pooled = batch.pooled[rows].to(device)
        count, tokens = self.latents.shape[:2]
        self.text_ids = torch.zeros(
            self.context.shape[1], 3, device=device, dtype=recipe.clip.dtype
        )
        self.image_ids = positions(self.h // 2, self.w // 2).to(device, self.latents.dtype)
        scheduler = recipe.new_scheduler()
        recipe.set_timesteps(scheduler, batch.steps, tokens, device)
        scheduler.set_begin_index(0)
        self.scheduler = scheduler
        self.timesteps = scheduler.timesteps
        self.guidance = None
        if recipe.transformer.config.get("guidance_embeds"):
            scale = recipe.guidance_scale(batch)
            guidance = torch.full([1], scale, device=device, dtype=torch.float32)
            self.guidance = guidance.expand(count)

    def inputs(self, step: int) -> FluxInputs:
        """Return the DiT's arguments at ``step``."""
        timestep = self.timesteps[step].expand(self.latents.shape[0]).to(self.latents.dtype)
        return FluxInputs(
            hidden_states=self.latents,
            timestep=timestep / 1000,
            guidance=self.guidance,
            pooled_projections=self.pooled,
            encoder_hidden_states=self.context,
            txt_ids=self.text_ids,
            img_ids=self.image_ids,
        )

    def advance(self, step: int, prediction: torch.Tensor) -> None:
        """Step the flow-matching scheduler."""
        t = self.timesteps[step]
        self.latents = self.scheduler.step(prediction, t, self.latents, return_dict=False)[0]

    def result(self) -> list[torch.Tensor]:
        """Return each image's unpacked latents ``(h * w, C)``."""
        return latent_rows(unpack(self.latents, self.h, self.w))

    def narrow(self, keep: list[int]) -> None:
        """Keep the images at ``keep``: their packed latents, text, guidance, scheduler state."""
        narrow_scheduler(self.scheduler, self.latents.shape, keep)
        self.latents = self.latents[keep]
        self.context, self.pooled = self.context[keep], self.pooled[keep]
        if self.guidance is not None:
            self.guidance = self.guidance[keep]


def pack(latents: torch.Tensor) -> torch.Tensor:
    """Pack ``(B, C, h, w)`` latents two by two into tokens ``(B, h/2 * w/2, 4C)``."""
    b, c, h, w = latents.shape
    patches = latents.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5)
    return patches.reshape(b, (h // 2) * (w // 2), c * 4)


def unpack(tokens: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """Unpack tokens ``(B, h/2 * w/2, 4C)`` into latents ``(B, C, h, w)``."""
    b, _, packed = tokens.shape
    patches = tokens.view(b, h // 2, w // 2, packed // 4, 2, 2).permute(0, 3, 1, 4, 2, 5)
    return patches.reshape(b, packed // 4, h, w)


def positions(rows: int, columns: int) -> torch.Tensor:
    """Return each packed token's position ``(rows * columns, 3)``: (0, row, column)."""
    grid = torch.zeros(rows, columns, 3)
    grid[..., 1] = torch.arange(rows)[:, None]
    grid[..., 2] = torch.arange(columns)[None, :]
    return grid.reshape(rows * columns, 3)
