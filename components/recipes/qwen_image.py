"""Qwen-Image: Qwen2.5-VL's last layer -> the Qwen-Image MMDiT (flow matching) -> its VAE.

As diffusers' ``QwenImagePipeline`` calls them with its defaults: each prompt is put in
the pipeline's chat template (a system prompt, then the prompt as the user's message),
tokenised (padded to the longest, at most 1,024 + 34 tokens) and run through the
language model; its last layer's states of the real tokens are kept, less the template's
first 34 tokens (the system prompt and the user's header), and at most 512 of them.
Guidance is "true CFG": the scale (diffusers' ``true_cfg_scale``) acts only against a
negative prompt, and the guided prediction is rescaled to the norm of the conditional
one. A guidance scale with no negative prompt, or a negative prompt with a scale of 1 or
less, would be ignored there; here either is refused. Latents are packed two by two into
tokens, sigmas are shifted by the image's token count, and the VAE's latents are
un-normalised by its ``latents_mean`` and ``latents_std`` before decoding.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import numpy as np
import torch
from torch import nn

from components.batch import Batch, device_of
from components.folders.problems import Problem
from components.kinds.autoencoder_kl_qwen_image import AutoencoderKlQwenImageLoader
from components.kinds.llm_text_encoder import LlmTextEncoderLoader
from components.models.dit.qwen_image import QwenImageInputs
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
from components.recipes.flux import pack, unpack
from components.recipes.shift import flow_shift

__all__ = ["QwenImageRecipe"]

# B images, C latent channels, h w latent grid, N packed tokens (h/2 * w/2), L tokens, E width

TEMPLATE = (
    "<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, "
    "quantity, text, spatial relationships of the objects and background:<|im_end|>\n"
    "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
)
"""diffusers' ``prompt_template_encode``."""
DROPPED = 34
"""diffusers' ``prompt_template_encode_start_idx``: the template's tokens before the prompt."""
TOKENIZER_LENGTH = 1024
"""diffusers' ``tokenizer_max_length``: the prompt's tokens read past the dropped ones."""
MAX_TOKENS = 512
"""diffusers' default ``max_sequence_length``: the states kept of each prompt."""
DEFAULT_SAMPLE_SIZE = 128
"""diffusers' ``default_sample_size``: the default image side in latents."""
LAST = -1
"""The hidden states Qwen-Image reads: the last layer's, after the final norm (every layer
runs)."""
QWEN_MAX_SHIFT = 1.15
"""The shift Qwen-Image's pipeline takes when the scheduler's config names none."""


class QwenImageRecipe(Recipe):
    """Run ``QwenImagePipeline`` (Qwen2.5-VL ``text_encoder``, ``transformer``, ``vae``)."""

    pipeline_class: ClassVar[str] = "QwenImagePipeline"
    stages = (
        Stage(ENCODE, ("text_encoder",)),
        Stage(DENOISE, ("transformer",)),
        Stage(DECODE, ("vae",)),
    )
    default_steps = 50
    default_guidance = 4.0
    noise_dtype_of = "text_encoder"
    vae_kind = AutoencoderKlQwenImageLoader

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.text_encoder = self.loader("text_encoder", LlmTextEncoderLoader)
        self.text_encoder.read_layers([LAST])

    @property
    def multiple(self) -> int:
        """Sizes must be multiples of twice the VAE's scale (2 x 2 packing of the latents).

        diffusers resizes other sizes with a warning; they are refused here instead.
        """
        return self.vae.scale_factor * 2

    def default_size(self) -> tuple[int, int]:
        """Return 128 latents a side in pixels (diffusers' ``default_sample_size``)."""
        side = DEFAULT_SAMPLE_SIZE * self.vae.scale_factor
        return side, side

    def guided(self, batch: Batch) -> bool:
        """Tell whether ``batch`` runs true CFG: a scale above 1 and a negative prompt."""
        return self.guidance_scale(batch) > 1 and batch.negative_prompts is not None

    def template(self, text: str) -> str:
        """Return ``text`` as the user's message after the system prompt (``TEMPLATE``)."""
        return TEMPLATE.format(text)

    def check(self, batch: Batch) -> list[str]:
        """Refuse what diffusers would ignore: a guidance scale without a negative prompt, or a
        negative prompt without a guidance scale above 1; return the prompts.

        Raises:
            ValueError: as ``Recipe.check``, or either of those.
        """
        prompts = super().check(batch)
        if batch.negative_prompts is None and (batch.guidance_scale or 0) > 1:
            raise ValueError(
                f"{self.pipeline_class} guides (true CFG) only against a negative prompt: "
                f"guidance scale {batch.guidance_scale} would be ignored without one; give a "
                'negative prompt (an empty one, "", guides against the empty prompt), or drop '
                "the guidance scale"
            )
        if batch.negative_prompts is not None and self.guidance_scale(batch) <= 1:
            raise ValueError(
                f"{self.pipeline_class} guides against the negative prompt only at a guidance "
                f"scale above 1: at {self.guidance_scale(batch)} it would be ignored; raise the "
                "guidance scale, or drop the negative prompt"
            )
        return prompts

    def encode(self, modules: Mapping[str, nn.Module], batch: Batch) -> None:
        """Embed the prompts (and the negative prompts under true CFG) with the language model."""
        self.encode_with(self._embed, modules["text_encoder"], batch)

    def _embed(
        self, module: nn.Module, texts: Sequence[str]
    ) -> tuple[list[torch.Tensor], list[bool]]:
        """Return each text's states ``(L_i, E)`` past the template's head, and whether it
        was cut."""
        templated = [self.template(text) for text in texts]
        tokens = self.text_encoder.tokenize(templated, TOKENIZER_LENGTH + DROPPED, longest=True)
        (states,) = self.text_encoder.hidden_states(module, tokens, boolean_mask=False)
        kept = [
            each[real.bool()][DROPPED:].to(self.text_encoder.dtype)
            for each, real in zip(states, tokens.mask.to(states.device), strict=True)
        ]
        return [each[:MAX_TOKENS] for each in kept], [len(each) > MAX_TOKENS for each in kept]

    def start(self, batch: Batch, group: SizeGroup, device: torch.device) -> QwenImageDenoising:
        """Set up one size group: its packed noise, its text (and negatives) and its scheduler."""
        return QwenImageDenoising(self, batch, group, device)

    def decode_group(self, module: nn.Module, batch: Batch, group: SizeGroup) -> torch.Tensor:
        """Un-normalise a group's latents by the VAE's mean and deviation, and decode them."""
        config = self.vae.config
        given = [] if batch.latents is None else [batch.latents[row] for row in group.rows]
        latents = latent_grid(given, *self.latent_size(group.size))
        latents = latents.to(device_of(module), self.vae.dtype)
        shape = (1, self.vae.latent_channels, 1, 1)
        mean = torch.tensor(config["latents_mean"]).view(shape).to(latents)
        inverse_std = 1.0 / torch.tensor(config["latents_std"]).view(shape).to(latents)
        return self.vae.decode(module, latents / inverse_std + mean)  # diffusers' arithmetic

    def text_problems(self) -> list[Problem]:
        """Check the language model's width against the DiT's text width."""
        return self.encoder_problems(self.text_encoder)


