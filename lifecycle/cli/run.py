"""``lifecycle run``: serve N requests of a pipeline and print what they did.

Everything that can be checked before work starts is (the spec, that each
kind can run a request, the output paths), so a run never fails at its end.
A run first decides what happened (a ``RunOutcome``), then prints it.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from msgspec import UnsetType

from lifecycle.admission import component_loaders
from lifecycle.admission.folder import default_steps, open_folder
from lifecycle.autotune import tune
from lifecycle.cli import launch
from lifecycle.cli.console import format_refusals, run_summary
from lifecycle.cli.cores import Threads, torch_threads
from lifecycle.cli.exits import ExitCode
from lifecycle.cli.output import print_json
from lifecycle.cli.paths import OutputPathError, prepare_file, prepare_folder
from lifecycle.cli.progress import run_progress
from lifecycle.cli.runner import (
    MoveTally,
    RequestArgs,
    RunOutputs,
    RunReport,
    run_requests,
    summarise,
    unrunnable_components,
)
from lifecycle.cli.signals import Abandoned, StopOnSignal
from lifecycle.events import Move
from lifecycle.orchestrator import Orchestrator
from lifecycle.pictures.formats import VideoFormat
from lifecycle.pictures.gantt import residency_gantt
from lifecycle.pictures.video import VIDEO_EXTRA, default_format, mp4_missing
from lifecycle.plan import PipelineSnapshot
from lifecycle.refusals import Refusal, TransitionFailed, TransitionRefused
from lifecycle.spec.errors import ConfigError
from lifecycle.spec.reading import load_spec
from lifecycle.spec.structs import PipelineSpec

__all__ = ["run_command"]


@dataclass(frozen=True)
class Ending:
    """How a run ended: its exit code and what went wrong.

    Attributes:
        code: the exit code, set by the first thing that went wrong (OK when nothing did).
        refusals: every reason a transition was refused (code REFUSED).
        invalid: why a trigger was not valid from its state, when that was the refusal.
        failures: what failed while running, closing or writing the timeline, in order.
    """

    code: ExitCode = ExitCode.OK
    refusals: tuple[Refusal, ...] = ()
    invalid: str | None = None
    failures: tuple[str, ...] = ()

    def failed(self, text: str) -> Ending:
        """Return this ending with one more failure, FAILED unless something went wrong before."""
        return replace(self, code=self.code or ExitCode.FAILED, failures=(*self.failures, text))


@dataclass(frozen=True)
class RunOutcome:
    """What a run did, decided before anything is printed.

    Attributes:
        ending: how it ended.
        report: what the completed requests did.
        snapshot: every component's state when the requests ended, before closing.
        notes: each output asked for that no component produced.
    """

    ending: Ending
    report: RunReport
    snapshot: PipelineSnapshot
    notes: tuple[str, ...] = ()


def run_command(args: argparse.Namespace) -> int:
    """Run ``args.requests`` requests of the spec at ``args.spec``; return the exit code.

    With ``--nproc N`` fork N workers of this same command through torchrun's launcher
    instead; a worker (any ``lifecycle run`` torchrun started) runs its replica's share.
    """
    if args.nproc is not None:
        return launch.spawn(args.nproc, launch.worker_argv(args))
    with launch.worker():
        try:
            return _run_here(args)
        except BrokenPipeError:
            raise  # stdout's reader left: not a failure of the run (lifecycle.cli.entry)
        except Exception as err:  # a bug: one line naming it, its traceback in the logs
            return launch.crashed(err)


def _run_here(args: argparse.Namespace) -> int:
    try:
        spec = load_spec(args.spec, download=args.download)
    except ConfigError as err:
        return _bad_input(args, f"{args.spec}: {err}", {"path": err.path, "message": err.message})
    problems = unrunnable_components(spec)
    if problems:
        text = "; ".join(problems)
        return _bad_input(args, f"{args.spec}: {text}", {"message": text})
    try:
        asked = request_args(args, spec)
        videos_as = video_format(args.video_format)
    except ValueError as err:
        return _bad_input(args, f"{args.spec}: {err}", {"message": str(err)})
    try:
        if args.timeline is not None:
            prepare_file(args.timeline, "the timeline")
        if args.out is not None:
            prepare_folder(args.out, "the output folder")
    except OutputPathError as err:
        return _bad_input(args, f"{args.spec}: {err}", {"message": str(err)})
    threads = torch_threads(args.threads, processes=launch.local_world_size())
    with _torch_threads(threads.count), StopOnSignal() as stop:
        outcome = _run(args, spec, asked, threads, stop, videos_as)
        _report(args, spec, outcome)
        return stop.exit_code or outcome.ending.code


def request_args(args: argparse.Namespace, spec: PipelineSpec) -> RequestArgs:
    """Return what every request of the run asks for, defaults filled in.

    A pipeline from a folder takes its pipeline class's steps, and is asked up front
    whether it can honour the request (prompts, size, negative prompt).

    Raises:
        ValueError: the pipeline cannot honour what the options ask (the message says
            which option to change).
    """
    recipe = None
    if not isinstance(spec.source, UnsetType):
        # the folder's recipe from its configs (a refused folder has none: admission says why)
        recipe = open_folder(spec, component_loaders(spec)).recipe
        if recipe is not None and not args.prompt:
            raise ValueError("a pipeline from a folder makes an image of each --prompt; give one")
    elif args.size is not None:
        raise ValueError(
            "--size sets the image size of a pipeline from a folder; this pipeline's image "
            "size follows its kinds' options"
        )
    makes_videos = recipe is not None and recipe.makes_videos
    video_options = ("frames", "guidance_scale_2", "image", "last_image", "video_format")
    for option in video_options:
        if getattr(args, option) is not None and not makes_videos:
            raise ValueError(
                f"--{option.replace('_', '-')} is an option of a pipeline that makes videos "
                "(a Wan folder); this pipeline makes none: drop it"
            )
    if recipe is not None and args.image is not None and not recipe.takes_images:
        raise ValueError(
            f"--image starts each video from an image, but {recipe.pipeline_class} makes "
            "videos from text alone: drop --image (or run an image-to-video folder)"
        )
    asked = RequestArgs(
        steps=args.steps or default_steps(recipe),
        guidance_scale=args.guidance_scale,
        prompts=tuple(args.prompt),
        negative_prompt=args.negative_prompt,
        seed=args.seed,
        image_size=None if args.size is None else (args.size.height, args.size.width),
        frames=args.frames,
        guidance_scale_2=args.guidance_scale_2,
        image=None if args.image is None else read_image(args.image, "--image"),
        last_image=None if args.last_image is None else read_image(args.last_image, "--last-image"),
    )
    if recipe is not None:
        recipe.check(asked.batch(0))
    return asked


def read_image(path: Path, option: str) -> Any:
    """Read the image at ``path`` as RGB (a PIL image), as diffusers' ``load_image`` does.

    Raises:
        ValueError: it cannot be read as an image (``option`` and the path named).
    """
    from PIL import Image

    try:
        with Image.open(path) as image:
            return image.convert("RGB")
    except OSError as err:  # missing, unreadable, or not an image Pillow knows
        raise ValueError(f"{option} {path}: cannot read it as an image ({err})") from None


def video_format(asked: VideoFormat | None) -> tuple[VideoFormat, str | None]:
    """Return the format videos are written in and, where it falls back to WebP, why.

    Raises:
        ValueError: MP4 was asked without the packages that write it.
    """
    if asked is None:
        return default_format()
    missing = mp4_missing()
    if asked == "mp4" and missing is not None:
        raise ValueError(
            f"--video-format mp4 needs imageio and imageio-ffmpeg, but {missing} "
            f"({VIDEO_EXTRA}); or write --video-format webp or png"
        )
    return asked, None


def _run(
    args: argparse.Namespace,
    spec: PipelineSpec,
    asked: RequestArgs,
    threads: Threads,
    stop: StopOnSignal,
    videos_as: tuple[VideoFormat, str | None],
) -> RunOutcome:
    """Load the pipeline, run the requests, close it and write the timeline: what happened."""
    spec, _ = tune(spec)  # acceleration = "auto" chooses what the spec left open
    tally = MoveTally(spec.components, keep_moves=args.timeline is not None)
    outputs = RunOutputs(video_format=videos_as[0])
    orchestrator = Orchestrator(spec, observer=tally)
    try:
        ending = _requests(args, asked, orchestrator, outputs, stop)
    finally:
        snapshot = orchestrator.snapshot()
        compilations = orchestrator.compilations()
        closing = _close(orchestrator)
    if closing is not None:
        ending = ending.failed(closing)
    report = summarise(
        snapshot,
        tally,
        outputs,
        compilations,
        steps=asked.steps,
        threads=threads,
        stopped_by=None if stop.received is None else stop.received.name,
    )
    if args.timeline is not None and ending.code is not ExitCode.REFUSED:
        try:
            moves_by_rank = launch.gather_on_main(tally.moves or [])
            if moves_by_rank is not None:
                _write_timeline(args.timeline, spec, report.requests, moves_by_rank)
        except OSError as err:  # checked before the run; something changed it since
            ending = ending.failed("writing the timeline failed: " + _describe(err))
    return RunOutcome(
        ending=ending,
        report=report,
        snapshot=snapshot,
        notes=_unused_outputs(args, spec, outputs, videos_as[1]),
    )


def _requests(
    args: argparse.Namespace,
    asked: RequestArgs,
    orchestrator: Orchestrator,
    outputs: RunOutputs,
    stop: StopOnSignal,
) -> Ending:
    """Load the pipeline and run this rank's share of the requests; say how that ended."""
    # JSON logs make stderr a stream of JSON lines: a display there would break it
    is_quiet = args.json or args.json_logs or args.log_format == "json"
    progress = run_progress(args.requests, is_quiet=is_quiet, is_main_rank=launch.is_main_rank())
    detach = orchestrator.observe(progress.observe)
    try:
        try:
            orchestrator.load()
            share = launch.replica_requests(orchestrator.parallel, args.requests)
            run_requests(
                orchestrator,
                outputs,
                requests=share,
                args=asked,
                out=args.out if launch.is_main_rank() else None,
                should_stop=stop.should_stop,
                progress=progress,
            )
        finally:
            stop.settle()  # from here on a signal is only noted: reporting and cleanup finish
            detach()
            progress.close()
    except Abandoned:
        pass  # the request in flight is given up; what completed is reported
    except TransitionRefused as refused:
        return Ending(
            code=ExitCode.REFUSED,
            refusals=refused.refusals,
            invalid=None if refused.refusals else str(refused),  # invalid from the state
        )
    except (TransitionFailed, OSError, MemoryError, RuntimeError) as err:
        return Ending().failed(_describe(err))
    return Ending()


