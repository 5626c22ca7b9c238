"""Stable Diffusion 3: two CLIP + T5 -> SD3 MMDiT with its flow-matching scheduler -> VAE.

As diffusers' ``StableDiffusion3Pipeline`` calls them with its defaults: each CLIP
(``text_encoder``, ``text_encoder_2``) gives its penultimate layer's states and its
projected pooled vector; the two state sets are joined along the width, zero-padded to
T5's width and put before T5's (``text_encoder_3``, 256 tokens, unmasked) along the
sequence; the pooled vectors are joined. Guidance runs when its scale is above 1,
against the negative prompt ("" unless given).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import torch
from torch import nn
from torch.nn import functional

from components.batch import Batch
from components.folders.problems import Problem
from components.kinds.clip_text_encoder import ClipTextEncoderLoader
from components.kinds.t5_encoder import T5EncoderLoader
from components.models.dit.sd3 import Sd3Inputs
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

__all__ = ["Sd3Recipe"]

# B images, C latent channels, h w latent grid, L tokens, E width, P pooled width

SD3_MAX_SHIFT = 1.16
"""The shift SD3's pipeline takes when a dynamically shifting scheduler's config names none."""
CLIPS = ("text_encoder", "text_encoder_2")


class Sd3Recipe(Recipe):
    """Run ``StableDiffusion3Pipeline`` (two CLIP, T5, the MMDiT, the VAE)."""

    pipeline_class: ClassVar[str] = "StableDiffusion3Pipeline"
    stages = (
        Stage(ENCODE, (*CLIPS, "text_encoder_3")),
        Stage(DENOISE, ("transformer",)),
        Stage(DECODE, ("vae",)),
    )
    default_steps = 28
    default_guidance = 7.0
    noise_dtype_of = "text_encoder"
    max_tokens: ClassVar[int] = 256

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.clips = [self.loader(name, ClipTextEncoderLoader) for name in CLIPS]
        self.t5 = self.loader("text_encoder_3", T5EncoderLoader)
        self.patch = int(self.transformer.config["patch_size"])

    @property
    def multiple(self) -> int:
        """Sizes must be multiples of the VAE's scale times the patch (diffusers' check)."""
        return self.vae.scale_factor * self.patch

    def encode(self, modules: Mapping[str, nn.Module], batch: Batch) -> None:
        """Embed the prompts with both CLIP and T5 (and the negatives under guidance)."""
        prompts = self.check(batch)
        batch.context, batch.pooled, truncated = self._embed(modules, prompts)
        batch.mark_truncated(truncated)
        if self.guided(batch):
            negative = batch.negative_prompts or [""] * len(prompts)
            batch.negative_context, batch.negative_pooled, _ = self._embed(modules, negative)

    def _embed(
        self, modules: Mapping[str, nn.Module], texts: Sequence[str]
    ) -> tuple[list[torch.Tensor], torch.Tensor, list[bool]]:
        """Return each text's joined states ``(77 + 256, E)``, pooled vectors ``(B, P)`` and
        whether any encoder cut it."""
        distinct, rows = unique_texts(texts)
        clips = [
            loader.encode(modules[name], distinct)
            for name, loader in zip(CLIPS, self.clips, strict=True)
        ]
        t5 = self.t5.encode(modules["text_encoder_3"], distinct, self.max_tokens, masked=False)
        clip_states = torch.cat([c.penultimate for c in clips], dim=-1)  # (B', 77, E1 + E2)
        t5_width = t5.hidden.shape[-1]
        clip_states = functional.pad(clip_states, (0, t5_width - clip_states.shape[-1]))
        states = torch.cat([clip_states, t5.hidden], dim=-2)  # (B', 77 + 256, E)
        pooled = torch.cat([c.pooled for c in clips], dim=-1)  # (B', P)
        cut = [
            any(each)
            for each in zip(
                *(loader.truncated(distinct, loader.max_tokens) for loader in self.clips),
                self.t5.truncated(distinct, self.max_tokens),
                strict=True,
            )
        ]
        return [states[row] for row in rows], pooled[rows], [cut[row] for row in rows]

    def start(self, batch: Batch, group: SizeGroup, device: torch.device) -> Sd3Denoising:
        """Set up one size group: its noise, its text (and negatives) and its scheduler."""
        return Sd3Denoising(self, batch, group, device)

    def decode_group(self, module: nn.Module, batch: Batch, group: SizeGroup) -> torch.Tensor:
        """Unscale and shift a group's latents as the VAE's config says, and decode them."""
        return self.decode_latents(module, batch, group, shifted=True)

    def text_problems(self) -> list[Problem]:
        """Check the joined text and pooled widths against the DiT."""
        transformer = self.transformer
        clip_states = [width(clip, "context", written=True) or 0 for clip in self.clips]
        t5_width = width(self.t5, "context", written=True) or 0
        found = [
            *mismatch(
                "transformer",
                "context",
                width(transformer, "context", written=False),
                ["text_encoder_3"],
                t5_width,
            ),
            *mismatch(
                "transformer",
                "pooled",
                width(transformer, "pooled", written=False),
                list(CLIPS),
                sum(width(clip, "pooled", written=True) or 0 for clip in self.clips),
            ),
        ]
        if sum(clip_states) > t5_width:
            found.append(
                Problem(
                    "pipeline.interface_mismatch",
                    "text_encoder_3",
                    f"the CLIP states ({' + '.join(map(str, clip_states))} wide) must fit "
                    f"inside T5's {t5_width}, where they are padded to its width",
                    "pick a T5 at least as wide as both CLIP encoders together",
                )
            )
        return found


class Sd3Denoising(Denoising):
    """One size group of an SD3 request: guided when the scale is above 1.

    Args:
        recipe: the pipeline's recipe.
        batch: the batch, with the encode stage's text.
        group: the images of one size.
        device: where the DiT runs.

    Raises:
        ValueError: the encode stage has not run.
    """

    def __init__(
        self, recipe: Sd3Recipe, batch: Batch, group: SizeGroup, device: torch.device
    ) -> None:
        if batch.context is None or batch.pooled is None:
            raise ValueError("the denoise stage needs the encode stage's text: run it first")
        super().__init__(group)
        rows = self.rows
        self.guide(recipe, batch)
        context = torch.stack([batch.context[row] for row in rows])
        pooled = batch.pooled[rows]
        if self.guided:
            if batch.negative_context is None or batch.negative_pooled is None:
                raise ValueError("guidance needs the negative prompts' text: run encode first")
            context = torch.cat(
                [torch.stack([batch.negative_context[row] for row in rows]), context]
            )
            pooled = torch.cat([batch.negative_pooled[rows], pooled])
        self.context, self.pooled = context.to(device), pooled.to(device)
        h, w = recipe.latent_size(group.size)
        self.latents = recipe.noise(batch, group).to(device)  # (B_g, C, h, w)
        scheduler = recipe.new_scheduler()
        options = {}
        if scheduler.config.get("use_dynamic_shifting"):
            tokens = (h // recipe.patch) * (w // recipe.patch)
            options["mu"] = flow_shift(scheduler.config, tokens, SD3_MAX_SHIFT)
        scheduler.set_timesteps(batch.steps, device=device, **options)
        self.scheduler = scheduler
        self.timesteps = scheduler.timesteps

    def inputs(self, step: int) -> Sd3Inputs:
        """Return the DiT's arguments: the latents (twice when guided), text, timestep."""
        model_input = torch.cat([self.latents] * 2) if self.guided else self.latents
        return Sd3Inputs(
            hidden_states=model_input,
            timestep=self.timesteps[step].expand(model_input.shape[0]),
            encoder_hidden_states=self.context,
            pooled_projections=self.pooled,
        )

    def advance(self, step: int, prediction: torch.Tensor) -> None:
        """Guide and step the scheduler."""
        if self.guided:
            uncond, cond = prediction.chunk(2)
            prediction = uncond + self.scale * (cond - uncond)
        t = self.timesteps[step]
        self.latents = self.scheduler.step(prediction, t, self.latents, return_dict=False)[0]

    def result(self) -> list[torch.Tensor]:
        """Return each image's latents ``(N, C)``."""
        return latent_rows(self.latents)

    def narrow(self, keep: list[int]) -> None:
        """Keep the images at ``keep``: their latents, text (negatives too), scheduler state."""
        both = self.branch_rows(keep)
        narrow_scheduler(self.scheduler, self.latents.shape, keep)
        self.latents = self.latents[keep]
        self.context, self.pooled = self.context[both], self.pooled[both]
