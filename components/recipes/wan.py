"""Wan: UMT5 -> Wan's video DiT (one, or two experts) with its scheduler -> the causal video VAE.

As diffusers' ``WanPipeline`` calls them with its defaults: prompts are cleaned (HTML
unescaped, whitespace joined; ftfy's ``fix_text`` first where ftfy is installed, as
diffusers does), UMT5 pads them to 512 tokens and zeroes the states past each prompt,
guidance runs when its scale is above 1 against the negative prompt ("" unless given),
and the noise is drawn in float32 as ``(videos, C, 1 + (frames - 1) / 4, H / 8, W / 8)``.

Wan 2.2 A14B has two experts: ``transformer`` predicts the steps whose timestep is at
least ``boundary_ratio`` x 1000 (the folder's config), with ``guidance_scale``, and
``transformer_2`` the rest, with ``guidance_scale_2`` (``guidance_scale`` unless given).
Wan 2.2 TI2V-5B (``expand_timesteps``) gives the DiT one timestep per patch. diffusers
rounds a size off the patch grid and a frame count off ``4k + 1`` with a warning; both
are refused here, naming the rule.
"""

from __future__ import annotations

import html
import importlib
import math
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar, NamedTuple

import torch
from torch import nn

from components.batch import Batch, device_of
from components.cache import StepCache
from components.folders.index import INDEX_FILE, PipelineIndex
from components.folders.problems import Problem
from components.kinds.autoencoder_kl_wan import AutoencoderKlWanLoader
from components.kinds.umt5_encoder import Umt5EncoderLoader
from components.kinds.wan_transformer import WanTransformerLoader
from components.libraries import is_importable
from components.models.dit.base import PackedTransformer
from components.models.dit.wan import WanInputs
from components.recipes.base import (
    DECODE,
    DENOISE,
    ENCODE,
    Denoising,
    Recipe,
    RecipeError,
    SizeGroup,
    Stage,
    latent_rows,
    mismatch,
    narrow_scheduler,
    predict,
    scheduler_config,
    width,
)

__all__ = ["EXPERTS", "WanDenoising", "WanRecipe"]

# B videos, C latent channels, f latent frames, h w latent grid, L tokens, E width

EXPERTS = ("transformer", "transformer_2")
TRAIN_TIMESTEPS = "num_train_timesteps"
DEFAULT_SIZE = (480, 832)
"""diffusers' default (height, width) of a Wan video."""


class WanConfig(NamedTuple):
    """The pipeline's config entries of ``model_index.json`` a Wan recipe reads.

    Attributes:
        boundary_ratio: where ``transformer`` hands over to ``transformer_2``, as a
            fraction of the scheduler's training timesteps; None: one DiT.
        expand_timesteps: one timestep per latent patch (Wan 2.2 TI2V-5B).
    """

    boundary_ratio: float | None = None
    expand_timesteps: bool = False

    @classmethod
    def of(cls, index: PipelineIndex) -> WanConfig:
        """Read the config entries of ``index`` (others are ignored, as diffusers ignores
        what its class does not take).

        Raises:
            ValueError: an entry has a value of the wrong type or range (named).
        """
        where = index.folder / INDEX_FILE
        ratio = index.config.get("boundary_ratio")
        expand = index.config.get("expand_timesteps", False)
        if ratio is not None and (
            not isinstance(ratio, int | float) or isinstance(ratio, bool) or not 0 <= ratio <= 1
        ):
            raise ValueError(
                f"{where}: boundary_ratio is {ratio!r}; expected a number from 0 to 1 (the "
                "fraction of the timesteps where transformer_2 takes over) or null"
            )
        if not isinstance(expand, bool):
            raise ValueError(f"{where}: expand_timesteps is {expand!r}; expected true or false")
        return cls(None if ratio is None else float(ratio), expand)


def clean_prompt(text: str) -> str:
    """Clean a prompt as diffusers' Wan pipelines do (``prompt_clean``).

    ftfy fixes the text first where it is installed (diffusers' ``WanPipeline`` does the
    same; its image-to-video pipeline calls ftfy unguarded and fails without it).
    """
    # diffusers' own pattern module: its \s is Unicode's White_Space, not str.isspace
    regex: Any = importlib.import_module("regex")
    if is_importable("ftfy"):
        ftfy: Any = importlib.import_module("ftfy")
        text = ftfy.fix_text(text)
    text = html.unescape(html.unescape(text)).strip()
    return str(regex.sub(r"\s+", " ", text)).strip()


