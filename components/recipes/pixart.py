"""PixArt-alpha and PixArt-sigma: T5 (masked) -> PixArt DiT with its scheduler -> VAE.

As diffusers' ``PixArtAlphaPipeline`` / ``PixArtSigmaPipeline`` call them with their
defaults: prompts are cleaned (lower-cased and stripped, or diffusers' own caption
cleaner where beautifulsoup4 and ftfy are installed), T5 pads them to 120 (alpha) or
300 (sigma) tokens and masks the padding, the negative prompt is "" unless given,
guidance runs when its scale is above 1, and a learned variance is dropped. Where the
DiT's ``sample_size`` is one diffusers bins (32, 64, 128, and 256 for sigma), the
requested size is mapped to the nearest aspect-ratio bin and the image resized and
cropped back; other sizes run unbinned, as diffusers runs with
``use_resolution_binning=False`` (it refuses them otherwise).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import torch
from torch import nn

from components.batch import Batch
from components.folders.problems import Problem
from components.kinds.t5_encoder import T5EncoderLoader
from components.libraries import is_importable
from components.models.dit.pixart import PixArtInputs
from components.recipes.aspect_bins import AspectBins, nearest_bin, read_bins
from components.recipes.base import (
    DECODE,
    DENOISE,
    ENCODE,
    Denoising,
    Recipe,
    SizeGroup,
    Stage,
    latent_rows,
    narrow_scheduler,
    step_options,
    unique_texts,
)

__all__ = ["PixArtAlphaRecipe", "PixArtSigmaRecipe"]

# B images, C latent channels, h w latent grid, L tokens, E width

SIZE_MULTIPLE = 8
"""diffusers' PixArt pipelines refuse sizes that are not multiples of 8."""
MICRO_CONDITIONED = 128
"""PixArt-alpha's 1024-pixel model (sample size 128) is conditioned on resolution and ratio."""
ALPHA = "diffusers.pipelines.pixart_alpha.pipeline_pixart_alpha"
SIGMA = "diffusers.pipelines.pixart_alpha.pipeline_pixart_sigma"
"""The diffusers modules whose sources assign PixArt's aspect-ratio bins."""


