"""Flux.2 klein: three Qwen3 layers side by side -> the Flux.2 DiT -> Flux.2's VAE.

As diffusers' ``Flux2KleinPipeline`` calls them with its defaults (text to image): each
prompt is the user's message in the tokenizer's chat template with thinking turned off,
padded to 512 tokens; the language model's hidden states after layers 9, 18 and 27 are
joined along the width. The base model guides against the empty prompt at scales above
1 (its call takes no negative prompt: one is refused here); a distilled one
(``"is_distilled": true`` in ``model_index.json``) never guides, so a guidance scale
above 1, which diffusers would ignore, is refused too. The noise is drawn patchified two
by two, sigmas are shifted by an empirical fit of the token count and the steps, and the
latents are un-normalised by the VAE's batch norm statistics and unpatchified before
decoding.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, ClassVar, NamedTuple

import numpy as np
import torch
from torch import nn

from components.batch import Batch, device_of
from components.folders.problems import Problem
from components.kinds.autoencoder_kl_flux2 import AutoencoderKlFlux2Loader
from components.kinds.llm_text_encoder import LlmTextEncoderLoader
from components.recipes.base import (
    DECODE,
    DENOISE,
    ENCODE,
    Denoising,
    Recipe,
    SizeGroup,
    Stage,
    guided_texts,
    latent_grid,
    latent_rows,
    narrow_scheduler,
)

__all__ = ["Flux2KleinRecipe"]

# B images, C latent channels, h w latent grid, N tokens (h/2 * w/2), L tokens, E width

MAX_TOKENS = 512
"""diffusers' default ``max_sequence_length``."""
TEXT_LAYERS = (9, 18, 27)
"""diffusers' default ``text_encoder_out_layers``: the hidden states joined."""
DEFAULT_SAMPLE_SIZE = 128
"""diffusers' ``default_sample_size``: the default image side in latents."""
DISTILLED = "is_distilled"
"""The ``model_index.json`` entry that says the model was distilled (guidance built in)."""


class Flux2Inputs(NamedTuple):
    """One group's arguments to ``Flux2Transformer2DModel``, as diffusers' call passes them."""

    hidden_states: torch.Tensor  # (B, N, 4C)
    encoder_hidden_states: torch.Tensor  # (B, L, 3E)
    timestep: torch.Tensor  # (B,) in [0, 1]
    img_ids: torch.Tensor  # (N, 4) int64: (0, row, column, 0)
    txt_ids: torch.Tensor  # (L, 4) int64: (0, 0, 0, token)
    guidance: None = None