class WanRecipe(Recipe):
    """Run ``WanPipeline`` (UMT5 ``text_encoder``, ``transformer`` and ``transformer_2``, VAE)."""

    pipeline_class: ClassVar[str] = "WanPipeline"
    stages = (
        Stage(ENCODE, ("text_encoder",)),
        Stage(DENOISE, EXPERTS),
        Stage(DECODE, ("vae",)),
    )
    optional = frozenset({"transformer_2"})
    makes_videos = True
    default_steps = 50
    default_guidance = 5.0
    default_frames: ClassVar[int] = 81
    noise_dtype_of = "text_encoder"  # unused: Wan draws its noise in float32
    vae_kind = AutoencoderKlWanLoader
    max_tokens: ClassVar[int] = 512

    def __init__(self, index: PipelineIndex, *args: Any, **kwargs: Any) -> None:
        super().__init__(index, *args, **kwargs)
        self.config = WanConfig.of(index)
        self.text_encoder = self.loader("text_encoder", Umt5EncoderLoader)
        self.video_vae = self.loader("vae", AutoencoderKlWanLoader)
        self.dit = self.loader("transformer", WanTransformerLoader)
        self.experts = [self.loader(name, WanTransformerLoader) for name in self.expert_names()]
        if self.config.boundary_ratio is not None and len(self.experts) < 2:
            raise RecipeError(
                [
                    Problem(
                        "pipeline.unsupported_class",
                        "transformer_2",
                        f"{INDEX_FILE} sets boundary_ratio = {self.config.boundary_ratio}, "
                        "where transformer_2 takes over from transformer, but the folder has "
                        "no transformer_2",
                        "restore the folder's transformer_2, or set boundary_ratio to null",
                    )
                ]
            )
        rows, columns = self.dit.patch[1:]
        self._multiple = self.video_vae.scale_factor * math.lcm(rows, columns)
        denoise = next(stage for stage in self.stages if stage.name == DENOISE)
        first = denoise.windows.get(EXPERTS[0])
        self.boundary = None if first is None else first[0]
        """The timestep below which ``transformer_2`` predicts; None: one DiT."""

    @classmethod
    def check_config(cls, index: PipelineIndex) -> None:
        """Check ``boundary_ratio`` and ``expand_timesteps`` (``WanConfig.of``)."""
        WanConfig.of(index)

    @classmethod
    def stages_for(cls, index: PipelineIndex) -> tuple[Stage, ...]:
        """Return the stages, the two experts of the denoise stage each with its window
        where the folder has a boundary (``transformer`` at timesteps from it,
        ``transformer_2`` below it): the stage holds one expert at a time."""
        stages = super().stages_for(index)
        boundary = WanConfig.of(index).boundary_ratio
        if boundary is None:
            return stages
        at = boundary * float(scheduler_config(index)[TRAIN_TIMESTEPS])
        windows = {EXPERTS[0]: (at, None), EXPERTS[1]: (None, at)}
        return tuple(
            stage._replace(windows=windows)
            if stage.name == DENOISE and set(EXPERTS) <= set(stage.uses)
            else stage
            for stage in stages
        )

    @classmethod
    def uses_optional(cls, index: PipelineIndex, name: str) -> bool:
        """Run ``transformer_2`` only where a boundary hands over to it (diffusers never
        calls it otherwise)."""
        if name == "transformer_2":
            return name in index.entries and index.config.get("boundary_ratio") is not None
        return super().uses_optional(index, name)

    def expert_names(self) -> tuple[str, ...]:
        """Return the denoisers this folder runs: ``transformer``, and ``transformer_2``."""
        denoise = next(stage for stage in self.stages if stage.name == DENOISE)
        return tuple(name for name in EXPERTS if name in denoise.uses)

    @property
    def multiple(self) -> int:
        """Sizes must be multiples of the VAE's scale times the patch (16; 32 for TI2V-5B)."""
        return self._multiple

    def default_size(self) -> tuple[int, int]:
        """Return diffusers' default size, 480 x 832."""
        return DEFAULT_SIZE

    def frames(self, batch: Batch) -> int:
        """Return the frames each video of ``batch`` has: its own, else 81.

        Raises:
            ValueError: the count is not ``4k + 1`` (the VAE's temporal factor k times).
        """
        frames = self.default_frames if batch.frames is None else batch.frames
        factor = self.video_vae.temporal_factor
        if frames < 1 or (frames - 1) % factor:
            raise ValueError(
                f"{self.pipeline_class} makes videos of {factor}k + 1 frames (1, "
                f"{1 + factor}, {1 + 2 * factor}, ..., 81), not {frames}: its VAE turns each "
                f"latent frame after the first into {factor}"
            )
        return frames

    def latent_frames(self, batch: Batch) -> int:
        """Return f: the latent frames of each video of ``batch``."""
        return self._latent_frames(self.frames(batch))

    def _latent_frames(self, frames: int) -> int:
        return (frames - 1) // self.video_vae.temporal_factor + 1

    def video_noise(self, seed: int, size: tuple[int, int], frames: int) -> torch.Tensor:
        """Return the starting latents ``(f * h * w, C)`` of one video of ``frames`` frames at
        ``size`` (pixels), drawn from ``seed`` as a request of that video alone draws them
        (``torch.Generator("cpu").manual_seed(seed)``)."""
        generator = torch.Generator().manual_seed(seed)
        return self.draw_latents(generator, 1, size, self._latent_frames(frames))[0]

    def guidance_scale_2(self, batch: Batch) -> float:
        """Return the guidance scale of ``transformer_2``'s steps: the batch's, else the first."""
        if batch.guidance_scale_2 is not None:
            return batch.guidance_scale_2
        return self.guidance_scale(batch)

    def check(self, batch: Batch) -> list[str]:
        """Refuse what this folder cannot make; return the prompts.

        Raises:
            ValueError: as ``Recipe.check``; a frame count off ``4k + 1``; a second guidance
                scale without a second expert.
        """
        prompts = super().check(batch)
        self.frames(batch)
        if batch.guidance_scale_2 is not None and self.boundary is None:
            raise ValueError(
                f"guidance_scale_2 sets the guidance of transformer_2's steps, but this "
                f"{self.pipeline_class} folder has no boundary_ratio: one DiT runs every "
                "step; drop guidance_scale_2"
            )
        return prompts

    def encode(self, modules: Mapping[str, nn.Module], batch: Batch) -> None:
        """Embed the prompts (and the negative prompts under guidance) with UMT5."""
        self.encode_with(self._embed, modules["text_encoder"], batch)

    def _embed(
        self, module: nn.Module, texts: Sequence[str]
    ) -> tuple[list[torch.Tensor], list[bool]]:
        """Return each text's states ``(512, E)`` (zero past its tokens) and whether it was cut."""
        cleaned = [clean_prompt(text) for text in texts]
        hidden = self.text_encoder.encode(module, cleaned, self.max_tokens)
        return list(hidden), self.text_encoder.truncated(cleaned, self.max_tokens)

    def draw_latents(
        self, generator: torch.Generator, count: int, size: tuple[int, int], frames: int = 1
    ) -> list[torch.Tensor]:
        """Draw the noise of ``count`` videos of ``frames`` latent frames at ``size`` (pixels)
        as diffusers draws it: one float32 ``torch.randn``; one ``(f * h * w, C)`` tensor a
        video, row-major over (f, h, w)."""
        h, w = self.latent_size(size)
        noise = torch.randn((count, self.channels, frames, h, w), generator=generator)
        return latent_rows(noise)

    def noise(self, batch: Batch, group: SizeGroup) -> torch.Tensor:
        """Return a group's starting latents ``(B_g, C, f, h, w)``, drawn unless the batch has
        them."""
        frames = self.latent_frames(batch)
        if batch.latents is None:
            latents = self.draw_latents(batch.generator, len(group.rows), group.size, frames)
        else:
            latents = [batch.latents[row] for row in group.rows]
        return video_grid(latents, frames, *self.latent_size(group.size))

    def denoiser(self, modules: Mapping[str, nn.Module], timestep: torch.Tensor) -> nn.Module:
        """Return the expert of ``timestep``: ``transformer_2`` below the boundary."""
        return modules[self.expert_at(timestep)]

    def expert_at(self, timestep: torch.Tensor) -> str:
        """Return the name of the expert that predicts at ``timestep``."""
        if self.boundary is None or timestep >= self.boundary:
            return "transformer"
        return "transformer_2"

    def predict(
        self, module: nn.Module, runs: Sequence[Denoising], step: int, cache: StepCache | None
    ) -> list[torch.Tensor]:
        """Predict for every run, each guidance branch apart, as diffusers calls its DiT.

        diffusers calls its DiT once for the conditional branch and once for the
        unconditional one: one call on both rows rounds differently (by 2e-6 a step,
        which guidance and the VAE amplify past 1e-5), so each branch runs alone, and
        each video too (a batch of two videos in one call is 4e-5 to 5e-5 off each alone
        on the frames, with either DiT), so a video batched makes the frames it makes
        alone; under a step cache our DiT packs a branch's videos into one call.
        """
        (branches,) = {run.branches for run in runs}  # the batch decides guidance
        packed = isinstance(module, PackedTransformer)
        # each video alone, as a request of it alone: a call on two rounds them apart by
        # 4e-5 on the frames (either DiT); ours packs them only under a step cache, whose
        # step is the batch's
        apart = not packed or cache is None
        parts = []
        for i in range(branches):
            inputs = [
                WanInputs._make(
                    _branch(v, branches * rows, i * rows + r)
                    for v in run.inputs(step)._asdict().values()
                )
                for run in runs
                for rows in [len(run.rows) if apart else 1]
                for r in range(rows)
            ]
            if packed and apart:
                parts.append([predict(module, [one], cache)[0] for one in inputs])
            else:
                parts.append(predict(module, inputs, cache))
        predictions = []
        at = 0
        for run in runs:
            count = len(run.rows) if apart else 1
            predictions.append(
                torch.cat([part[j] for part in parts for j in range(at, at + count)])
            )
            at += count
        return predictions

    def start(self, batch: Batch, group: SizeGroup, device: torch.device) -> WanDenoising:
        """Set up one size group: its noise, its text (and negatives) and its scheduler."""
        return WanDenoising(self, batch, group, device)

    def model_input(self, latents: torch.Tensor, run: WanDenoising) -> torch.Tensor:
        """Return what the DiT reads of ``latents`` ``(B_g, C, f, h, w)``: the latents."""
        return latents

    def decode(self, modules: Mapping[str, nn.Module], batch: Batch) -> None:
        """Decode the batch's latents into videos ``(B, 3, F, H, W)`` in [-1, 1].

        Raises:
            ValueError: the denoise stage has not run, or the batch mixes sizes (one
                video tensor holds one size).
        """
        groups = self.size_groups(batch)
        if len(groups) > 1:
            raise ValueError(
                f"a {self.pipeline_class} batch makes videos of one size; run other sizes "
                "as their own requests"
            )
        if batch.latents is None:
            raise ValueError("the decode stage needs latents: run the denoise stage first")
        module = modules["vae"]
        (group,) = groups
        latents = video_grid(
            [batch.latents[row] for row in group.rows],
            self.latent_frames(batch),
            *self.latent_size(group.size),
        )
        latents = latents.to(device_of(module), self.video_vae.dtype)
        mean, std = (t.to(latents) for t in self.video_vae.normalisation)
        latents = latents / (1.0 / std) + mean  # diffusers' arithmetic, to the bit
        # one video at a time: the VAE's convolutions round a batch of two differently
        videos = [self.video_vae.decode(module, latents[i : i + 1]) for i in range(len(latents))]
        batch.videos = videos[0] if len(videos) == 1 else torch.cat(videos)

    def decode_group(self, module: nn.Module, batch: Batch, group: SizeGroup) -> torch.Tensor:
        """Not used: a video pipeline decodes whole batches (``decode``)."""
        raise NotImplementedError("a video recipe decodes in decode()")

    def text_problems(self) -> list[Problem]:
        """Check UMT5's width against every expert's text width."""
        wrote = width(self.text_encoder, "context", written=True)
        return [
            problem
            for name, expert in zip(self.expert_names(), self.experts, strict=True)
            for problem in mismatch(
                name, "context", width(expert, "context", written=False), ["text_encoder"], wrote
            )
        ]


