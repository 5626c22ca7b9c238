"""The main job: run requests of a pipeline through the orchestrator and sum them up.

A run keeps running totals, never a record per move: memory stays flat however
many requests run. Moves are kept only for a timeline, when one is asked for.
"""

from __future__ import annotations

import time
from array import array
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import torch
from msgspec import UnsetType

from components import registry
from components.batch import Batch
from components.cache import CacheSteps
from components.compile import Compilation, CompileMode
from components.loader import ComponentLoader
from components.quantize import Quantization
from lifecycle.cli.cores import Threads
from lifecycle.cli.neighbours import Neighbour, nearest_neighbours
from lifecycle.cli.progress import RunProgress, Silent
from lifecycle.events import Event, Move, PromptCounts, RequestEnded
from lifecycle.orchestrator import Orchestrator
from lifecycle.pictures.formats import VideoFormat
from lifecycle.pictures.png import write_png
from lifecycle.pictures.video import write_video
from lifecycle.plan import PipelineSnapshot
from lifecycle.prompts import counted
from lifecycle.spec.structs import PipelineSpec

__all__ = [
    "MoveTally",
    "RequestArgs",
    "RunOutputs",
    "RunReport",
    "run_requests",
    "summarise",
    "unrunnable_components",
]


class ComponentReport(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """What one component did during a run.

    Attributes:
        state: its state at the end.
        backends: each attention site's backend, with the fallback reason if any.
        onloads: moves onto the device.
        offloads: moves off it.
        bytes_moved: bytes moved either way.
        move_seconds: time spent moving.
        bytes_streamed: bytes of blocks a layerwise component streamed in and out while
            it ran (``Move.streamed``).
        cache: the image steps its step cache computed and skipped over every request
            (design §17); None for a component without one.
        recompiles: the graphs inductor compiled after its first forward (design §17);
            None for a component that is not compiled.
        compile_seconds: the seconds inductor spent compiling it; None when not compiled.
        bytes: the bytes its weights take once loaded (quantized weights as their data and
            scales); None when unknown.
        compile: how torch.compile compiles it (design §17).
        quantization: how torchao holds its linear weights (design §17).
    """

    state: str
    backends: tuple[str, ...]
    onloads: int
    offloads: int
    bytes_moved: int
    move_seconds: float
    bytes_streamed: int = 0
    cache: CacheSteps | None = None
    recompiles: int | None = None
    compile_seconds: float | None = None
    bytes: int | None = None
    compile: CompileMode = "off"
    quantization: Quantization = "off"


class RunReport(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A run of ``lifecycle run``.

    Attributes:
        pipeline: the pipeline's name.
        requests: how many requests completed.
        steps: denoising steps per request.
        threads: torch's intra-op threads during the run.
        threads_reason: what set that count (``--threads``, ``2 physical cores``, ...).
        request_ms: each completed request's wall time.
        components: what each component did.
        neighbours: each embedded sentence's nearest neighbour (pipelines that embed).
        images: the PNG files written (with an output folder).
        videos: the videos written (with an output folder): MP4 or WebP files, or
            folders of PNG frames.
        stopped_by: the signal that stopped the run early, or None.
        prompt_cache: the rows whose text the prompt cache gave and the rows encoded, over
            every request (design §19); None without a prompt cache.
    """

    pipeline: str
    requests: int
    steps: int
    threads: int
    threads_reason: str
    request_ms: tuple[float, ...]
    components: dict[str, ComponentReport]
    neighbours: tuple[Neighbour, ...] = ()
    images: tuple[str, ...] = ()
    videos: tuple[str, ...] = ()
    stopped_by: str | None = None
    prompt_cache: PromptCounts | None = None


@dataclass
class _Totals:
    onloads: int = 0
    offloads: int = 0
    bytes: int = 0
    seconds: float = 0.0
    streamed: int = 0
    cache: CacheSteps = field(default_factory=CacheSteps)


class MoveTally:
    """An observer of the orchestrator during a run: running totals of each component's moves
    (and of its step cache's steps, as each request ends).

    Args:
        components: the pipeline's components.
        keep_moves: also keep every move, in order (for a timeline); memory then
            grows with the run.
    """

    def __init__(self, components: Iterable[str], *, keep_moves: bool) -> None:
        self._totals = {name: _Totals() for name in components}
        self.moves: list[Move] | None = [] if keep_moves else None
        self.prompts: PromptCounts | None = None
        """The prompt cache's rows over every request; None without a prompt cache."""

    def __call__(self, event: Event) -> None:
        if isinstance(event, RequestEnded):
            for name, steps in event.cache.items():
                self._totals[name].cache += steps
            if event.prompts is not None:
                self.prompts = counted(event.prompts.hits, event.prompts.misses, self.prompts)
            return
        if not isinstance(event, Move):
            return  # only moves and ended requests add to the totals
        totals = self._totals[event.component]
        if event.direction == "onload":
            totals.onloads += 1
        else:
            totals.offloads += 1
        totals.bytes += event.bytes
        totals.streamed += event.streamed
        totals.seconds += event.seconds
        if self.moves is not None:
            self.moves.append(event)

    def report(
        self, snapshot: PipelineSnapshot, compilations: Mapping[str, Compilation]
    ) -> dict[str, ComponentReport]:
        """Return each component's totals with its state and backends from ``snapshot``,
        and what compiling did for those in ``compilations``."""
        return {
            name: ComponentReport(
                state=component.state.value,
                backends=tuple(
                    f"{s.site}={s.backend}" + (f" ({s.reason})" if s.reason else "")
                    for s in component.attention
                ),
                onloads=self._totals[name].onloads,
                offloads=self._totals[name].offloads,
                bytes_moved=self._totals[name].bytes,
                move_seconds=round(self._totals[name].seconds, 6),
                bytes_streamed=self._totals[name].streamed,
                cache=None if component.cache is None else self._totals[name].cache,
                recompiles=None if name not in compilations else compilations[name].recompiles,
                compile_seconds=None
                if name not in compilations
                else round(compilations[name].seconds, 3),
                bytes=component.bytes,
                compile=component.compile,
                quantization=component.quantization,
            )
            for name, component in snapshot.components.items()
        }


@dataclass
class RunOutputs:
    """What the completed requests of a run produced, kept as they complete.

    Attributes:
        request_ms: each completed request's wall time (8 bytes a request).
        sentences: each distinct embedded sentence with its vector.
        images: the PNG files written.
        videos: the videos written.
        video_format: how videos are written.
    """

    request_ms: array[float] = field(default_factory=lambda: array("d"))
    sentences: dict[str, torch.Tensor] = field(default_factory=dict)
    images: list[str] = field(default_factory=list)
    videos: list[str] = field(default_factory=list)
    video_format: VideoFormat = "mp4"

    def record(self, request_id: str, batch: Batch, out: Path | None) -> None:
        """Keep the embeddings of ``batch`` and write its images and videos into ``out``."""
        if batch.sentence_embeddings is not None and batch.prompts is not None:
            for sentence, vector in zip(batch.prompts, batch.sentence_embeddings, strict=True):
                self.sentences.setdefault(sentence, vector.detach().cpu())
        if out is not None and batch.images is not None:
            for index, image in enumerate(batch.images):
                self.images.append(str(write_png(image, out / f"{request_id}-{index}.png")))
        if out is not None and batch.videos is not None:
            for index, video in enumerate(batch.videos):
                written = write_video(video, out / f"{request_id}-{index}", self.video_format)
                self.videos.append(str(written))


def unrunnable_components(spec: PipelineSpec) -> list[str]:
    """Return a sentence for each staged component whose kind does not say how it runs.

    A pipeline from a folder has none: its recipe runs every stage.
    """
    if not isinstance(spec.source, UnsetType):
        return []
    staged = {name for stage in spec.stages for name in stage.uses}
    return [
        f"component '{name}' of kind '{component.kind}' does not say how it runs in a "
        "request; implement ComponentLoader.run for that kind to drive it with `lifecycle run`"
        for name, component in spec.components.items()
        if name in staged and registry.get(component.kind).run is ComponentLoader.run
    ]


@dataclass(frozen=True)
class RequestArgs:
    """What every request of a run asks for.

    Attributes:
        steps: denoising steps.
        guidance_scale: the guidance scale; None takes the pipeline's default.
        prompts: the sentences each request carries (one image or embedding each); none:
            seeded ones.
        negative_prompt: the text every prompt's unguided branch carries, or None.
        seed: request ``i`` draws its inputs from seed ``seed + i`` (for a pipeline from a
            folder, as diffusers' ``generator=torch.Generator("cpu").manual_seed(seed + i)``).
        image_size: (height, width) in pixels of a pipeline from a folder's images; None
            takes its default.
        frames: the frames of each video, for a pipeline that makes videos; None takes
            its default.
        guidance_scale_2: the guidance scale of a second expert's steps; None takes
            ``guidance_scale``.
        image: the image (PIL) every video starts from, for image to video.
        last_image: the image (PIL) every video ends on, or None.
    """

    steps: int
    guidance_scale: float | None = None
    prompts: Sequence[str] = ()
    negative_prompt: str | None = None
    seed: int = 0
    image_size: tuple[int, int] | None = None
    frames: int | None = None
    guidance_scale_2: float | None = None
    image: Any = None
    last_image: Any = None

    def batch(self, index: int) -> Batch:
        """Return the ``Batch`` of request ``index`` (counted from 0)."""
        size = len(self.prompts) or 1
        negative = self.negative_prompt
        return Batch(
            generator=torch.Generator("cpu").manual_seed(self.seed + index),
            steps=self.steps,
            guidance_scale=self.guidance_scale,
            size=size,
            prompts=list(self.prompts) or None,
            negative_prompts=None if negative is None else [negative] * size,
            image_size=self.image_size,
            frames=self.frames,
            guidance_scale_2=self.guidance_scale_2,
            input_images=None if self.image is None else [self.image] * size,
            last_images=None if self.last_image is None else [self.last_image] * size,
        )


def run_requests(
    orchestrator: Orchestrator,
    outputs: RunOutputs,
    *,
    requests: int | range,
    args: RequestArgs,
    out: Path | None = None,
    should_stop: Callable[[], bool] = lambda: False,
    progress: RunProgress | None = None,
) -> None:
    """Run up to ``requests`` requests (a count, or the indices to run) through every stage.

    Request ``i`` is ``args.batch(i)``. ``should_stop`` is asked before each request; a
    request that started always completes. ``progress`` hears of each request, stage and
    denoising step.

    Raises:
        TransitionRefused: a stage could not onload its components.
        TransitionFailed: moving a component failed (rolled back).
    """
    indices = range(requests) if isinstance(requests, int) else requests
    shown = progress or Silent()
    stages = [stage.name for stage in orchestrator.spec.stages]
    for done, index in enumerate(indices, start=1):
        if should_stop():
            return
        started = time.perf_counter()
        batch = args.batch(index)
        batch.on_step = shown.stepped
        request_id = f"r{index + 1}"
        shown.request_began(request_id, done)
        with orchestrator.request(request_id) as request:
            for stage in stages:
                shown.stage_began(stage)
                request.run(stage, batch)
                shown.stage_ended()
        outputs.request_ms.append(round((time.perf_counter() - started) * 1e3, 3))
        outputs.record(request_id, batch, out)
        shown.request_ended(outputs.request_ms[-1])


def summarise(
    snapshot: PipelineSnapshot,
    tally: MoveTally,
    outputs: RunOutputs,
    compilations: Mapping[str, Compilation],
    *,
    steps: int,
    threads: Threads,
    stopped_by: str | None = None,
) -> RunReport:
    """Return the report of the requests that completed."""
    return RunReport(
        pipeline=snapshot.pipeline,
        requests=len(outputs.request_ms),
        steps=steps,
        threads=threads.count,
        threads_reason=threads.reason,
        request_ms=tuple(outputs.request_ms),
        components=tally.report(snapshot, compilations),
        neighbours=nearest_neighbours(outputs.sentences),
        images=tuple(outputs.images),
        videos=tuple(outputs.videos),
        stopped_by=stopped_by,
        prompt_cache=tally.prompts,
    )
