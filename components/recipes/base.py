"""What a recipe is: how one diffusers pipeline class runs on the project's components.

A recipe owns each stage of its pipeline class: ``encode`` (every text encoder),
``denoise`` (the transformer, stepping the folder's own scheduler: diffusers' class,
never re-implemented) and ``decode`` (the VAE). It runs a stage on the modules the
orchestrator hands it (native or custom, resident, armed) and on what ``Batch``
carries, so its images equal diffusers' pipeline on the same folder and arguments.
Random draws follow diffusers' order: one ``torch.randn`` of every latent of a request
from its generator, then whatever the scheduler draws from the same generator.
"""

from __future__ import annotations

import inspect
import json
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from functools import cached_property
from typing import Any, ClassVar, NamedTuple, Protocol, TypeVar

import torch
from torch import nn

from components.batch import Batch, BatchField, Port, device_of
from components.cache import RowCache, StepCache, step_rows
from components.cache import hooked as hooks
from components.cache.state import any_cached, release_caches, start_rows
from components.folders.index import INDEX_FILE, PipelineIndex
from components.folders.loader import FolderLoader
from components.folders.problems import Problem
from components.folders.vae import VaeLoader
from components.kinds.autoencoder_kl import AutoencoderKlLoader
from components.libraries import library_class
from components.loader import ComponentLoader
from components.models.dit.base import PackedTransformer

__all__ = [
    "DECODE",
    "DENOISE",
    "ENCODE",
    "Denoising",
    "Recipe",
    "RecipeError",
    "SizeGroup",
    "Stage",
    "guided_texts",
    "latent_grid",
    "latent_rows",
    "mismatch",
    "narrow_scheduler",
    "predict",
    "scheduler_config",
    "step_options",
    "unique_texts",
    "width",
]

# B images, C latent channels, h w latent grid, N latent positions (h * w), L tokens, E width

ENCODE, DENOISE, DECODE = "encode", "denoise", "decode"
SCHEDULER = "scheduler"
SCHEDULER_CONFIG = "scheduler_config.json"

LoaderT = TypeVar("LoaderT", bound=ComponentLoader)


Window = tuple[float | None, float | None]
"""The timesteps ``t`` at which a use predicts: ``from <= t < below`` (None: unbounded)."""


class Stage(NamedTuple):
    """One stage of a recipe and the components it uses, in order; ``windows``: the uses
    that predict only at some timesteps (the stage holds one of them at a time)."""

    name: str
    uses: tuple[str, ...]
    windows: Mapping[str, Window] = {}


class SizeGroup(NamedTuple):
    """The images of a batch that ask for one size.

    Attributes:
        requested: the size asked for (height, width) in pixels.
        size: the size the latents are made at (a bin of ``requested``, where the
            pipeline bins).
        rows: the images' indices in the batch.
    """

    requested: tuple[int, int]
    size: tuple[int, int]
    rows: tuple[int, ...]


class ModelInputs(Protocol):
    """One group's arguments to a DiT, as diffusers' class takes them (a NamedTuple)."""

    def _asdict(self) -> dict[str, Any]: ...


class Denoising(ABC):
    """One size group on its way through its own scheduler.

    Args:
        group: the images it denoises.

    Attributes:
        rows: its images' positions among the batch's rows (they shift as cancelled rows
            leave the batch).
        timesteps: the scheduler's timesteps (every group of a batch takes as many).
        branches: how many times its images run through the DiT each step, one after
            the other (2 under classifier-free guidance: unconditional, then conditional).
        scale, guided: the guidance scale, and whether the negative branch runs
            (``guide``, for a class guided by one scale).
    """

    timesteps: torch.Tensor
    branches: int = 1

    def __init__(self, group: SizeGroup) -> None:
        self.rows = list(group.rows)

    @abstractmethod
    def inputs(self, step: int) -> ModelInputs:
        """Return the DiT's arguments at ``step``."""

    @abstractmethod
    def advance(self, step: int, prediction: torch.Tensor) -> None:
        """Step the scheduler with the DiT's ``prediction`` at ``step``."""

    @abstractmethod
    def result(self) -> list[torch.Tensor]:
        """Return each image's latents ``(N, C)``, row-major over its grid."""

    @abstractmethod
    def narrow(self, keep: list[int]) -> None:
        """Keep only its images at positions ``keep`` (of ``rows``): latents, text and the
        scheduler's per-image state (``narrow_scheduler``), so they step on as alone."""

    def guide(self, recipe: Recipe, batch: Batch) -> None:
        """Take ``batch``'s guidance scale, and two branches where it runs the negative one."""
        self.scale = recipe.guidance_scale(batch)
        self.guided = recipe.guided(batch)
        self.branches = 2 if self.guided else 1

    def branch_rows(self, keep: list[int]) -> list[int]:
        """Return where the images at ``keep`` stand in the DiT's batch: in each branch, the
        branches stacked one after the other."""
        return [i + branch * len(self.rows) for branch in range(self.branches) for i in keep]