class Flux2KleinRecipe(Recipe):
    """Run ``Flux2KleinPipeline`` (Qwen3 ``text_encoder``, ``transformer``, ``vae``)."""

    pipeline_class: ClassVar[str] = "Flux2KleinPipeline"
    stages = (
        Stage(ENCODE, ("text_encoder",)),
        Stage(DENOISE, ("transformer",)),
        Stage(DECODE, ("vae",)),
    )
    default_steps = 50
    default_guidance = 4.0
    takes_negative_prompt = False
    noise_dtype_of = "text_encoder"
    vae_kind = AutoencoderKlFlux2Loader

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.text_encoder = self.loader("text_encoder", LlmTextEncoderLoader)
        self.text_encoder.read_layers(TEXT_LAYERS)
        self.flux2_vae = self.loader("vae", AutoencoderKlFlux2Loader)
        self.distilled = bool(self.index.config.get(DISTILLED, False))

    @property
    def multiple(self) -> int:
        """Sizes must be multiples of twice the VAE's scale (2 x 2 patches of the latents).

        diffusers cuts other sizes down with a warning; they are refused here instead.
        """
        return self.vae.scale_factor * 2

    def default_size(self) -> tuple[int, int]:
        """Return 128 latents a side in pixels (diffusers' ``default_sample_size``)."""
        side = DEFAULT_SAMPLE_SIZE * self.vae.scale_factor
        return side, side

    def guided(self, batch: Batch) -> bool:
        """Tell whether ``batch`` runs guidance: a base model at a scale above 1."""
        return not self.distilled and self.guidance_scale(batch) > 1

    def template(self, text: str) -> str:
        """Return ``text`` as the user's message in Qwen3's chat template, thinking off."""
        return self.text_encoder.chat(text, enable_thinking=False)

    def check(self, batch: Batch) -> list[str]:
        """Refuse what diffusers' call cannot take or ignores; return the prompts.

        Raises:
            ValueError: as ``Recipe.check``; a negative prompt (the call takes none: the
                base model guides against the empty prompt); a guidance scale above 1 on a
                distilled model.
        """
        if batch.negative_prompts is not None:
            raise ValueError(
                f"{self.pipeline_class} takes no negative prompt: the base model guides "
                "against the empty prompt, a distilled one not at all; drop it"
            )
        prompts = super().check(batch)
        if self.distilled and (batch.guidance_scale or 0) > 1:
            raise ValueError(
                f"this {self.pipeline_class} is distilled ({DISTILLED} in model_index.json): "
                f"it runs no guidance, and guidance scale {batch.guidance_scale} would be "
                "ignored; drop it (or use the base model)"
            )
        return prompts

    def encode(self, modules: Mapping[str, nn.Module], batch: Batch) -> None:
        """Embed the prompts (and, under guidance, the empty prompt) with Qwen3."""
        self.encode_with(self._embed, modules["text_encoder"], batch)

    def _embed(
        self, module: nn.Module, texts: Sequence[str]
    ) -> tuple[list[torch.Tensor], list[bool]]:
        """Return each text's joined states ``(512, 3E)``, and whether it was cut."""
        encoder = self.text_encoder
        templated = [self.template(text) for text in texts]
        tokens = encoder.tokenize(templated, MAX_TOKENS)
        layers = encoder.hidden_states(module, tokens, boolean_mask=False)
        joined = torch.stack(layers, dim=1).to(encoder.dtype)  # (B', 3, L, E)
        b, count, length, each = joined.shape
        states = joined.permute(0, 2, 1, 3).reshape(b, length, count * each)
        return list(states), encoder.truncated(templated, MAX_TOKENS)

    def draw_latents(
        self, generator: torch.Generator, count: int, size: tuple[int, int]
    ) -> list[torch.Tensor]:
        """Draw the noise of ``count`` images as diffusers draws it: patchified two by two,
        ``(count, 4C, h/2, w/2)``; returns one ``(N, C)`` tensor per image, unpatchified."""
        h, w = self.latent_size(size)
        shape = (count, self.channels * 4, h // 2, w // 2)
        noise = torch.randn(shape, generator=generator, dtype=self.noise_dtype())
        return latent_rows(unpatchify(noise))

    def start(self, batch: Batch, group: SizeGroup, device: torch.device) -> Flux2Denoising:
        """Set up one size group: its packed noise, its text (and the empty prompt's), ids and
        scheduler."""
        return Flux2Denoising(self, batch, group, device)

    def decode_group(self, module: nn.Module, batch: Batch, group: SizeGroup) -> torch.Tensor:
        """Un-normalise a group's patchified latents by the VAE's batch norm, and decode them."""
        given = [] if batch.latents is None else [batch.latents[row] for row in group.rows]
        latents = latent_grid(given, *self.latent_size(group.size))
        latents = latents.to(device_of(module), self.vae.dtype)
        patches = self.flux2_vae.denormalize(module, patchify(latents))
        return self.vae.decode(module, unpatchify(patches))

    def text_problems(self) -> list[Problem]:
        """Check the joined layers' width against the DiT's text width."""
        return self.encoder_problems(self.text_encoder, len(TEXT_LAYERS))


class Flux2Denoising(Denoising):
    """One size group of a Flux.2 klein request: packed patches, guided against "" or not.

    Args:
        recipe: the pipeline's recipe.
        batch: the batch, with the encode stage's text.
        group: the images of one size.
        device: where the DiT runs.

    Raises:
        ValueError: the encode stage has not run.
    """

    def __init__(
        self, recipe: Flux2KleinRecipe, batch: Batch, group: SizeGroup, device: torch.device
    ) -> None:
        super().__init__(group)
        self.guide(recipe, batch)
        texts = guided_texts(batch, self.rows, self.guided)  # conditional first
        self.context = torch.stack(texts).to(device)
        self.dtype = recipe.transformer.dtype
        patches = patchify(recipe.noise(batch, group))  # (B_g, 4C, h/2, w/2)
        _, _, self.rows_of, self.columns = patches.shape
        self.latents = pack(patches).to(device)  # (B_g, N, 4C)
        self.image_ids = positions(self.rows_of, self.columns).to(device)
        self.text_ids = token_positions(self.context.shape[1]).to(device)
        scheduler = recipe.new_scheduler()
        steps = batch.steps
        sigmas = (
            None if scheduler.config.get("use_flow_sigmas") else np.linspace(1, 1 / steps, steps)
        )
        mu = empirical_mu(self.latents.shape[1], steps)
        if sigmas is None:
            scheduler.set_timesteps(steps, device=device, mu=mu)
        else:
            scheduler.set_timesteps(sigmas=sigmas, device=device, mu=mu)
        scheduler.set_begin_index(0)
        self.scheduler = scheduler
        self.timesteps = scheduler.timesteps

    def inputs(self, step: int) -> Flux2Inputs:
        """Return the DiT's arguments: the latents (twice when guided), text, ids, timestep."""
        latents = torch.cat([self.latents] * 2) if self.guided else self.latents
        timestep = self.timesteps[step].expand(latents.shape[0]).to(self.latents.dtype)
        return Flux2Inputs(
            hidden_states=latents.to(self.dtype),
            encoder_hidden_states=self.context,
            timestep=timestep / 1000,
            img_ids=self.image_ids,
            txt_ids=self.text_ids,
        )

    def advance(self, step: int, prediction: torch.Tensor) -> None:
        """Guide against the empty prompt (where it runs) and step the scheduler."""
        prediction = prediction[:, : self.latents.shape[1]]
        if self.guided:
            cond, uncond = prediction.chunk(2)
            prediction = uncond + self.scale * (cond - uncond)
        t = self.timesteps[step]
        self.latents = self.scheduler.step(prediction, t, self.latents, return_dict=False)[0]

    def result(self) -> list[torch.Tensor]:
        """Return each image's unpacked, unpatchified latents ``(h * w, C)``."""
        b, _, channels = self.latents.shape
        patches = self.latents.permute(0, 2, 1).reshape(b, channels, self.rows_of, self.columns)
        return latent_rows(unpatchify(patches))

    def narrow(self, keep: list[int]) -> None:
        """Keep the images at ``keep``: their packed latents, text (negatives too), scheduler."""
        both = self.branch_rows(keep)
        narrow_scheduler(self.scheduler, self.latents.shape, keep)
        self.latents = self.latents[keep]
        self.context = self.context[both]


def patchify(latents: torch.Tensor) -> torch.Tensor:
    """Fold 2 x 2 patches of latents ``(B, C, h, w)`` into channels ``(B, 4C, h/2, w/2)``."""
    b, c, h, w = latents.shape
    patches = latents.view(b, c, h // 2, 2, w // 2, 2).permute(0, 1, 3, 5, 2, 4)
    return patches.reshape(b, c * 4, h // 2, w // 2)


def unpatchify(patches: torch.Tensor) -> torch.Tensor:
    """Unfold ``(B, 4C, h/2, w/2)`` back into latents ``(B, C, h, w)``."""
    b, c4, rows, columns = patches.shape
    latents = patches.reshape(b, c4 // 4, 2, 2, rows, columns).permute(0, 1, 4, 2, 5, 3)
    return latents.reshape(b, c4 // 4, rows * 2, columns * 2)


def pack(patches: torch.Tensor) -> torch.Tensor:
    """Make tokens ``(B, N, 4C)`` of patches ``(B, 4C, h/2, w/2)``, row-major."""
    b, channels, rows, columns = patches.shape
    return patches.reshape(b, channels, rows * columns).permute(0, 2, 1)


def positions(rows: int, columns: int) -> torch.Tensor:
    """Return each image token's position ``(rows * columns, 4)``: (0, row, column, 0)."""
    return torch.cartesian_prod(
        torch.arange(1), torch.arange(rows), torch.arange(columns), torch.arange(1)
    )


def token_positions(length: int) -> torch.Tensor:
    """Return each text token's position ``(length, 4)``: (0, 0, 0, token)."""
    return torch.cartesian_prod(
        torch.arange(1), torch.arange(1), torch.arange(1), torch.arange(length)
    )


def empirical_mu(tokens: int, steps: int) -> float:
    """Return Flux.2's sigma shift for ``tokens`` image tokens and ``steps`` steps.

    A linear fit in the steps between two fits in the token count (10 and 200 steps),
    past 4,300 tokens the 200-step one alone: diffusers' ``compute_empirical_mu``, in its
    order of operations.
    """
    a1, b1 = 8.73809524e-05, 1.89833333
    a2, b2 = 0.00016927, 0.45666666
    if tokens > 4300:
        return float(a2 * tokens + b2)
    at_200 = a2 * tokens + b2
    at_10 = a1 * tokens + b1
    slope = (at_200 - at_10) / 190.0
    return float(slope * steps + (at_200 - 200.0 * slope))