def _close(orchestrator: Orchestrator) -> str | None:
    """Release every component; return what failed, or None."""
    try:
        orchestrator.close()
    except Exception as err:  # what completed still stands; say what was left behind
        return "closing the pipeline failed: " + _describe(err)
    return None


def _report(args: argparse.Namespace, spec: PipelineSpec, outcome: RunOutcome) -> None:
    """Print ``outcome``: what went wrong on stderr (every rank), the results on rank 0.

    A refusal is the run's result: rank 0 prints it on stdout, as ``check`` does (under
    ``--json``, in the one object), another rank on stderr.
    """
    ending = outcome.ending
    if ending.refusals:
        if not args.json:
            text = format_refusals("run", spec.name, ending.refusals, spec.components)
            print(text, file=sys.stdout if launch.is_main_rank() else sys.stderr)
    elif ending.invalid is not None:
        print(f"lifecycle run: {args.spec}: {ending.invalid}", file=sys.stderr)
    for failure in ending.failures:
        print(f"lifecycle run: {args.spec}: {failure}", file=sys.stderr)
    if not launch.is_main_rank():
        return  # rank 0 prints the results of the run
    if args.json:
        result: dict[str, object] = {"summary": outcome.report, "snapshot": outcome.snapshot}
        if ending.code is ExitCode.REFUSED:
            result["refusals"] = ending.refusals
        if ending.failures:
            result["error"] = {"message": ending.failures[-1]}
        print_json(result)
    elif ending.code is ExitCode.OK or outcome.report.requests:
        print(run_summary(outcome.report))
        for note in outcome.notes:
            print(f"lifecycle run: {note}", file=sys.stderr)