def predict(
    module: nn.Module, inputs: Sequence[ModelInputs], cache: StepCache | None = None
) -> list[torch.Tensor]:
    """Run the DiT on every group: the project's in one packed forward (under ``cache``, the
    step cache's view of the step, if any), diffusers' per group."""
    if isinstance(module, PackedTransformer):
        predictions: list[torch.Tensor] = module(inputs, cache)
        return predictions
    return [module(**group._asdict(), return_dict=False)[0] for group in inputs]


def predict_rows(
    module: nn.Module,
    runs: Sequence[Denoising],
    caches: Sequence[RowCache | None] | None,
    step: int,
) -> list[torch.Tensor]:
    """Run diffusers' class under its cache hook on every run, each of one row, under that
    row's own cache context (``components.cache.hooked``)."""
    return [
        hooks.forward_row(
            module,
            run.inputs(step)._asdict(),
            None if caches is None else caches[run.rows[0]],
            step,
        )
        for run in runs
    ]


class PromptKey(NamedTuple):
    """What one row's encoded text depends on besides the encoders.

    Attributes:
        pipeline_class: the class, whose lengths (and layers) the encoding follows.
        prompt: the prompt in the class's template.
        negative: the negative prompt in the template; None where the class encodes its
            own (the empty prompt) or none.
        guided: whether the class encodes a negative branch at all.
    """

    pipeline_class: str
    prompt: str
    negative: str | None
    guided: bool


class RecipeError(ValueError):
    """A folder's components do not fit its pipeline class's recipe; every problem is named.

    Attributes:
        problems: each problem with its component and fix.
    """

    def __init__(self, problems: list[Problem]) -> None:
        self.problems = problems
        super().__init__("; ".join(f"{p.component}: {p.message} ({p.hint})" for p in problems))


