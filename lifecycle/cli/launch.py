"""Start and join the processes of a parallel layout: ``lifecycle run SPEC --nproc N``.

``--nproc`` starts ``N`` workers of the same ``lifecycle run`` through torch's elastic
launcher (torchrun's own agent, no spawner of ours); a worker is any ``lifecycle run``
that torchrun started (``RANK`` in its environment). The launcher forks its workers, as
vLLM does: a worker starts with torch and the project already imported, instead of
paying seconds of CPU for a new interpreter that imports them again. Once CUDA is
initialized in the launching process the workers are spawned instead (a forked child
cannot use CUDA). The workers meet on torchrun's static rendezvous, at a store the
launching process listens on (a free port of 127.0.0.1). ``torchrun -m lifecycle run
SPEC`` starts new interpreters, as it always does; they run the same ``main``.

Every worker binds its rank to the log context, turns SIGTERM (the launcher stopping
the group after a peer failed) into a normal exit so its orchestrator closes and
removes its offload folder, and leaves the process group at the end. Rank 0 prints the
results. An exception nothing caught is a failure while running (exit 3): its cause is
one line, its traceback goes to the logs (``run.crashed``), never to the terminal.
"""

from __future__ import annotations

import argparse
import ctypes
import logging
import os
import signal
import sys
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from types import FrameType
from typing import TYPE_CHECKING, Literal, TypeAlias, TypeVar

import structlog
import torch
import torch.distributed as dist

from components.mesh import ParallelMesh
from lifecycle.cli.exits import ExitCode
from lifecycle.logs import get_logger

if TYPE_CHECKING:
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

__all__ = [
    "CRASHED",
    "crashed",
    "gather_on_main",
    "is_main_rank",
    "local_world_size",
    "replica_requests",
    "spawn",
    "worker",
    "worker_argv",
]

T = TypeVar("T")
SIGTERM_EXIT = 128 + signal.SIGTERM
OMP_PAUSE_SOFT = 1
"""``omp_pause_soft`` of OpenMP 5.0's ``omp_pause_resource_t``."""

CRASHED = "run.crashed"
"""The event of an exception nothing caught in a run, carrying its traceback."""

ERROR_FILE = "TORCHELASTIC_ERROR_FILE"
"""Where torchrun's launcher asks its worker to record why it failed."""

log = get_logger("lifecycle")

LOCALHOST = "127.0.0.1"
"""Where the launcher's rendezvous listens: its workers are on this host."""

JOIN_LOGGER = "torch.distributed.elastic.multiprocessing.api"
"""The logger of torch's launcher that reports a worker's exit."""

StartMethod: TypeAlias = Literal["fork", "spawn"]
"""How the launcher starts a worker: a fork of itself, or a new interpreter."""


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
    finally:
        signal.signal(signal.SIGTERM, previous)
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()


def crashed(err: Exception) -> ExitCode:
    """Report an exception the run did not catch (a bug met while running): FAILED.

    Its traceback goes to the logs (``run.crashed``); its cause is one line, which
    torchrun's launcher prints for its worker (from the error file it named) and this
    process otherwise.
    """
    cause = f"{type(err).__name__}: {err}"
    log.error(CRASHED, cause=cause, exc_info=err)
    if ERROR_FILE in os.environ:
        from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

        ErrorHandler().record_exception(err)
    else:
        print(f"lifecycle run: failed: {cause}", file=sys.stderr)
    return ExitCode.FAILED


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
    for flag in ("json", "json_logs", "download"):
        if getattr(args, flag):
            argv.append("--" + flag.replace("_", "-"))
    options = (
        "steps",
        "size",
        "threads",
        "out",
        "timeline",
        "guidance_scale",
        "negative_prompt",
        "frames",
        "guidance_scale_2",
        "image",
        "last_image",
        "video_format",
    )
    for option in options:
        if (value := getattr(args, option)) is not None:
            argv += ["--" + option.replace("_", "-"), str(value)]
    return argv


def start_method(is_cuda_initialized: bool) -> StartMethod:
    """Return how the launcher starts its workers: forked, or spawned once CUDA is initialized.

    A forked child inherits the parent's CUDA context without the driver threads behind
    it, and its first CUDA call fails; a spawned worker is a new interpreter, seconds
    slower to start, that initializes CUDA itself.
    """
    return "spawn" if is_cuda_initialized else "fork"


def release_openmp_threads() -> None:
    """End the OpenMP threads this thread started, so that a fork of it inherits none.

    GNU OpenMP (torch's on Linux) keeps its threads after a parallel region and mends
    nothing in a forked child: the child inherits the pool without its threads, and its
    first parallel region waits for them forever. OpenMP 5.0's ``omp_pause_resource_all``
    ends them; this process's next parallel region starts them again. The ``lifecycle``
    command has computed nothing when it launches, but an in-process caller of ``main``
    may have. Without an OpenMP runtime in the process's global symbols there is none
    to release.
    """
    pause = getattr(ctypes.CDLL(None), "omp_pause_resource_all", None)
    if pause is not None:
        pause(OMP_PAUSE_SOFT)


