"""Start and join the processes of a parallel layout: ``lifecycle run SPEC --nproc N``.

``--nproc`` starts ``N`` workers of the same ``lifecycle run`` through
``torch.distributed.run`` (torchrun's own elastic launcher, no spawner of ours); a worker
is any ``lifecycle run`` that torchrun started (``RANK`` in its environment). Every
worker binds its rank to the log context, turns SIGTERM (torchrun stopping the group
after a peer failed) into a normal exit so its orchestrator closes and removes its
offload folder, and leaves the process group at the end. Rank 0 prints the results.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from types import FrameType
from typing import TypeVar

import structlog
import torch.distributed as dist

from components.mesh import ParallelMesh
from lifecycle.exits import ExitCode

T = TypeVar("T")
SIGTERM_EXIT = 128 + signal.SIGTERM


def rank() -> int:
    """Return this process's global rank (0 outside torchrun)."""
    return int(os.environ.get("RANK", "0"))


def local_world_size() -> int:
    """Return how many workers run on this node (1 outside torchrun)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", "1"))


def is_main_rank() -> bool:
    """Tell whether this process prints results: rank 0."""
    return rank() == 0


@contextmanager
def worker() -> Iterator[int]:
    """Run the body as this rank: rank in every log event, SIGTERM exits cleanly, group left.

    Yields the rank.
    """

    def stop(signum: int, frame: FrameType | None) -> None:
        raise SystemExit(SIGTERM_EXIT)  # unwinds: the orchestrator closes, folders go

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        with structlog.contextvars.bound_contextvars(rank=rank()):
            yield rank()
    except Exception as err:
        from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

        # torchrun's error file: the launcher reports this rank's cause by it
        ErrorHandler().record_exception(err)
        raise
    finally:
        signal.signal(signal.SIGTERM, previous)
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()


def gather_on_main(value: T) -> list[T] | None:
    """Return every rank's ``value`` on rank 0, None on the others; ``[value]`` in one process."""
    if not (dist.is_available() and dist.is_initialized()):
        return [value]
    gathered: list[T] | None = [value] * dist.get_world_size() if is_main_rank() else None
    dist.gather_object(value, gathered, dst=0)
    return gathered


def replica_requests(mesh: ParallelMesh | None, requests: int) -> range:
    """Return the request indices this rank's data-parallel replica runs (all without dp)."""
    if mesh is None:
        return range(requests)
    return range(mesh.local_rank("dp"), requests, mesh.size("dp"))


def worker_argv(args: argparse.Namespace) -> list[str]:
    """Return the ``lifecycle`` arguments each worker runs: this command without ``--nproc``."""
    argv = ["--log-format", args.log_format, "--log-level", args.log_level, "run", str(args.spec)]
    argv += ["--requests", str(args.requests), "--seed", str(args.seed)]
    for prompt in args.prompt:
        argv += ["--prompt", prompt]
    for flag in ("json", "json_logs"):
        if getattr(args, flag):
            argv.append("--" + flag.replace("_", "-"))
    options = ("steps", "size", "threads", "out", "timeline", "guidance_scale", "negative_prompt")
    for option in options:
        if (value := getattr(args, option)) is not None:
            argv += ["--" + option.replace("_", "-"), str(value)]
    return argv


def spawn(nproc: int, argv: Sequence[str]) -> ExitCode:
    """Run ``lifecycle <argv>`` on ``nproc`` local workers through ``torch.distributed.run``.

    Returns OK when every worker succeeded; else the common exit code of the workers
    that failed on their own (REFUSED, BAD_INPUT) when they agree, else FAILED, after
    naming each failed rank and its cause on stderr. torchrun stops the other workers
    as soon as one fails.
    """
    # imported here, as ErrorHandler in ``worker``: torchrun's launcher (~30 ms of imports)
    # is needed by this parent only, never by a worker or a single-process run
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args
    from torch.distributed.run import run as torchrun

    # torch leaves parse_args and run unannotated
    config = parse_args(  # type: ignore[no-untyped-call]
        [
            "--standalone",
            "--nproc-per-node",
            str(nproc),
            "--max-restarts",
            "0",
            "--monitor-interval",
            "0.2",
            "-m",
            "lifecycle",
            *argv,
        ]
    )
    try:
        torchrun(config)  # type: ignore[no-untyped-call]
    except ChildFailedError as failed:
        # ranks torchrun stopped itself (SIGTERM) after a peer failed say nothing of the cause
        stopped = (-signal.SIGTERM, SIGTERM_EXIT)
        codes = {f.exitcode for f in failed.failures.values() if f.exitcode not in stopped}
        for failed_rank, failure in sorted(failed.failures.items()):
            cause = (
                f"killed by signal {-failure.exitcode}"
                if failure.exitcode < 0
                else f"exit code {failure.exitcode}"
            )
            if failure.message and failure.message != "<N/A>":
                cause += f": {failure.message}"
            print(f"lifecycle run: rank {failed_rank} failed: {cause}", file=sys.stderr)
        if len(codes) == 1 and (code := codes.pop()) in (ExitCode.REFUSED, ExitCode.BAD_INPUT):
            return ExitCode(code)
        return ExitCode.FAILED
    return ExitCode.OK