class WanDenoising(Denoising):
    """One size group of a Wan request: guided when the first scale is above 1.

    Args:
        recipe: the pipeline's recipe.
        batch: the batch, with the encode stage's text (and image states).
        group: the videos of one size.
        device: where the DiT runs.

    Raises:
        ValueError: the encode stage has not run.
    """

    def __init__(
        self, recipe: WanRecipe, batch: Batch, group: SizeGroup, device: torch.device
    ) -> None:
        if batch.context is None:
            raise ValueError("the denoise stage needs the encode stage's text: run it first")
        super().__init__(group)
        rows = self.rows
        self.recipe = recipe
        self.scales = (recipe.guidance_scale(batch), recipe.guidance_scale_2(batch))
        self.guided = self.scales[0] > 1  # diffusers decides by the first scale alone
        self.branches = 2 if self.guided else 1
        context = torch.stack([batch.context[row] for row in rows])
        if self.guided:
            if batch.negative_context is None:
                raise ValueError("guidance needs the negative prompts' text: run encode first")
            context = torch.cat(
                [torch.stack([batch.negative_context[row] for row in rows]), context]
            )
        self.context = context.to(device)
        self.image = None
        if batch.image_context is not None:
            image = torch.cat([batch.image_context[row] for row in rows])
            self.image = torch.cat([image] * self.branches).to(device)
        self.condition = None
        if batch.condition is not None:
            self.condition = torch.stack([batch.condition[row] for row in rows]).to(device)
        self.latents = recipe.noise(batch, group).to(device)  # (B_g, C, f, h, w) float32
        self.dtype = recipe.dit.dtype
        scheduler = recipe.new_scheduler()
        scheduler.set_timesteps(batch.steps, device=device)
        scheduler.set_begin_index(0)
        self.scheduler = scheduler
        self.timesteps = scheduler.timesteps
        self.tokens = None
        if recipe.config.expand_timesteps:
            _, rows_patch, columns_patch = recipe.dit.patch
            f, h, w = self.latents.shape[2:]
            self.tokens = torch.ones((f, h // rows_patch, w // columns_patch), device=device)

    def inputs(self, step: int) -> WanInputs:
        """Return the DiT's arguments: the latents (twice when guided), text, timestep."""
        model_input = self.recipe.model_input(self.latents, self).to(self.dtype)
        if self.guided:
            model_input = torch.cat([model_input] * 2)
        count = model_input.shape[0]
        t = self.timesteps[step]
        if self.tokens is None:
            timestep = t.expand(count)
        else:  # one timestep per patch, as diffusers builds it from its mask
            timestep = (self.tokens * t).flatten().unsqueeze(0).expand(count, -1)
        return WanInputs(
            hidden_states=model_input,
            timestep=timestep,
            encoder_hidden_states=self.context.to(self.dtype),
            encoder_hidden_states_image=None if self.image is None else self.image.to(self.dtype),
        )

    def advance(self, step: int, prediction: torch.Tensor) -> None:
        """Guide with the scale of this step's expert, and step the scheduler."""
        t = self.timesteps[step]
        if self.guided:
            uncond, cond = prediction.chunk(2)
            scale = self.scales[self.recipe.expert_at(t) == "transformer_2"]
            prediction = uncond + scale * (cond - uncond)
        self.latents = self.scheduler.step(prediction, t, self.latents, return_dict=False)[0]

    def result(self) -> list[torch.Tensor]:
        """Return each video's latents ``(f * h * w, C)``."""
        return latent_rows(self.latents)

    def narrow(self, keep: list[int]) -> None:
        """Keep the videos at ``keep``: their latents, text (negatives too), image states,
        condition and scheduler state."""
        both = keep + [i + len(self.rows) for i in keep] if self.guided else keep
        narrow_scheduler(self.scheduler, self.latents.shape, keep)
        self.latents = self.latents[keep]
        self.context = self.context[both]
        if self.image is not None:
            per_row = self.image.shape[0] // (len(self.rows) * self.branches)
            rows = [r * per_row + i for r in both for i in range(per_row)]
            self.image = self.image[rows]
        if self.condition is not None:
            self.condition = self.condition[keep]


def _branch(value: torch.Tensor | None, parts: int, index: int) -> torch.Tensor | None:
    """Return part ``index`` of a DiT argument batched over ``parts`` equal parts (guidance
    branches, or each branch's videos; None stays None)."""
    return None if value is None else value.chunk(parts)[index]


def video_grid(latents: Sequence[torch.Tensor], f: int, h: int, w: int) -> torch.Tensor:
    """Stack per-video latents ``(f * h * w, C)`` (row-major) into ``(B, C, f, h, w)``.

    Raises:
        ValueError: there are none: the stage that makes them has not run.
    """
    if not latents:
        raise ValueError("the stage needs latents: run the denoise stage first")
    return torch.stack([x.T.reshape(-1, f, h, w) for x in latents])
