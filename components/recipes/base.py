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
from typing import Any, ClassVar, NamedTuple, TypeVar

import torch
from torch import nn

from components.batch import Batch, BatchField, Port
from components.folders.index import PipelineIndex
from components.folders.problems import Problem
from components.libraries import library_class
from components.loader import ComponentLoader

# B images, C latent channels, h w latent grid, N latent positions (h * w), L tokens, E width

ENCODE, DENOISE, DECODE = "encode", "denoise", "decode"
SCHEDULER = "scheduler"
SCHEDULER_CONFIG = "scheduler_config.json"

LoaderT = TypeVar("LoaderT", bound=ComponentLoader)


class Stage(NamedTuple):
    """One stage of a recipe and the components it uses, in order."""

    name: str
    uses: tuple[str, ...]


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

    Subclasses set ``pipeline_class``, ``stages`` and the defaults diffusers' ``__call__``
    has, and implement each stage.

    Args:
        index: the folder's ``model_index.json``.
        loaders: the loader of every component the stages use, by name.

    Raises:
        RecipeError: a component is missing or of a kind the recipe cannot drive.
        ValueError: the scheduler's config cannot be read or its class is not a
            diffusers scheduler.
    """

    pipeline_class: ClassVar[str]
    stages: ClassVar[tuple[Stage, ...]]
    default_steps: ClassVar[int]
    default_guidance: ClassVar[float]
    takes_negative_prompt: ClassVar[bool] = True

    def __init__(self, index: PipelineIndex, loaders: Mapping[str, ComponentLoader]) -> None:
        self.index = index
        self.loaders = loaders
        entry = index.entries.get(SCHEDULER)
        if entry is None:
            raise ValueError(f"{index.folder} lists no scheduler in its model_index.json")
        path = index.subfolder(SCHEDULER) / SCHEDULER_CONFIG
        try:
            self.scheduler_config: dict[str, Any] = json.loads(path.read_text())
        except OSError as err:
            raise FileNotFoundError(f"cannot read {path} ({err})") from err
        self.scheduler_class = library_class("diffusers", entry.class_name, "SchedulerMixin")

    @classmethod
    def components(cls) -> tuple[str, ...]:
        """Return every component the stages use, in stage order."""
        return tuple(dict.fromkeys(name for stage in cls.stages for name in stage.uses))

    def new_scheduler(self) -> Any:
        """Return a fresh scheduler from the folder's config (a run mutates its state)."""
        return self.scheduler_class.from_config(self.scheduler_config)  # type: ignore[attr-defined]

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

    def guidance_scale(self, batch: Batch) -> float:
        """Return the batch's guidance scale, else the pipeline's default."""
        return self.default_guidance if batch.guidance_scale is None else batch.guidance_scale

    @abstractmethod
    def image_size(self, batch: Batch) -> tuple[int, int]:
        """Return the (height, width) in pixels the batch's images are made at.

        Raises:
            ValueError: the size is one this pipeline cannot make (the message names
                the multiple it must be).
        """

    @abstractmethod
    def draw_latents(
        self, generator: torch.Generator, count: int, size: tuple[int, int]
    ) -> list[torch.Tensor]:
        """Draw the starting noise of ``count`` images of ``size``, as diffusers draws it.

        Returns one ``(N, C)`` tensor per image, row-major over the latent grid.
        """

    @abstractmethod
    def encode(self, modules: Mapping[str, nn.Module], batch: Batch) -> None:
        """Embed the batch's prompts (and negative prompts where guidance needs them)."""

    @abstractmethod
    def denoise(self, modules: Mapping[str, nn.Module], batch: Batch) -> None:
        """Denoise the batch's latents (drawn from its generator if it has none)."""

    @abstractmethod
    def decode(self, modules: Mapping[str, nn.Module], batch: Batch) -> None:
        """Decode the batch's latents into images ``(B, 3, H, W)`` in [-1, 1]."""

    @abstractmethod
    def interface_problems(self) -> list[Problem]:
        """Say where the components' widths do not fit together (from configs alone)."""


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


def latent_grid(latents: Sequence[torch.Tensor], h: int, w: int) -> torch.Tensor:
    """Stack per-image ``(N, C)`` latents (row-major over ``h x w``) into ``(B, C, h, w)``.

    Raises:
        ValueError: there are none: the stage that makes them has not run.
    """
    if not latents:
        raise ValueError("the stage needs latents: run the denoise stage first")
    return torch.stack([x.T.reshape(-1, h, w) for x in latents])