class QwenImageDenoising(Denoising):
    """One size group of a Qwen-Image request: packed latents, true CFG with a negative prompt.

    Args:
        recipe: the pipeline's recipe.
        batch: the batch, with the encode stage's text.
        group: the images of one size.
        device: where the DiT runs.

    Raises:
        ValueError: the encode stage has not run.
    """

    def __init__(
        self, recipe: QwenImageRecipe, batch: Batch, group: SizeGroup, device: torch.device
    ) -> None:
        super().__init__(group)
        self.guide(recipe, batch)
        texts = guided_texts(batch, self.rows, self.guided)  # conditional first
        self.texts = [text.to(device) for text in texts]
        self.h, self.w = recipe.latent_size(group.size)
        self.latents = pack(recipe.noise(batch, group)).to(device)  # (B_g, N, 4C)
        scheduler = recipe.new_scheduler()
        steps = batch.steps
        mu = flow_shift(scheduler.config, self.latents.shape[1], QWEN_MAX_SHIFT)
        sigmas = np.linspace(1.0, 1 / steps, steps)
        scheduler.set_timesteps(sigmas=sigmas, device=device, mu=mu)
        scheduler.set_begin_index(0)
        self.scheduler = scheduler
        self.timesteps = scheduler.timesteps

    def inputs(self, step: int) -> QwenImageInputs:
        """Return the DiT's arguments: the latents (twice when guided), text, mask, timestep."""
        latents = torch.cat([self.latents] * 2) if self.guided else self.latents
        count = latents.shape[0]
        context, mask = padded(self.texts)
        timestep = self.timesteps[step].expand(count).to(latents.dtype)
        return QwenImageInputs(
            hidden_states=latents,
            encoder_hidden_states=context,
            encoder_hidden_states_mask=mask,
            timestep=timestep / 1000,
            img_shapes=[[(1, self.h // 2, self.w // 2)]] * count,
        )

    def advance(self, step: int, prediction: torch.Tensor) -> None:
        """Guide (rescaled to the conditional prediction's norm) and step the scheduler."""
        if self.guided:
            cond, uncond = prediction.chunk(2)
            combined = uncond + self.scale * (cond - uncond)
            cond_norm = torch.norm(cond, dim=-1, keepdim=True)
            prediction = combined * (cond_norm / torch.norm(combined, dim=-1, keepdim=True))
        t = self.timesteps[step]
        self.latents = self.scheduler.step(prediction, t, self.latents, return_dict=False)[0]

    def result(self) -> list[torch.Tensor]:
        """Return each image's unpacked latents ``(h * w, C)``."""
        return latent_rows(unpack(self.latents, self.h, self.w))

    def narrow(self, keep: list[int]) -> None:
        """Keep the images at ``keep``: their packed latents, text (negatives too), scheduler."""
        both = self.branch_rows(keep)
        narrow_scheduler(self.scheduler, self.latents.shape, keep)
        self.latents = self.latents[keep]
        self.texts = [self.texts[i] for i in both]


def padded(texts: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Stack texts ``(L_i, E)`` into ``(B, L, E)``, zero-padded to the longest, with the mask of
    their real tokens ``(B, L)``; the mask is None when none is padded (as diffusers')."""
    longest = max(len(text) for text in texts)
    context = torch.stack(
        [torch.cat([t, t.new_zeros(longest - len(t), t.shape[1])]) for t in texts]
    )
    if all(len(text) == longest for text in texts):
        return context, None
    mask = torch.stack(
        [torch.arange(longest, device=context.device) < len(text) for text in texts]
    ).long()
    return context, mask