class Recipe(ABC):
    """Run one diffusers pipeline class on a folder's components.

    Subclasses set ``pipeline_class``, ``stages``, the defaults diffusers' ``__call__``
    has, ``noise_dtype_of`` and ``vae_kind``, and implement each stage. Every supported
    class has a ``transformer`` and a ``vae``; the components in ``optional`` may be
    ``[null, null]`` in a folder, which then runs without them (``stages_for``).

    Args:
        index: the folder's ``model_index.json``.
        loaders: the loader of every component the stages use, by name.

    Raises:
        RecipeError: a component is missing or of a kind the recipe cannot drive.
        FileNotFoundError: the scheduler's config is missing.
        ValueError: the scheduler's config is not JSON or its class is not a diffusers
            scheduler.
    """

    pipeline_class: ClassVar[str]
    stages: tuple[Stage, ...]
    """The stages of the class, in timeline order; an instance holds its folder's own
    (``stages_for``)."""
    default_steps: ClassVar[int]
    default_guidance: ClassVar[float]
    makes_videos: ClassVar[bool] = False
    """Whether it makes videos (``Batch.videos``, ``frames`` each) rather than images."""
    takes_images: ClassVar[bool] = False
    """Whether each request starts from an input image (``Batch.input_images``)."""
    takes_negative_prompt: ClassVar[bool] = True
    """Whether guidance has an unconditional pass for a negative prompt to steer."""
    noise_dtype_of: ClassVar[str]
    """The text encoder whose dtype the noise is drawn in (diffusers draws it in the dtype
    of the prompt embeddings)."""
    vae_kind: ClassVar[type[VaeLoader]] = AutoencoderKlLoader
    """The kind of the pipeline's VAE."""
    optional: ClassVar[frozenset[str]] = frozenset()
    """The components a folder of this class may lack (diffusers' ``_optional_components``)."""

    def __init__(self, index: PipelineIndex, loaders: Mapping[str, ComponentLoader]) -> None:
        self.index = index
        self.loaders = loaders
        self.stages = self.stages_for(index)
        self.scheduler_config = scheduler_config(index)
        entry = index.entries[SCHEDULER]
        self.scheduler_class = library_class("diffusers", entry.class_name, "SchedulerMixin")
        self.transformer = self.loader("transformer", FolderLoader)
        self.vae: VaeLoader = self.loader("vae", self.vae_kind)
        self.channels = width(self.transformer, "latents", written=False) or 0
        """C: the latent channels the VAE decodes (Flux's DiT reads them packed by four)."""

    @classmethod
    def stages_for(cls, index: PipelineIndex) -> tuple[Stage, ...]:
        """Return the stages a folder of this class runs: ``stages`` without the optional
        components it lacks (``uses_optional``)."""
        return tuple(
            Stage(
                stage.name,
                tuple(
                    name
                    for name in stage.uses
                    if name not in cls.optional or cls.uses_optional(index, name)
                ),
            )
            for stage in cls.stages
        )

    @classmethod
    def check_config(cls, index: PipelineIndex) -> None:
        """Check the config entries of ``index`` the class reads: none here.

        Raises:
            ValueError: an entry it reads is wrong (the message names it).
        """
        del index  # the image classes read no config entry

    @classmethod
    def uses_optional(cls, index: PipelineIndex, name: str) -> bool:
        """Tell whether a folder runs optional component ``name``: whether it has it."""
        return name in index.entries

    @classmethod
    def components_for(cls, index: PipelineIndex) -> tuple[str, ...]:
        """Return every component a folder's stages use, in stage order."""
        return tuple(dict.fromkeys(name for stage in cls.stages_for(index) for name in stage.uses))

    def new_scheduler(self) -> Any:
        """Return a fresh scheduler from the folder's config (a run mutates its state)."""
        return self.scheduler_class.from_config(self.scheduler_config)  # type: ignore[attr-defined]

    @cached_property
    def scheduler_draws(self) -> bool:
        """Tell whether the folder's scheduler draws noise from the generator as it steps.

        Such a scheduler (an SDE or ancestral one) draws for the whole batch at once, so
        requests batched together would not each make their image alone: they run apart.
        Found by stepping a fresh scheduler twice on zeros and watching the generator; a
        scheduler that cannot be stepped so is taken to draw.
        """
        scheduler = self.new_scheduler()
        generator = torch.Generator().manual_seed(0)
        before = generator.get_state()
        try:
            shift = {"mu": 0.0} if scheduler.config.get("use_dynamic_shifting") else {}
            scheduler.set_timesteps(2, **shift)
            sample = torch.zeros(1, self.channels, 2, 2)
            for t in scheduler.timesteps:
                if hasattr(scheduler, "scale_model_input"):  # as the pipelines that have it
                    sample = scheduler.scale_model_input(sample, t)
                options = step_options(scheduler, generator)
                sample = scheduler.step(sample * 0, t, sample, **options, return_dict=False)[0]
        except Exception:  # a scheduler of its own: whatever it needs, assume it draws
            return True
        return not torch.equal(before, generator.get_state())

    def loader(self, name: str, kind: type[LoaderT]) -> LoaderT:
        """Return component ``name``'s loader, which must be a ``kind``.

        Raises:
            RecipeError: it is missing or of another kind.
        """
        found = self.loaders.get(name)
        if not isinstance(found, kind):
            what = "missing" if found is None else f"of kind '{found.kind}'"
            raise RecipeError(
                [
                    Problem(
                        "pipeline.unsupported_class",
                        name,
                        f"{self.pipeline_class} needs '{name}' as a {kind.__name__}, but it is "
                        f"{what}",
                        f"give the folder a '{name}' of the class the pipeline expects",
                    )
                ]
            )
        return found

    def run(self, stage: str, modules: Mapping[str, nn.Module], batch: Batch) -> None:
        """Run ``stage`` on ``modules`` (the stage's components, resident) and ``batch``.

        Raises:
            KeyError: the recipe has no such stage.
            ValueError: the batch asks for what this pipeline class cannot do.
        """
        runs: dict[str, Callable[[Mapping[str, nn.Module], Batch], None]] = {
            ENCODE: self.encode,
            DENOISE: self.denoise,
            DECODE: self.decode,
        }
        runs[stage](modules, batch)

    def check(self, batch: Batch) -> list[str]:
        """Refuse a request this pipeline class cannot honour; return its prompts.

        ``encode`` asks it before anything runs; a worker may ask it before queuing.

        Raises:
            ValueError: it has no prompts, a negative prompt the class would ignore, or a
                size off its grid (each message says what to change).
        """
        if not batch.prompts:
            raise ValueError(f"a {self.pipeline_class} request needs prompts")
        if batch.negative_prompts is not None and not self.takes_negative_prompt:
            raise ValueError(
                f"{self.pipeline_class} guides by its distilled guidance embedding and has no "
                "unconditional pass: a negative prompt would be ignored; drop it"
            )
        self.size_groups(batch)
        return batch.prompts

    def guidance_scale(self, batch: Batch) -> float:
        """Return the batch's guidance scale, else the pipeline's default."""
        return self.default_guidance if batch.guidance_scale is None else batch.guidance_scale

    def guided(self, batch: Batch) -> bool:
        """Tell whether ``batch`` runs a second, negative branch: at a scale above 1, in a
        class that takes a negative prompt."""
        return self.takes_negative_prompt and self.guidance_scale(batch) > 1

    def template(self, text: str) -> str:
        """Return ``text`` as the class puts it before its encoders: itself, unless the class
        has a prompt template."""
        return text

    def prompt_keys(self, batch: Batch) -> list[PromptKey]:
        """Return what each row's encoded text depends on besides the encoders (its entry in a
        prompt cache), after ``check``: the class, the templated prompt and, where the class
        encodes one, the templated negative prompt.

        Raises:
            ValueError: as ``check``.
        """
        prompts = self.check(batch)
        guided = self.guided(batch)
        negatives = batch.negative_prompts if guided else None
        return [
            PromptKey(
                self.pipeline_class,
                self.template(prompt),
                None if negatives is None else self.template(negatives[row]),
                guided,
            )
            for row, prompt in enumerate(prompts)
        ]

    @property
    @abstractmethod
    def multiple(self) -> int:
        """What the image's height and width must be multiples of."""

    def default_size(self) -> tuple[int, int]:
        """Return diffusers' default (height, width): the DiT's ``sample_size`` in pixels."""
        side = int(self.transformer.config["sample_size"]) * self.vae.scale_factor
        return side, side

    def requested_size(self, batch: Batch) -> tuple[int, int]:
        """Return the size the batch asks for, else the default."""
        return batch.image_size or self.default_size()

    def requested_sizes(self, batch: Batch) -> list[tuple[int, int]]:
        """Return the size each image asks for: its own, else the batch's, else the default."""
        if batch.image_sizes is not None:
            if len(batch.image_sizes) != batch.size:
                raise ValueError(
                    f"the batch carries {len(batch.image_sizes)} image sizes for {batch.size} "
                    "images; give one size per image"
                )
            return list(batch.image_sizes)
        return [self.requested_size(batch)] * batch.size

    def binned(self, size: tuple[int, int]) -> tuple[int, int]:
        """Return the size the latents are made at for ``size`` asked (the same by default)."""
        return size

    def image_size(self, batch: Batch) -> tuple[int, int]:
        """Return the (height, width) in pixels the latents of a batch of one size are made at.

        Raises:
            ValueError: the size is off the grid (``grid_size``).
        """
        return self.grid_size(self.requested_size(batch))

    def grid_size(self, requested: tuple[int, int]) -> tuple[int, int]:
        """Return the size the latents of an image asking for ``requested`` are made at.

        Raises:
            ValueError: it is off the grid this pipeline can make (the message names the
                multiple it must be).
        """
        height, width = self.binned(requested)
        if height % self.multiple or width % self.multiple:
            raise ValueError(
                f"{self.pipeline_class} cannot make {height}x{width} images: height and "
                f"width must be multiples of {self.multiple}"
            )
        return height, width

    def size_groups(self, batch: Batch) -> list[SizeGroup]:
        """Return the batch's images grouped by the size they ask for, in first-seen order.

        Raises:
            ValueError: a size is off the grid (``grid_size``).
        """
        rows: dict[tuple[int, int], list[int]] = {}
        for row, requested in enumerate(self.requested_sizes(batch)):
            rows.setdefault(requested, []).append(row)
        return [
            SizeGroup(requested, self.grid_size(requested), tuple(members))
            for requested, members in rows.items()
        ]

    def latent_size(self, size: tuple[int, int]) -> tuple[int, int]:
        """Return the latent grid (h, w) of an image of ``size`` pixels."""
        height, width = size
        return height // self.vae.scale_factor, width // self.vae.scale_factor

    def draw_latents(
        self, generator: torch.Generator, count: int, size: tuple[int, int]
    ) -> list[torch.Tensor]:
        """Draw the noise of ``count`` images asking for ``size`` (pixels) as diffusers draws it.

        One ``torch.randn`` of every image's latents together, at the size's bin (where
        the pipeline bins), in ``noise_dtype()``; returns one ``(N, C)`` tensor per image,
        row-major over the grid.
        """
        h, w = self.latent_size(self.binned(size))
        shape = (count, self.channels, h, w)
        return latent_rows(torch.randn(shape, generator=generator, dtype=self.noise_dtype()))

    def noise_dtype(self) -> torch.dtype:
        """Return the dtype the noise is drawn in: ``noise_dtype_of``'s."""
        return self.loader(self.noise_dtype_of, FolderLoader).dtype

    def noise(self, batch: Batch, group: SizeGroup) -> torch.Tensor:
        """Return a group's starting latents ``(B_g, C, h, w)``, drawn if the batch brings none.

        Drawn noise is one ``torch.randn`` per group, groups in order: a batch of one size
        draws as diffusers does.
        """
        if batch.latents is None:
            latents = self.draw_latents(batch.generator, len(group.rows), group.requested)
        else:
            latents = [batch.latents[row] for row in group.rows]
        return latent_grid(latents, *self.latent_size(group.size))

    def denoise(self, modules: Mapping[str, nn.Module], batch: Batch) -> None:
        """Denoise the batch's latents (drawn from its generator if it has none).

        Each size group steps its own scheduler; every step predicts for all groups at
        once: in one packed forward on the custom path, group after group on diffusers'.
        Under a step cache on diffusers' class, each row is a group of its own, so that
        diffusers' hook decides for it alone (``components.cache.hooked``). Each step is
        reported, and rows cancelled meanwhile leave (``step_done``).

        Raises:
            ValueError: an earlier stage's output is missing, or a size is off the grid.
            Cancelled: every row was cancelled.
        """
        transformer = modules["transformer"]
        device = device_of(transformer)
        hooked = self.transformer.cache is not None and not isinstance(
            transformer, PackedTransformer
        )
        groups = self.size_groups(batch)
        if hooked:
            groups = self.rows_apart(batch, groups)
        runs = [self.start(batch, group, device) for group in groups]
        steps = len(runs[0].timesteps)
        self.start_caches(transformer, batch, steps)
        started = list(batch.cache_rows or ())
        try:
            for step in range(steps):
                module = self.denoiser(modules, runs[0].timesteps[step])
                if hooked:
                    predictions = predict_rows(module, runs, batch.cache_rows, step)
                else:
                    cache = step_cache(batch, runs, step, steps)
                    predictions = self.predict(module, runs, step, cache)
                for run, prediction in zip(runs, predictions, strict=True):
                    run.advance(step, prediction)
                runs = step_done(batch, runs)
        finally:
            release_caches(batch)
            if hooked:
                hooks.free(transformer, hooks.row_names(started))
        batch.latents = in_rows(runs, batch.size)

    def predict(
        self, module: nn.Module, runs: Sequence[Denoising], step: int, cache: StepCache | None
    ) -> list[torch.Tensor]:
        """Return ``module``'s prediction for every run at ``step`` (``predict``)."""
        return predict(module, [run.inputs(step) for run in runs], cache)

    def denoiser(self, modules: Mapping[str, nn.Module], timestep: torch.Tensor) -> nn.Module:
        """Return the module that predicts at ``timestep`` (every group of a batch steps
        through the same timesteps): the ``transformer``."""
        return modules["transformer"]

    def rows_apart(self, batch: Batch, groups: Sequence[SizeGroup]) -> list[SizeGroup]:
        """Return one group per row of ``groups``, the noise drawn first as for ``groups``
        (into ``batch.latents``), so that each row starts where it would together."""
        if batch.latents is None:
            drawn = {
                row: noise
                for group in groups
                for row, noise in zip(
                    group.rows,
                    self.draw_latents(batch.generator, len(group.rows), group.requested),
                    strict=True,
                )
            }
            batch.latents = [drawn[row] for row in range(batch.size)]
        return [SizeGroup(g.requested, g.size, (row,)) for g in groups for row in g.rows]

    def start_caches(self, module: nn.Module, batch: Batch, steps: int) -> None:
        """Give each row of ``batch`` that runs the transformer's step cache its own state,
        and diffusers' class its cache hook (admission has held the settings to it)."""
        settings = self.transformer.cache
        if settings is None:
            return
        if not isinstance(module, PackedTransformer):
            hooks.enable(module, settings)
        batch.cache_rows = start_rows(settings, batch.cache_wanted(), steps)

    @abstractmethod
    def start(self, batch: Batch, group: SizeGroup, device: torch.device) -> Denoising:
        """Set up the denoising of one size group: its noise, text and scheduler."""

    def decode(self, modules: Mapping[str, nn.Module], batch: Batch) -> None:
        """Decode the batch's latents into images in [-1, 1]: ``(B, 3, H, W)``, or one
        ``(3, H, W)`` per image when the batch mixes sizes."""
        groups = self.size_groups(batch)
        decoded = [self.decode_group(modules["vae"], batch, group) for group in groups]
        if len(groups) == 1:
            batch.images = decoded[0]
            return
        images: dict[int, torch.Tensor] = {}
        for group, each in zip(groups, decoded, strict=True):
            images |= dict(zip(group.rows, each, strict=True))
        batch.images = [images[row] for row in range(batch.size)]

    @abstractmethod
    def decode_group(self, module: nn.Module, batch: Batch, group: SizeGroup) -> torch.Tensor:
        """Decode one size group's latents into images ``(B_g, 3, H, W)`` in [-1, 1]."""

    def decode_latents(
        self, module: nn.Module, batch: Batch, group: SizeGroup, *, shifted: bool
    ) -> torch.Tensor:
        """Decode a group's latents, unscaled (and shifted) as the VAE's config says.

        Returns images ``(B_g, 3, H, W)`` in [-1, 1].
        """
        config = self.vae.config
        given = [] if batch.latents is None else [batch.latents[row] for row in group.rows]
        latents = latent_grid(given, *self.latent_size(group.size))
        latents = latents.to(device_of(module), self.vae.dtype) / config["scaling_factor"]
        if shifted:
            latents = latents + config["shift_factor"]
        return self.vae.decode(module, latents)

    @abstractmethod
    def encode(self, modules: Mapping[str, nn.Module], batch: Batch) -> None:
        """Embed the batch's prompts (and negative prompts where guidance needs them)."""

    def encode_with(
        self,
        embed: Callable[[nn.Module, Sequence[str]], tuple[list[torch.Tensor], list[bool]]],
        module: nn.Module,
        batch: Batch,
    ) -> None:
        """Embed the checked prompts with ``embed`` on ``module``, marking the rows it cut,
        and under guidance the negative prompts (the empty prompt where a row has none):
        the encode of a class with one text encoder. ``embed`` sees each distinct text once
        (``unique_texts``)."""

        def each_row(texts: Sequence[str]) -> tuple[list[torch.Tensor], list[bool]]:
            distinct, rows = unique_texts(texts)
            states, cut = embed(module, distinct)
            return [states[row] for row in rows], [cut[row] for row in rows]

        prompts = self.check(batch)
        batch.context, truncated = each_row(prompts)
        batch.mark_truncated(truncated)
        if self.guided(batch):
            negative = batch.negative_prompts or [""] * len(prompts)
            batch.negative_context, _ = each_row(negative)

    def interface_problems(self) -> list[Problem]:
        """Say where the components' widths do not fit together (from configs alone)."""
        latents = mismatch(
            "vae",
            "latents",
            width(self.vae, "latents", written=False),
            ["transformer"],
            width(self.transformer, "latents", written=True),
        )
        return [*self.text_problems(), *latents]

    @abstractmethod
    def text_problems(self) -> list[Problem]:
        """Say where the text encoders' widths do not fit what the DiT reads."""

    def encoder_problems(self, encoder: ComponentLoader, layers: int = 1) -> list[Problem]:
        """Say whether ``text_encoder``'s states (``layers`` of them side by side) are as wide
        as the DiT's text: the ``text_problems`` of a class with one text encoder."""
        wrote = width(encoder, "context", written=True)
        return mismatch(
            "transformer",
            "context",
            width(self.transformer, "context", written=False),
            ["text_encoder"],
            None if wrote is None else wrote * layers,
        )


