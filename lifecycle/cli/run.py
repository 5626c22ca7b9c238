"""``lifecycle run``: serve N requests of a pipeline and print what they did.

Everything that can be checked before work starts is (the spec, that each
kind can run a request, the output paths), so a run never fails at its end.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import msgspec
import torch

from lifecycle.cli import launch
from lifecycle.cli.console import format_refusals, run_summary
from lifecycle.cli.cores import physical_cores
from lifecycle.cli.paths import OutputPathError, prepare_file, prepare_folder
from lifecycle.cli.runner import (
    MoveTally,
    RunOutputs,
    run_requests,
    summarise,
    unrunnable_components,
)
from lifecycle.cli.signals import Abandoned, StopOnSignal
from lifecycle.config import ConfigError, PipelineSpec, load_spec
from lifecycle.events import Move
from lifecycle.exits import ExitCode
from lifecycle.gantt import residency_gantt
from lifecycle.orchestrator import Orchestrator
from lifecycle.refusals import TransitionFailed, TransitionRefused


def run_command(args: argparse.Namespace) -> int:
    """Run ``args.requests`` requests of the spec at ``args.spec``; return the exit code.

    With ``--nproc N`` start N workers of this same command through torchrun instead;
    a worker (any ``lifecycle run`` torchrun started) runs its replica's share.
    """
    if args.nproc is not None:
        return launch.spawn(args.nproc, launch.worker_argv(args))
    with launch.worker():
        return _run_here(args)


def _run_here(args: argparse.Namespace) -> int:
    try:
        spec = load_spec(args.spec)
    except ConfigError as err:
        return _bad_input(args, f"{args.spec}: {err}", {"path": err.path, "message": err.message})
    problems = unrunnable_components(spec)
    if problems:
        text = "; ".join(problems)
        return _bad_input(args, f"{args.spec}: {text}", {"message": text})
    try:
        if args.timeline is not None:
            prepare_file(args.timeline, "the timeline")
        if args.out is not None:
            prepare_folder(args.out, "the output folder")
    except OutputPathError as err:
        return _bad_input(args, f"{args.spec}: {err}", {"message": str(err)})
    # the workers of one node share its cores
    threads = args.threads or max(1, physical_cores() // launch.local_world_size())
    with _torch_threads(threads), StopOnSignal() as stop:
        code = _serve(args, spec, threads, stop)
        return stop.exit_code or code


def _serve(args: argparse.Namespace, spec: PipelineSpec, threads: int, stop: StopOnSignal) -> int:
    tally = MoveTally(spec.components, keep_moves=args.timeline is not None)
    outputs = RunOutputs()
    orchestrator = Orchestrator(spec, observer=tally)
    result: dict[str, object] = {}
    code = ExitCode.OK
    try:
        try:
            orchestrator.load()
            share = launch.replica_requests(orchestrator.parallel, args.requests)
            run_requests(
                orchestrator,
                outputs,
                requests=share,
                steps=args.steps,
                guidance_scale=args.guidance_scale,
                prompts=args.prompt,
                negative_prompt=args.negative_prompt,
                out=args.out if launch.is_main_rank() else None,
                should_stop=stop.should_stop,
                on_request=_Progress(len(share)),
            )
        finally:
            stop.settle()  # from here on a signal is only noted: reporting and cleanup finish
    except Abandoned:
        pass  # the request in flight is given up; what completed is reported below
    except TransitionRefused as refused:
        text = (
            format_refusals("run", spec.name, refused.refusals, spec.components)
            if refused.refusals
            else f"lifecycle run: {args.spec}: {refused}"  # a trigger invalid from the state
        )
        print(text, file=sys.stderr)
        result["refusals"] = refused.refusals
        code = ExitCode.REFUSED
    except (TransitionFailed, OSError, MemoryError, RuntimeError) as err:
        result["error"] = {"message": _failed(args, err)}
        code = ExitCode.FAILED
    finally:
        snapshot = orchestrator.snapshot()
        try:
            orchestrator.close()
        except Exception as err:  # what completed still stands; say what was left behind
            result["error"] = {"message": _failed(args, err, "closing the pipeline failed: ")}
            code = code or ExitCode.FAILED
    report = summarise(
        snapshot,
        tally,
        outputs,
        steps=args.steps,
        threads=threads,
        stopped_by=None if stop.received is None else stop.received.name,
    )
    if args.timeline is not None and code is not ExitCode.REFUSED:
        try:
            moves_by_rank = launch.gather_on_main(tally.moves or [])
            if moves_by_rank is not None:
                _write_timeline(args.timeline, spec, report.requests, moves_by_rank)
        except OSError as err:  # checked before the run; something changed it since
            result["error"] = {"message": _failed(args, err, "writing the timeline failed: ")}
            code = code or ExitCode.FAILED
    if not launch.is_main_rank():
        pass  # rank 0 prints the results of the run
    elif args.json:
        _print_json({"summary": report, "snapshot": snapshot, **result})
    elif code is ExitCode.OK or report.requests:
        print(run_summary(report))
        _note_unused(args, outputs)
    return code


def _write_timeline(
    path: Path, spec: PipelineSpec, requests: int, moves_by_rank: Sequence[Sequence[Move]]
) -> None:
    title = f"Residency of {spec.name} over {requests} requests"
    path.write_text(residency_gantt(title, list(spec.components), moves_by_rank), encoding="utf-8")


def _note_unused(args: argparse.Namespace, outputs: RunOutputs) -> None:
    """Say so when an output the user asked for was produced by no component."""
    if args.prompt and not outputs.sentences:
        print(
            "lifecycle run: no component of this pipeline embeds sentences, so no nearest "
            "neighbours are shown; the prompts are encoded as the pipeline's text",
            file=sys.stderr,
        )
    if args.out is not None and not outputs.images and outputs.request_ms:
        print(
            f"lifecycle run: no component of this pipeline makes images; {args.out} stays empty",
            file=sys.stderr,
        )


def _failed(args: argparse.Namespace, err: BaseException, prefix: str = "") -> str:
    """Say on stderr what failed while running, and return the sentence."""
    text = prefix + (
        str(err) if isinstance(err, TransitionFailed) else f"{type(err).__name__}: {err}"
    )
    print(f"lifecycle run: {args.spec}: {text}", file=sys.stderr)
    return text


def _bad_input(args: argparse.Namespace, text: str, error: dict[str, str]) -> int:
    """Say what is wrong on stderr (and as the one JSON object with ``--json``): exit 2."""
    print(f"lifecycle run: {text}", file=sys.stderr)
    if args.json:
        _print_json({"error": error})
    return ExitCode.BAD_INPUT


@contextmanager
def _torch_threads(threads: int) -> Iterator[None]:
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


class _Progress:
    """A progress bar on stderr when it is a terminal; silent otherwise."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.shown = sys.stderr.isatty()

    def __call__(self, done: int) -> None:
        if self.shown:
            filled = 30 * done // self.total
            bar = "#" * filled + "." * (30 - filled)
            end = "\n" if done == self.total else ""
            print(f"\r[{bar}] {done}/{self.total} requests", end=end, file=sys.stderr)


def _print_json(value: object) -> None:
    sys.stdout.write(msgspec.json.encode(value).decode() + "\n")
