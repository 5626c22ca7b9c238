"""Z-Image: Qwen3's penultimate layer -> the Z-Image single-stream DiT -> an ``AutoencoderKL``.

As diffusers' ``ZImagePipeline`` calls them with its defaults: each prompt is the user's
message in the tokenizer's chat template (thinking left on), padded to 512 tokens; the
language model's penultimate layer gives the states of its real tokens, of each
prompt's own length. Guidance runs at any scale above 0 (Z-Image-Turbo runs at 0),
against the negative prompt ("" unless given): ``cond + scale * (cond - uncond)``,
computed in float32. A negative prompt at scale 0 would be ignored there; here it is
refused. The noise is drawn in float32, the DiT predicts the velocity's opposite, and the
VAE's latents are unscaled and shifted before decoding.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import torch
from torch import nn

from components.batch import Batch
from components.folders.problems import Problem
from components.kinds.llm_text_encoder import LlmTextEncoderLoader
from components.models.dit.z_image import ZImageInputs
from components.recipes.base import (
    DECODE,
    DENOISE,
    ENCODE,
    Denoising,
    Recipe,
    SizeGroup,
    Stage,
    guided_texts,
    latent_rows,
    narrow_scheduler,
)
from components.recipes.shift import flow_shift

__all__ = ["ZImageRecipe"]

# B images, C latent channels, h w latent grid, L tokens, E width

MAX_TOKENS = 512
"""diffusers' default ``max_sequence_length``."""
DEFAULT_SIDE = 1024
"""diffusers' default height and width, in pixels."""
Z_IMAGE_MAX_SHIFT = 1.15
"""The shift Z-Image's pipeline takes when the scheduler's config names none."""
PENULTIMATE = -2
"""The hidden states Z-Image reads: the last layer's input."""


class ZImageRecipe(Recipe):
    """Run ``ZImagePipeline`` (Qwen3 ``text_encoder``, ``transformer``, ``vae``)."""

    pipeline_class: ClassVar[str] = "ZImagePipeline"
    stages = (
        Stage(ENCODE, ("text_encoder",)),
        Stage(DENOISE, ("transformer",)),
        Stage(DECODE, ("vae",)),
    )
    default_steps = 50
    default_guidance = 5.0
    noise_dtype_of = "text_encoder"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.text_encoder = self.loader("text_encoder", LlmTextEncoderLoader)
        self.text_encoder.read_layers([PENULTIMATE])

    @property
    def multiple(self) -> int:
        """Sizes must be multiples of twice the VAE's scale (diffusers' check)."""
        return self.vae.scale_factor * 2

    def default_size(self) -> tuple[int, int]:
        """Return diffusers' default, 1024 pixels a side."""
        return DEFAULT_SIDE, DEFAULT_SIDE

    def noise_dtype(self) -> torch.dtype:
        """Return float32: Z-Image draws its noise and steps its latents in float32."""
        return torch.float32

    def guided(self, batch: Batch) -> bool:
        """Tell whether ``batch`` runs classifier-free guidance: at any scale above 0."""
        return self.guidance_scale(batch) > 0

    def template(self, text: str) -> str:
        """Return ``text`` as the user's message in Qwen3's chat template, thinking left on."""
        return self.text_encoder.chat(text, enable_thinking=True)

    def check(self, batch: Batch) -> list[str]:
        """Refuse a negative prompt at guidance scale 0, which diffusers ignores; return the
        prompts.

        Raises:
            ValueError: as ``Recipe.check``, or that.
        """
        prompts = super().check(batch)
        if batch.negative_prompts is not None and not self.guided(batch):
            raise ValueError(
                f"{self.pipeline_class} guides against the negative prompt only at a guidance "
                "scale above 0: at 0 it would be ignored; raise the guidance scale, or drop "
                "the negative prompt"
            )
        return prompts

    def encode(self, modules: Mapping[str, nn.Module], batch: Batch) -> None:
        """Embed the prompts (and, under guidance, the negative prompts) with Qwen3."""
        self.encode_with(self._embed, modules["text_encoder"], batch)

    def _embed(
        self, module: nn.Module, texts: Sequence[str]
    ) -> tuple[list[torch.Tensor], list[bool]]:
        """Return each text's states ``(L_i, E)`` (its real tokens), and whether it was cut."""
        encoder = self.text_encoder
        templated = [self.template(text) for text in texts]
        tokens = encoder.tokenize(templated, MAX_TOKENS)
        (states,) = encoder.hidden_states(module, tokens, boolean_mask=True)
        real = tokens.mask.to(states.device).bool()
        kept = [each[mask] for each, mask in zip(states, real, strict=True)]
        return kept, encoder.truncated(templated, MAX_TOKENS)

    def start(self, batch: Batch, group: SizeGroup, device: torch.device) -> ZImageDenoising:
        """Set up one size group: its noise, its text (and negatives) and its scheduler."""
        return ZImageDenoising(self, batch, group, device)

    def decode_group(self, module: nn.Module, batch: Batch, group: SizeGroup) -> torch.Tensor:
        """Unscale and shift a group's latents as the VAE's config says, and decode them."""
        return self.decode_latents(module, batch, group, shifted=True)

    def text_problems(self) -> list[Problem]:
        """Check Qwen3's width against the DiT's caption width."""
        return self.encoder_problems(self.text_encoder)