def scheduler_config(index: PipelineIndex) -> dict[str, Any]:
    """Return the folder's ``scheduler/scheduler_config.json``.

    Raises:
        ValueError: the index lists no scheduler, or its config is not a JSON object.
        FileNotFoundError: the scheduler's folder or config is missing (named).
    """
    if SCHEDULER not in index.entries:
        raise ValueError(f"{index.folder / INDEX_FILE} lists no scheduler")
    path = index.subfolder(SCHEDULER) / SCHEDULER_CONFIG
    try:
        config = json.loads(path.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"{path} does not exist") from None
    except ValueError as err:
        raise ValueError(f"{path} is not valid JSON ({err})") from err
    if not isinstance(config, dict):
        raise ValueError(f"{path} holds {type(config).__name__}, not a JSON object")
    return config


def width(loader: ComponentLoader, field: BatchField, *, written: bool) -> int | None:
    """Return the width ``loader`` declares for ``field`` (written or read); None if none."""
    ports: Sequence[Port] = loader.writes() if written else loader.reads()
    return next((port.width for port in ports if port.field == field), None)


def mismatch(
    reader: str, field: str, reads: int | None, writers: Sequence[str], wrote: int | None
) -> list[Problem]:
    """Return a problem when ``reads`` differs from what ``writers`` wrote together."""
    if reads is None or wrote is None or reads == wrote:
        return []
    joined = " + ".join(f"'{w}'" for w in writers)
    return [
        Problem(
            "pipeline.interface_mismatch",
            reader,
            f"component '{reader}' reads {field} {reads} wide, but {joined} "
            f"write{'s' if len(writers) == 1 else ''} it {wrote} wide",
            f"pick components whose {field} widths agree (their config.json files)",
        )
    ]


