"""What one request carries from stage to stage while a pipeline runs."""

from __future__ import annotations

import threading
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, NamedTuple, TypeAlias

import msgspec
import torch
from torch import nn

from components.defaults import DEFAULT_STEPS

if TYPE_CHECKING:
    from components.cache import RowCache

__all__ = [
    "RGB",
    "Batch",
    "BatchField",
    "Cancelled",
    "Left",
    "Port",
    "StepDone",
    "StepHook",
    "device_of",
]

# B prompts, N latent tokens, C latent channels, L text tokens, E text embedding width


RGB = 3  # the colour channels of Batch.images
BatchField = Literal[
    "prompts",
    "context",
    "pooled",
    "sentence_embeddings",
    "latents",
    "images",
    "image_context",
    "videos",
]


class Port(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One ``Batch`` field a kind reads or writes, with the width its options imply.

    Admission walks the stages with these, so components that do not fit
    together are refused before anything is built.

    Attributes:
        field: the ``Batch`` attribute.
        width: the size of its last dimension (E, C, 3 colour channels); None when it
            has none (text).
        option: the kind's option that sets the width, named in the refusal's hint.
    """

    field: BatchField
    width: int | None = None
    option: str | None = None


class Cancelled(Exception):
    """Every row of a batch was cancelled: the request stops where it stands.

    Raised between denoising steps or before a stage; the stage it leaves puts its
    components back by the ordinary moves, as for any other exception.

    Attributes:
        stage: the stage it stopped in (or was about to enter), when known.
        step: the denoising steps that stage had done.
    """

    def __init__(self, stage: str | None, step: int) -> None:
        super().__init__(f"cancelled at stage {stage!r}, step {step}")
        self.stage = stage
        self.step = step


class StepDone(NamedTuple):
    """One denoising step of a batch is done (what ``Batch.on_step`` receives).

    Attributes:
        step: steps done so far, 1 to ``steps``.
        steps: the stage's steps in all.
        rows: the batch's original row of each latent, the rows still running.
        latents: each running row's latents after this step.
    """

    step: int
    steps: int
    rows: tuple[int, ...]
    latents: Sequence[torch.Tensor]


StepHook: TypeAlias = Callable[[StepDone], None]
"""Called on the denoising thread after every step: return quickly (a preview, a queue)."""


class Left(NamedTuple):
    """Rows that left a batch because a request was cancelled (``Batch.left``).

    Attributes:
        request_id: who cancelled them.
        rows: the original rows that left.
        stage: the stage they left in.
        step: the denoising steps that stage had done.
    """

    request_id: str
    rows: tuple[int, ...]
    stage: str | None
    step: int


class Cancellation:
    """Rows of a batch cancelled from any thread, taken out between steps.

    ``pending`` is a plain attribute: the denoising loop reads it once a step,
    without a lock, and takes the lock only when something was cancelled.
    """

    __slots__ = ("_lock", "_rows", "pending")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._rows: dict[str, Collection[int] | None] = {}
        self.pending = False

    def cancel(self, request_id: str, rows: Collection[int] | None = None) -> None:
        """Cancel ``rows`` (original rows; None: every row) on behalf of ``request_id``."""
        with self._lock:
            self._rows[request_id] = rows
            self.pending = True

    def take(self) -> dict[str, Collection[int] | None]:
        """Return and forget what was cancelled since the last call."""
        with self._lock:
            taken, self._rows = self._rows, {}
            self.pending = False
            return taken


def device_of(module: nn.Module) -> torch.device:
    """Return the device ``module``'s weights are on (inputs made on the host go there)."""
    return next(module.parameters()).device


@dataclass
class Batch:
    """The values a request hands from one component to the next.

    Each kind's ``run`` reads what it needs (making seeded inputs when an
    earlier stage did not provide them) and writes what it produces.

    Attributes:
        generator: the seeded source of every input a kind makes up.
        steps: denoising steps for a denoiser.
        size: prompts in the request.
        latent_size: the latent grid (h, w); the image is larger per the decoder.
        prompts: the request's text, ``size`` sentences; a text encoder picks seeded
            ones (and records them here) when none are given.
        context: text embeddings, one ``(L_i, E)`` tensor per prompt.
        sentence_embeddings: ``(B, E)``, one unit-length row per prompt (for
            similarity search).
        latents: latents, one ``(N, C)`` tensor per prompt, row-major over (h, w).
        guidance_scale: classifier-free guidance: a denoiser predicts
            ``uncond + scale * (cond - uncond)``; 1 turns it off (one branch); None
            takes the denoiser's own default (its ``guidance_scale`` option).
        negative_prompts: the unconditional branch's text, one sentence per prompt; a
            text encoder embeds them into ``negative_context``.
        negative_context: the unconditional branch's text embeddings, one ``(L_i, E)``
            tensor per prompt (embedded negative prompts); None means the empty prompt,
            one zero embedding.
        images: images ``(B, 3, H, W)`` in [-1, 1]; one ``(3, H_i, W_i)`` tensor per image
            when the batch mixes sizes (``image_sizes``).
        image_size: the images' (height, width) in pixels, for a pipeline from a folder;
            None takes the pipeline's default (a kind's images follow ``latent_size``).
        image_sizes: each image's own (height, width) in pixels, for a folder pipeline
            whose requests of different sizes share the batch; None: all take
            ``image_size``.
        context_mask: which tokens of ``context`` are real, ``(B, L)``, where the
            denoiser masks padding (PixArt); None when it attends to every token.
        negative_context_mask: the same for ``negative_context``.
        pooled: one pooled text vector per prompt, ``(B, P)`` (Flux, SD3).
        negative_pooled: the same for the negative prompts.
        rows: the original row (0 to the first ``size`` - 1) of each row still in the
            batch: cancelled rows leave (``drop_cancelled``), the others keep their order.
        stage: the stage running now (the orchestrator sets it).
        step: the denoising steps the running stage has done.
        on_step: called after every denoising step (progress, previews).
        cancellation: where rows are cancelled from other threads.
        left: every cancellation taken so far, in order (the orchestrator reports each).
        truncated: per prompt, whether a text encoder cut it to the longest
            tokenisation it reads (None until a text encoder ran).
        adapters: each row's adapters (LoRA, design §14) by name with the scale it runs
            them at; None, or a row naming none, runs the base weights.
        cache: whether its rows run the denoiser's step cache (design §17), where the
            component has one: one flag for every row, or one per row. False computes
            every step of those rows (they still share the forward with cached rows).
        cache_rows: each row's step cache while the denoiser runs (None for a row that
            runs none), set by the denoiser; its counts stay after the stage.
        frames: the frames of each video, for a pipeline that makes videos; None takes
            the pipeline's default.
        guidance_scale_2: the guidance scale of a second denoiser's steps (Wan 2.2
            A14B's ``transformer_2``); None takes ``guidance_scale``.
        input_images: the image each video starts from (PIL images, one per row), for
            image to video.
        last_images: the image each video ends on (PIL images), where the pipeline
            takes one; None: none.
        image_context: an image encoder's states of each row's input image(s), one
            ``(P, E)`` tensor per row.
        condition: what each row's denoising is conditioned on beside the text (image to
            video: the mask and the encoded input frames), one tensor per row.
        videos: videos ``(B, 3, F, H, W)`` in [-1, 1].

    A denoising loop calls ``stepped`` after each step: it reports the step and drops
    the rows cancelled meanwhile, so a cancelled row costs at most one more step and
    the rows that stay compute exactly what they would have alone. A kind whose
    loop keeps per-row values of its own narrows them with the positions returned.
    """

    generator: torch.Generator
    steps: int = DEFAULT_STEPS
    size: int = 1
    latent_size: tuple[int, int] = (4, 4)
    prompts: list[str] | None = None
    context: list[torch.Tensor] | None = None
    sentence_embeddings: torch.Tensor | None = None
    latents: list[torch.Tensor] | None = None
    images: torch.Tensor | list[torch.Tensor] | None = field(default=None)
    guidance_scale: float | None = None
    negative_prompts: list[str] | None = None
    negative_context: list[torch.Tensor] | None = None
    image_size: tuple[int, int] | None = None
    image_sizes: list[tuple[int, int]] | None = None
    context_mask: torch.Tensor | None = None
    negative_context_mask: torch.Tensor | None = None
    pooled: torch.Tensor | None = None
    negative_pooled: torch.Tensor | None = None
    rows: list[int] = field(default_factory=list)
    stage: str | None = None
    step: int = 0
    on_step: StepHook | None = None
    cancellation: Cancellation = field(default_factory=Cancellation)
    left: list[Left] = field(default_factory=list)
    truncated: list[bool] | None = None
    adapters: list[dict[str, float]] | None = None
    cache: bool | list[bool] = True
    cache_rows: list[RowCache | None] | None = None
    frames: int | None = None
    guidance_scale_2: float | None = None
    input_images: list[Any] | None = None
    last_images: list[Any] | None = None
    image_context: list[torch.Tensor] | None = None
    condition: list[torch.Tensor] | None = None
    videos: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if not self.rows:
            self.rows = list(range(self.size))

    def stepped(self, latents: Sequence[torch.Tensor]) -> list[int] | None:
        """Say one denoising step is done with ``latents``, then drop cancelled rows.

        Call it after each step, with the latents of the rows still in the batch.

        Returns the positions of the rows that stay (index your own per-row values
        with it), or None when every row stays.

        Raises:
            Cancelled: no row is left.
        """
        self.step += 1
        if self.on_step is not None:
            self.on_step(StepDone(self.step, self.steps, tuple(self.rows), latents))
        return self.drop_cancelled()

    def drop_cancelled(self) -> list[int] | None:
        """Take the rows cancelled since the last call out of every per-row field.

        Returns the positions of the rows that stay, or None when every row stays.
        Rows a kind makes up (no prompts, no latents given) are drawn for the rows
        left, so give them when outputs must not depend on a cancellation.

        Raises:
            Cancelled: no row is left.
        """
        if not self.cancellation.pending:
            return None
        gone: set[int] = set()
        for request_id, rows in self.cancellation.take().items():
            here = tuple(row for row in self.rows if rows is None or row in rows)
            gone.update(here)
            self.left.append(Left(request_id, here, self.stage, self.step))
        keep = [i for i, row in enumerate(self.rows) if row not in gone]
        if len(keep) == len(self.rows):
            return None
        if not keep:
            raise Cancelled(self.stage, self.step)
        self._narrow(keep)
        return keep

    def _narrow(self, keep: list[int]) -> None:
        """Keep only the rows at positions ``keep`` in every per-row field."""
        for name in (
            "prompts",
            "context",
            "latents",
            "negative_prompts",
            "negative_context",
            "truncated",
            "adapters",
            "image_sizes",
            "sentence_embeddings",
            "images",  # a list of tensors when the batch mixes sizes
            "context_mask",
            "negative_context_mask",
            "pooled",
            "negative_pooled",
            "cache",  # a list when rows differ
            "cache_rows",
            "input_images",
            "last_images",
            "image_context",
            "condition",
            "videos",
        ):
            values = getattr(self, name)
            if isinstance(values, list):
                setattr(self, name, [values[i] for i in keep])
            elif isinstance(values, torch.Tensor):
                setattr(self, name, values[keep])
        self.rows = [self.rows[i] for i in keep]
        self.size = len(keep)

    def cache_wanted(self) -> list[bool]:
        """Return whether each row runs the step cache (``cache``, per row)."""
        if isinstance(self.cache, bool):
            return [self.cache] * self.size
        if len(self.cache) != self.size:
            raise ValueError(
                f"the batch carries {len(self.cache)} cache flags for {self.size} rows; give "
                "one per row, or one for all"
            )
        return list(self.cache)

    def mark_truncated(self, truncated: list[bool]) -> None:
        """Record which prompts a text encoder cut (a prompt cut by any encoder stays cut)."""
        if self.truncated is None:
            self.truncated = list(truncated)
        else:
            self.truncated = [a or b for a, b in zip(self.truncated, truncated, strict=True)]