class PixArtAlphaRecipe(Recipe):
    """Run ``PixArtAlphaPipeline`` (T5 ``text_encoder``, ``transformer``, ``vae``)."""

    pipeline_class: ClassVar[str] = "PixArtAlphaPipeline"
    stages = (
        Stage(ENCODE, ("text_encoder",)),
        Stage(DENOISE, ("transformer",)),
        Stage(DECODE, ("vae",)),
    )
    default_steps = 20
    default_guidance = 4.5
    noise_dtype_of = "text_encoder"
    max_tokens: ClassVar[int] = 120
    bin_tables: ClassVar[dict[int, tuple[str, str]]] = {
        128: (ALPHA, "ASPECT_RATIO_1024_BIN"),
        64: (ALPHA, "ASPECT_RATIO_512_BIN"),
        32: (ALPHA, "ASPECT_RATIO_256_BIN"),
    }
    """The aspect-ratio bins diffusers uses for each DiT ``sample_size``: the module that
    assigns them, and their name there."""
    starts_at_first_step: ClassVar[bool] = True
    """Whether the pipeline sets the scheduler's begin index (alpha's does, sigma's not)."""
    one_step_keeps_original: ClassVar[bool] = True
    """Whether a one-step run keeps the scheduler's predicted original (alpha's quirk)."""
    micro_conditioned: ClassVar[bool] = True
    """Whether the 1024-pixel DiT (sample size 128) gets resolution and ratio conditions."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.text_encoder = self.loader("text_encoder", T5EncoderLoader)
        config = self.transformer.config
        self.sample_size = int(config["sample_size"])
        self.learned_sigma = int(config.get("out_channels") or self.channels) // 2 == self.channels
        self._multiple = math.lcm(
            SIZE_MULTIPLE, self.vae.scale_factor * int(config.get("patch_size") or 1)
        )

    @property
    def multiple(self) -> int:
        """Sizes must be multiples of 8 (diffusers' check) and of the VAE and patch scale."""
        return self._multiple

    def bins(self) -> AspectBins | None:
        """Return diffusers' aspect-ratio bins for this DiT, or None when it bins none.

        Raises:
            BinsNotFound: the installed diffusers no longer assigns them where they are read.
        """
        table = self.bin_tables.get(self.sample_size)
        return None if table is None else read_bins(*table)

    def binned(self, size: tuple[int, int]) -> tuple[int, int]:
        """Return the aspect-ratio bin nearest ``size`` where diffusers bins, else ``size``."""
        bins = self.bins()
        return size if bins is None else nearest_bin(*size, bins)

    def encode(self, modules: Mapping[str, nn.Module], batch: Batch) -> None:
        """Embed the prompts (and, under guidance, the negative prompts) with masked T5."""
        prompts = self.check(batch)
        module = modules["text_encoder"]
        batch.context, batch.context_mask, truncated = self._embed(module, prompts)
        batch.mark_truncated(truncated)
        if self.guided(batch):
            negative = batch.negative_prompts or [""] * len(prompts)
            batch.negative_context, batch.negative_context_mask, _ = self._embed(module, negative)

    def _embed(
        self, module: nn.Module, texts: Sequence[str]
    ) -> tuple[list[torch.Tensor], torch.Tensor, list[bool]]:
        """Return each text's padded states ``(L, E)``, the token masks ``(B, L)`` and
        whether each text was cut."""
        distinct, rows = unique_texts(texts)
        cleaned = clean_captions(self.pipeline_class, distinct)
        encoded = self.text_encoder.encode(module, cleaned, self.max_tokens, masked=True)
        cut = self.text_encoder.truncated(cleaned, self.max_tokens)
        truncated = [cut[row] for row in rows]
        return [encoded.hidden[row] for row in rows], encoded.mask[rows], truncated

    def start(self, batch: Batch, group: SizeGroup, device: torch.device) -> PixArtDenoising:
        """Set up one size group: its noise, its text (and negatives) and its scheduler."""
        return PixArtDenoising(self, batch, group, device)

    def micro_conditions(
        self, count: int, height: int, width: int
    ) -> dict[str, torch.Tensor | None]:
        """Return the resolution and aspect-ratio conditions of the 1024-pixel model, else none."""
        if not self.micro_conditioned or self.sample_size != MICRO_CONDITIONED:
            return {"resolution": None, "aspect_ratio": None}
        dtype = self.text_encoder.dtype
        return {
            "resolution": torch.tensor([height, width], dtype=dtype).repeat(count, 1),
            "aspect_ratio": torch.tensor([float(height / width)], dtype=dtype).repeat(count, 1),
        }

    def decode_group(self, module: nn.Module, batch: Batch, group: SizeGroup) -> torch.Tensor:
        """Decode a group's latents, and resize and crop binned images back to the size asked."""
        images = self.decode_latents(module, batch, group, shifted=False)
        if self.bins() is None:
            return images
        from diffusers.image_processor import PixArtImageProcessor

        height, width = group.requested
        resized: torch.Tensor = PixArtImageProcessor.resize_and_crop_tensor(images, width, height)
        return resized

    def text_problems(self) -> list[Problem]:
        """Check T5's width against the DiT's caption width."""
        return self.encoder_problems(self.text_encoder)


class PixArtDenoising(Denoising):
    """One size group of a PixArt request: guided when the scale is above 1.

    Args:
        recipe: the pipeline's recipe.
        batch: the batch, with the encode stage's text.
        group: the images of one size.
        device: where the DiT runs.
    """

    def __init__(
        self, recipe: PixArtAlphaRecipe, batch: Batch, group: SizeGroup, device: torch.device
    ) -> None:
        super().__init__(group)
        rows = self.rows
        self.guide(recipe, batch)
        context, mask = _joined(batch.context, batch.context_mask, rows, device)
        if self.guided:
            negative, negative_mask = _joined(
                batch.negative_context, batch.negative_context_mask, rows, device
            )
            context, mask = torch.cat([negative, context]), torch.cat([negative_mask, mask])
        self.context, self.mask = context, mask
        scheduler = recipe.new_scheduler()
        scheduler.set_timesteps(batch.steps, device=device)
        if recipe.starts_at_first_step and hasattr(scheduler, "set_begin_index"):
            scheduler.set_begin_index(0)
        self.scheduler = scheduler
        self.timesteps = scheduler.timesteps
        self.latents = recipe.noise(batch, group).to(device) * scheduler.init_noise_sigma
        height, width = group.size
        self.conditions = recipe.micro_conditions(
            len(rows) * (2 if self.guided else 1), height, width
        )
        self.options = step_options(scheduler, batch.generator)
        self.original = recipe.one_step_keeps_original and batch.steps == 1
        self.learned_sigma = recipe.learned_sigma
        self.device = device

    def inputs(self, step: int) -> PixArtInputs:
        """Return the DiT's arguments: the latents (twice when guided), text, mask, timestep."""
        t = self.timesteps[step]
        model_input = torch.cat([self.latents] * 2) if self.guided else self.latents
        model_input = self.scheduler.scale_model_input(model_input, t)
        return PixArtInputs(
            hidden_states=model_input,
            encoder_hidden_states=self.context,
            encoder_attention_mask=self.mask,
            timestep=t[None].to(self.device).expand(model_input.shape[0]),
            added_cond_kwargs=self.conditions,
        )

    def advance(self, step: int, prediction: torch.Tensor) -> None:
        """Guide, drop a learned variance, and step the scheduler."""
        if self.guided:
            uncond, cond = prediction.chunk(2)
            prediction = uncond + self.scale * (cond - uncond)
        if self.learned_sigma:
            prediction = prediction.chunk(2, dim=1)[0]
        t = self.timesteps[step]
        out = self.scheduler.step(prediction, t, self.latents, **self.options, return_dict=False)
        # (where a one-step run finds no predicted original, diffusers' alpha pipeline
        # fails; this keeps the previous sample)
        self.latents = out[1] if self.original and len(out) > 1 else out[0]

    def result(self) -> list[torch.Tensor]:
        """Return each image's latents ``(N, C)``."""
        return latent_rows(self.latents)

    def narrow(self, keep: list[int]) -> None:
        """Keep the images at ``keep``: their latents, text and masks (negatives too),
        conditions and scheduler state."""
        both = self.branch_rows(keep)
        narrow_scheduler(self.scheduler, self.latents.shape, keep)
        self.latents = self.latents[keep]
        self.context, self.mask = self.context[both], self.mask[both]
        self.conditions = {
            name: None if value is None else value[both] for name, value in self.conditions.items()
        }


class PixArtSigmaRecipe(PixArtAlphaRecipe):
    """Run ``PixArtSigmaPipeline``: 300 tokens, a 2048-pixel bin, none of alpha's quirks."""

    pipeline_class: ClassVar[str] = "PixArtSigmaPipeline"
    max_tokens = 300
    bin_tables: ClassVar[dict[int, tuple[str, str]]] = {
        256: (SIGMA, "ASPECT_RATIO_2048_BIN"),
        **PixArtAlphaRecipe.bin_tables,
    }
    starts_at_first_step = False
    one_step_keeps_original = False
    micro_conditioned = False


def clean_captions(pipeline_class: str, texts: list[str]) -> list[str]:
    """Clean prompts as diffusers' PixArt pipelines do by default (``clean_caption=True``).

    With beautifulsoup4 and ftfy installed that is diffusers' own caption cleaner;
    without them diffusers falls back to lower-casing and stripping, and so does this.
    """
    if not (is_importable("bs4") and is_importable("ftfy")):
        return [text.lower().strip() for text in texts]
    import diffusers

    pipeline = getattr(diffusers, pipeline_class)
    # the cleaner reads only class attributes: a bare instance (no models) runs it
    cleaned: list[str] = pipeline._text_preprocessing(
        object.__new__(pipeline), texts, clean_caption=True
    )
    return cleaned


def _joined(
    context: list[torch.Tensor] | None,
    mask: torch.Tensor | None,
    rows: list[int],
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Stack ``rows``' states into ``(B_g, L, E)`` with their masks ``(B_g, L)``, on ``device``."""
    if context is None or mask is None:
        raise ValueError("the denoise stage needs the encode stage's text states: run it first")
    return torch.stack([context[row] for row in rows]).to(device), mask[rows].to(device)