def guided_texts(batch: Batch, rows: Sequence[int], guided: bool) -> list[torch.Tensor]:
    """Return the text of ``rows``' prompts, then (``guided``) of their negative prompts.

    Raises:
        ValueError: the encode stage has not run.
    """
    if batch.context is None or (guided and batch.negative_context is None):
        raise ValueError("the denoise stage needs the encode stage's text: run it first")
    texts = [batch.context[row] for row in rows]
    if guided:
        assert batch.negative_context is not None  # checked above
        texts += [batch.negative_context[row] for row in rows]
    return texts


def unique_texts(texts: Sequence[str]) -> tuple[list[str], list[int]]:
    """Return the distinct texts in first-seen order, and each text's index among them.

    Each prompt is encoded once however many images it makes, as diffusers encodes it.
    """
    order: dict[str, int] = {}
    rows = [order.setdefault(text, len(order)) for text in texts]
    return list(order), rows


def step_options(scheduler: Any, generator: torch.Generator) -> dict[str, Any]:
    """Return the extra arguments diffusers hands ``scheduler.step``: ``eta`` 0, the generator."""
    accepted = inspect.signature(scheduler.step).parameters
    options: dict[str, Any] = {}
    if "eta" in accepted:
        options["eta"] = 0.0
    if "generator" in accepted:
        options["generator"] = generator
    return options