def run_worker(argv: list[str]) -> None:
    """Run ``lifecycle <argv>`` as one worker of the launcher; exit with its code.

    torch's launcher calls it in each worker: returning is success, ``SystemExit`` with
    another code is this rank's failure, which the launcher reports to ``spawn``.
    """
    from lifecycle.cli.main import main  # here: lifecycle.cli.main imports this module

    # a fork brings the launcher's handlers (SIGTERM there stops every worker): start
    # from a new interpreter's, as a worker that torchrun starts does
    for number in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
        signal.signal(number, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        code = main(argv)
    except KeyboardInterrupt:
        # torch's wrapper would end the process with 0 and no result, a success the
        # launcher waits on forever; a new interpreter would have died of the signal
        code = 128 + signal.SIGINT
    if code != ExitCode.OK:
        raise SystemExit(code)


@contextmanager
def _without_stacks() -> Iterator[None]:
    """Keep the lines torch's launcher logs about a failed worker, without stack traces.

    torch logs a worker that exited with a code other than 0 as an exception raised in
    its own join; ``spawn`` names the rank and its cause instead, never a stack trace.
    """
    logger = logging.getLogger(JOIN_LOGGER)
    logger.addFilter(_strip_stack)
    try:
        yield
    finally:
        logger.removeFilter(_strip_stack)


def _strip_stack(record: logging.LogRecord) -> bool:
    record.exc_info = None
    return True


def spawn(nproc: int, argv: Sequence[str]) -> int:
    """Run ``lifecycle <argv>`` on ``nproc`` local workers through torch's elastic launcher.

    The workers are forked from this process (spawned once CUDA is initialized here,
    ``start_method``). Returns OK when every worker succeeded; else the exit code of the
    worker that failed first when it failed on its own (REFUSED, BAD_INPUT), else FAILED,
    after naming each rank and its cause on stderr. The launcher stops the other workers
    as soon as one fails. SIGINT or SIGTERM to this process stops the workers too (the
    launcher passes the signal on, and kills a worker that outlives its timeout): the
    shell's code for the signal (130, 143), with no traceback.
    """
    # imported here, as ErrorHandler in ``crashed``: torchrun's launcher (~30 ms of imports)
    # is needed by this parent only, never by a worker or a single-process run
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch
    from torch.distributed.run import config_from_args, parse_args

    # torch leaves is_initialized and parse_args unannotated
    method = start_method(torch.cuda.is_initialized())  # type: ignore[no-untyped-call]
    # the rendezvous is torchrun's static one, on a store this process listens on until
    # the launch ends: the kernel picked its free port, and the rendezvous's own store on
    # that port is this server (multi_tenant), so no other process can take the port.
    # --standalone's c10d rendezvous (torchrun's when it has no port) records each of its
    # steps with inspect.stack(), which looks up every frame's module among all those
    # loaded: a fifth to half a CPU-second a launch in a process with many modules.
    # (torch.distributed exports TCPStore without declaring it for type checkers)
    server = dist.TCPStore(  # type: ignore[attr-defined]
        LOCALHOST, 0, is_master=True, wait_for_workers=False, multi_tenant=True
    )
    options = parse_args(  # type: ignore[no-untyped-call]
        [
            *("--rdzv-backend", "static", "--rdzv-endpoint", f"{LOCALHOST}:{server.port}"),
            *("--rdzv-id", str(uuid.uuid4())),
            *("--nproc-per-node", str(nproc), "--max-restarts", "0"),
            *("--monitor-interval", "0.2", "--start-method", method),
            # the program torchrun would start; the workers call ``run_worker`` instead
            *("-m", "lifecycle"),
        ]
    )
    config, _, _ = config_from_args(options)
    if method == "fork":
        # multiprocessing flushes sys.stdout and sys.stderr before each fork, so no
        # line still in a buffer here is written again by a worker
        release_openmp_threads()
    try:
        with _without_stacks():
            elastic_launch(config, run_worker)(list(argv))
    except SignalException as stopped:
        # the launcher has passed the signal on to the workers and waited for them
        return 128 + int(stopped.sigval)
    except ChildFailedError as failed:
        for failed_rank, failure in sorted(failed.failures.items()):
            print(f"lifecycle run: rank {failed_rank} failed: {_cause(failure)}", file=sys.stderr)
        # the launcher reports the rank that failed first, then stops the others
        first = ", ".join(str(failed_rank) for failed_rank in sorted(failed.failures))
        for stopped_rank in sorted(set(range(nproc)) - set(failed.failures)):
            print(
                f"lifecycle run: rank {stopped_rank} failed: stopped when rank {first} failed",
                file=sys.stderr,
            )
        codes = {failure.exitcode for failure in failed.failures.values()}
        if len(codes) == 1 and (code := codes.pop()) in (ExitCode.REFUSED, ExitCode.BAD_INPUT):
            return ExitCode(code)
        return ExitCode.FAILED
    return ExitCode.OK


def _cause(failure: ProcessFailure) -> str:
    """Say in one line why a worker failed: its exit, and the cause its error file names.

    ``crashed`` records a worker's uncaught exception in torchrun's error file: its
    message, and beside it the traceback, which stays out of this line.
    """
    if failure.exitcode < 0:
        return f"killed by signal {-failure.exitcode}"
    recorded = failure.error_file_data.get("message")
    if isinstance(recorded, dict) and recorded.get("message"):
        return f"exit code {failure.exitcode}: {recorded['message']}"
    return f"exit code {failure.exitcode}"