def _write_timeline(
    path: Path, spec: PipelineSpec, requests: int, moves_by_rank: Sequence[Sequence[Move]]
) -> None:
    title = f"Residency of {spec.name} over {requests} requests"
    path.write_text(residency_gantt(title, list(spec.components), moves_by_rank), encoding="utf-8")


def _unused_outputs(
    args: argparse.Namespace, spec: PipelineSpec, outputs: RunOutputs, webp_why: str | None
) -> tuple[str, ...]:
    """Say so when an output the user asked for was produced by no component, and why
    videos were written as WebP where MP4 was the default (``webp_why``).

    (A pipeline from a folder draws its prompts: nothing is unused there.)
    """
    notes = []
    from_folder = not isinstance(spec.source, UnsetType)
    if args.prompt and not outputs.sentences and not from_folder:
        notes.append(
            "no component of this pipeline embeds sentences, so no nearest neighbours are "
            "shown; the prompts are encoded as the pipeline's text"
        )
    if args.out is not None and not (outputs.images or outputs.videos) and outputs.request_ms:
        notes.append(f"no component of this pipeline makes images; {args.out} stays empty")
    if outputs.videos and webp_why is not None:
        notes.append(webp_why)
    return tuple(notes)


def _describe(err: BaseException) -> str:
    """Return what failed, in one sentence (a failed transition already names its cause)."""
    return str(err) if isinstance(err, TransitionFailed) else f"{type(err).__name__}: {err}"


def _bad_input(args: argparse.Namespace, text: str, error: dict[str, str]) -> int:
    """Say what is wrong on stderr (and as the one JSON object with ``--json``): exit 2."""
    print(f"lifecycle run: {text}", file=sys.stderr)
    if args.json:
        print_json({"error": error})
    return ExitCode.BAD_INPUT


@contextmanager
def _torch_threads(threads: int) -> Iterator[None]:
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(previous)