def step_cache(batch: Batch, runs: Sequence[Denoising], step: int, steps: int) -> StepCache | None:
    """Return the step cache's view of ``step`` for one forward over ``runs``, or None
    when no row of the batch runs a cache: every forward row's cache, group after group."""
    caches = batch.cache_rows
    if caches is None or not any_cached(caches):
        return None
    rows = [r for run in runs for r in step_rows([caches[i] for i in run.rows], run.branches)]
    return StepCache(step, steps, rows)


def in_rows(runs: Sequence[Denoising], count: int) -> list[torch.Tensor]:
    """Return the latents ``(N, C)`` of the batch's ``count`` rows, from every group's run."""
    latents: dict[int, torch.Tensor] = {}
    for run in runs:
        latents |= dict(zip(run.rows, run.result(), strict=True))
    return [latents[row] for row in range(count)]


def step_done(batch: Batch, runs: list[Denoising]) -> list[Denoising]:
    """Report one denoising step of ``batch`` and take out the rows cancelled meanwhile.

    A cancelled row leaves ``batch`` (``Batch.stepped``) and its group's run (latents,
    text and the scheduler's per-image state), so the rows that stay step on as they
    would alone; a group left with no row stops. Returns the runs that go on.

    Raises:
        Cancelled: no row is left.
    """
    kept = batch.stepped(in_rows(runs, batch.size))
    if kept is None:
        return runs
    position = {row: index for index, row in enumerate(kept)}
    going = []
    for run in runs:
        keep = [i for i, row in enumerate(run.rows) if row in position]
        if keep:
            run.narrow(keep)
            run.rows = [position[run.rows[i]] for i in keep]
            going.append(run)
    return going