class ZImageDenoising(Denoising):
    """One size group of a Z-Image request: float32 latents, guided at any scale above 0.

    Args:
        recipe: the pipeline's recipe.
        batch: the batch, with the encode stage's text.
        group: the images of one size.
        device: where the DiT runs.

    Raises:
        ValueError: the encode stage has not run.
    """

    def __init__(
        self, recipe: ZImageRecipe, batch: Batch, group: SizeGroup, device: torch.device
    ) -> None:
        super().__init__(group)
        self.guide(recipe, batch)
        texts = guided_texts(batch, self.rows, self.guided)  # conditional first
        self.texts = [text.to(device) for text in texts]
        self.dtype = recipe.transformer.dtype
        self.latents = recipe.noise(batch, group).to(device)  # (B_g, C, h, w), float32
        h, w = self.latents.shape[-2:]
        scheduler = recipe.new_scheduler()
        steps = batch.steps
        mu = flow_shift(scheduler.config, (h // 2) * (w // 2), Z_IMAGE_MAX_SHIFT)
        sigmas = torch.linspace(1.0, 1 / steps, steps).tolist()
        scheduler.set_timesteps(sigmas=sigmas, device=device, mu=mu)
        scheduler.set_begin_index(0)
        self.scheduler = scheduler
        self.timesteps = scheduler.timesteps

    def inputs(self, step: int) -> ZImageInputs:
        """Return the DiT's arguments: each image (twice when guided), its text, the time."""
        latents = self.latents.to(self.dtype)
        if self.guided:
            latents = latents.repeat(2, 1, 1, 1)
        t = self.timesteps[step].expand(self.latents.shape[0])
        t = (1000 - t) / 1000
        return ZImageInputs(
            x=list(latents.unsqueeze(2).unbind(dim=0)),
            t=t.repeat(2) if self.guided else t,
            cap_feats=self.texts,
        )

    def advance(self, step: int, prediction: Any) -> None:
        """Guide in float32, turn the prediction into the scheduler's velocity, and step."""
        predicted = torch.stack([each.float() for each in prediction]).squeeze(2)
        if self.guided:
            cond, uncond = predicted.chunk(2)
            predicted = cond + self.scale * (cond - uncond)
        t = self.timesteps[step]
        self.latents = self.scheduler.step(-predicted, t, self.latents, return_dict=False)[0]

    def result(self) -> list[torch.Tensor]:
        """Return each image's latents ``(N, C)``."""
        return latent_rows(self.latents)

    def narrow(self, keep: list[int]) -> None:
        """Keep the images at ``keep``: their latents, text (negatives too), scheduler state."""
        both = self.branch_rows(keep)
        narrow_scheduler(self.scheduler, self.latents.shape, keep)
        self.latents = self.latents[keep]
        self.texts = [self.texts[i] for i in both]