def narrow_scheduler(scheduler: Any, shape: torch.Size, keep: list[int]) -> None:
    """Keep rows ``keep`` of every tensor ``scheduler`` holds shaped as the sample it steps.

    Those are per image: a multistep scheduler keeps earlier steps' outputs and samples
    (DPM-Solver's ``model_outputs``, UniPC's ``last_sample``), in attributes or lists;
    its timesteps and sigmas are one-dimensional and never match.
    """

    def per_image(value: object) -> bool:
        return isinstance(value, torch.Tensor) and value.shape == shape

    state = vars(scheduler)
    for name, value in list(state.items()):
        if per_image(value):
            state[name] = value[keep]
        elif isinstance(value, list) and any(per_image(x) for x in value):
            state[name] = [x[keep] if per_image(x) else x for x in value]


def latent_rows(grid: torch.Tensor) -> list[torch.Tensor]:
    """Return latents ``(B, C, h, w)`` as one ``(N, C)`` tensor per image, row-major (views)."""
    return [x.flatten(1).T for x in grid]


def latent_grid(latents: Sequence[torch.Tensor], h: int, w: int) -> torch.Tensor:
    """Stack per-image ``(N, C)`` latents (row-major over ``h x w``) into ``(B, C, h, w)``.

    Raises:
        ValueError: there are none: the stage that makes them has not run.
    """
    if not latents:
        raise ValueError("the stage needs latents: run the denoise stage first")
    return torch.stack([x.T.reshape(-1, h, w) for x in latents])
