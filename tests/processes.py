"""Programs that need a process of their own, forked from a server that imported torch.

A test that crashes a process, signals it, or watches what importing the project does
in a fresh interpreter needs a new process; starting ``python`` for it costs seconds
of CPU, most of them importing torch. Here multiprocessing's fork server imports torch
once (``PRELOAD``), and every program runs in a process forked from it, the way
``python -c`` or ``python -m`` runs it: none of the project's packages, structlog or
the libraries of the extras other than ``serve`` is imported yet, the exit status is the
program's (negative: the signal that ended it), and stdout and stderr are the process's
own file descriptors. xdist's workers of a whole-suite run are forked from it too
(``run_forked_python``).

What Python or torch read once at start (``PYTHONPATH``, ``OMP_NUM_THREADS``) is the
fork server's: a program takes its own ``sys.path`` entries as ``path``; a test that
varies the others starts ``python`` itself (``run_fresh_python``). The ranks of a gloo
group start here too (``fork_server``).

This module imports nothing of the project: the forked process unpickles its target
from here before the program runs.
"""

from __future__ import annotations

import atexit
import gc
import multiprocessing
import multiprocessing.forkserver
import multiprocessing.resource_tracker
import os
import runpy
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import types
import weakref
from collections.abc import Mapping, Sequence
from multiprocessing import reduction
from multiprocessing.context import ForkServerContext, ForkServerProcess
from multiprocessing.popen_forkserver import _DupFd
from pathlib import Path
from typing import NamedTuple

PRELOAD = (
    "torch",
    "torch._dynamo",
    "torch.distributed.fsdp",
    "torch.distributed.tensor.parallel",
    "rich.pretty",
    "rich.progress",
    "rich.table",
    "rich.traceback",
    "yaml",
    "fastapi",
    "uvicorn",
)
"""What the fork server imports, nothing of the project: torch; what diffusers' models and a
rank's first DTensor operation import (``torch._dynamo``, with sympy: about 1.3 CPU-s a
process, which every program that loads a pipeline folder paid); what the ranks of a
splitting layout import when they shard (FSDP, DTensor), so that no rank pays for it; the
parts of two of the project's required libraries that every program importing it loads:
rich (through structlog's console renderer, and the CLI's progress and tables) and PyYAML,
0.06 CPU-s a program; and the web stack of the ``serve`` extra, which every test worker
and ``serve`` program imports (fastapi, uvicorn: 0.18). They read nothing from the
environment as they are imported (the programs' environment is the test's), but for the
OpenTelemetry context fastapi imports (``OTEL_PYTHON_CONTEXT``, which no test sets);
structlog, which does (``NO_COLOR``), is left to the program, and so are the libraries of
the other extras (transformers and diffusers read where the Hugging Face cache is)."""

GC_THRESHOLD = 10_000
"""The first garbage-collection threshold of the test workers, programs and ranks (CPython's:
700). A process that imported torch holds half a million objects or more, and each full
collection walks them all; at 700 the short-lived objects of running a pipeline are
promoted often enough for many of them. Over a run of the suite the forked programs spent
3.2 CPU-s collecting garbage and the ranks 0.9; at 10,000, 1.4 and 0.2. Only when garbage
is collected changes, never what a program computes or prints."""


WAIT_POLICY = ("OMP_WAIT_POLICY", "PASSIVE")
"""The OpenMP wait policy the fork server starts with, where the environment sets none: a
``lifecycle`` process's (its entry point sets it before torch loads OpenMP, which reads it
once: ``lifecycle.cli.cores``). Programs run on the server's OpenMP runtime; spinning, the
waiting threads of those that compute on two threads took the core the other test worker
computes on (over the 48 programs of 17 files: 24.8 -> 23.1 CPU-s). The programs' own
environment stays the test's."""


SHARED_SERVER = "LIFECYCLE_TESTS_FORK_SERVER"
"""The environment variable that gives the processes a test run starts (xdist's workers) the
address of the fork server their parent started for them (``share_fork_server``)."""


def fork_server() -> ForkServerContext:
    """Return the fork-server context, its server started: it imports ``PRELOAD`` with
    OpenMP's ``WAIT_POLICY``; in a process started by one that shares its server
    (``SHARED_SERVER``), that server."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(list(PRELOAD))
    shared = os.environ.get(SHARED_SERVER)
    if shared is not None:
        _use_shared(bytes.fromhex(shared).decode())
        return context
    name, policy = WAIT_POLICY
    chosen = name in os.environ
    os.environ.setdefault(name, policy)  # the server starts with this process's environment
    try:
        multiprocessing.forkserver.ensure_running()
    finally:
        if not chosen:
            del os.environ[name]
    return context


def share_fork_server() -> None:
    """Start the fork server here and name it to the processes this one starts afterwards.

    xdist's controller calls it before it starts the workers: each worker would start a
    server of its own otherwise, each importing ``PRELOAD`` (about 3 CPU-s), and one
    serves them all. The server ends when this process does, after its workers.
    """
    fork_server()
    address = multiprocessing.forkserver._forkserver._forkserver_address
    os.environ[SHARED_SERVER] = address.encode().hex()  # an abstract socket's starts with NUL


def _use_shared(address: str) -> None:
    """Have multiprocessing fork this process's programs from the server at ``address``
    (``SHARED_SERVER``, decoded).

    multiprocessing keeps one server a process and knows only one it started itself:
    its address is set here, and the start (``ensure_running``) is left to the resource
    tracker each child is given. The server's end of the pipe that tells it its clients
    left is the starter's; the children get an fd that reads as nothing in its place.
    """
    server = multiprocessing.forkserver._forkserver
    if server._forkserver_address == address:
        return
    server._forkserver_address = address
    server._forkserver_alive_fd = os.open(os.devnull, os.O_RDONLY)
    server.ensure_running = multiprocessing.resource_tracker.ensure_running


class Finished(NamedTuple):
    """What a program left: its exit status (negative: killed by that signal) and output."""

    returncode: int
    stdout: str
    stderr: str


class Program:
    """A program running in a forked process, writing to files until it ends.

    Use it as a context manager: leaving the block kills the process if it still
    runs, and removes the files.
    """

    def __init__(self, process: ForkServerProcess, folder: Path) -> None:
        self.process = process
        self._folder = folder

    @property
    def pid(self) -> int:
        """Return the process id."""
        assert self.process.pid is not None
        return self.process.pid

    def send_signal(self, signum: signal.Signals) -> None:
        """Send ``signum`` to the process."""
        os.kill(self.pid, signum)

    def stderr(self) -> str:
        """Return what the program wrote to stderr so far."""
        return (self._folder / "stderr").read_text(errors="replace")

    def wait_for_line(self, text: str, timeout: float) -> str:
        """Return the first whole stderr line that holds ``text``, once it is written.

        Fails if the program ends first, or after ``timeout`` seconds.
        """
        deadline = time.monotonic() + timeout
        while True:
            written = self.stderr()
            lines = [line for line in written.splitlines(keepends=True) if text in line]
            if lines and lines[0].endswith("\n"):
                return lines[0]
            assert self.process.is_alive(), f"the program ended without {text!r}:\n{written}"
            assert time.monotonic() < deadline, f"no {text!r} within {timeout} s:\n{written}"
            time.sleep(0.05)

    def wait(self, timeout: float) -> Finished:
        """Wait for the program to end; kill it and fail after ``timeout`` seconds."""
        self.process.join(timeout)
        if self.process.exitcode is None:
            self.process.kill()
            self.process.join()
            raise AssertionError(f"the program ran past {timeout} s:\n{self.stderr()}")
        stdout = (self._folder / "stdout").read_text(errors="replace")
        return Finished(self.process.exitcode, stdout, self.stderr())

    def __enter__(self) -> Program:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.process.is_alive():
            self.process.kill()
        self.process.join()
        shutil.rmtree(self._folder, ignore_errors=True)


def start_python(
    program: str,
    *argv: str | Path,
    cwd: Path,
    module: bool = False,
    path: Sequence[Path] = (),
    terminal: str | None = None,
) -> Program:
    """Start ``python -c program *argv`` (``python -m program`` with ``module``) in ``cwd``.

    The environment is this process's, as ``subprocess`` would pass it. ``path`` goes on
    ``sys.path`` after the working directory, where ``PYTHONPATH`` would put it. With
    ``terminal`` (the path of a pseudo-terminal's secondary end, ``os.ttyname``) stderr
    is that terminal, and ``Program.stderr`` stays empty.
    """
    folder = Path(tempfile.mkdtemp(prefix="lifecycle-program-"))
    for name in ("stdout", "stderr"):
        (folder / name).touch()
    process = fork_server().Process(
        target=_run_program,
        args=(program, module, [str(arg) for arg in argv], str(cwd), dict(os.environ), folder),
        kwargs={"path": [str(entry) for entry in path], "terminal": terminal},
    )
    process.start()
    return Program(process, folder)


def run_python(
    program: str,
    *argv: str | Path,
    cwd: Path,
    module: bool = False,
    path: Sequence[Path] = (),
    timeout: float = 120,
) -> Finished:
    """Run ``python -c program *argv`` (or ``-m``) in ``cwd`` to its end; return what it left.

    ``path``: as ``start_python`` takes it.
    """
    with start_python(program, *argv, cwd=cwd, module=module, path=path) as started:
        return started.wait(timeout)


def run_fresh_python(
    *argv: str | Path, cwd: Path, env: Mapping[str, str] | None = None, timeout: float = 120
) -> Finished:
    """Run ``python *argv`` in a new interpreter, not forked; return what it left.

    For what only a fresh process shows: what importing does before torch is imported, or
    what torch's OpenMP reads from ``env`` when it starts (default: this process's).
    """
    done = subprocess.run(
        [sys.executable, *map(str, argv)],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    return Finished(done.returncode, done.stdout, done.stderr)


def run_forked_python(argv: Sequence[str]) -> int:
    """Run ``python -u -c PROGRAM`` in a process forked from the fork server, on this
    process's stdin, stdout and stderr, in its working directory and environment; return
    the exit status it ended with (128 + N: killed by signal N).

    What xdist's controller starts for each worker of a whole-suite run, in place of
    ``python`` (``tests/forked_python.py``): a worker is then born with torch imported,
    as a program is (each worker imported it itself otherwise: about 2.3 CPU-s). Whether
    it writes bytecode is the server's choice, the controller's (``-B`` and
    ``PYTHONDONTWRITEBYTECODE`` reach the server as they would reach the worker).
    """
    *flags, program = argv
    if flags != ["-u", "-c"]:
        raise SystemExit(f"forked_python runs `-u -c PROGRAM` (xdist's), not {argv}")
    # an interrupt from the terminal reaches the worker too, which is in the same group
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    process = fork_server().Process(
        target=_run_program,
        args=(program, False, [], os.getcwd(), dict(os.environ), _Stdio()),
        kwargs={"path": []},
    )
    process.start()
    process.join()
    assert process.exitcode is not None
    return process.exitcode if process.exitcode >= 0 else 128 - process.exitcode


class _Stdio:
    """This process's stdin, stdout and stderr, as the forked process is given them: a
    copy of each is sent to the fork server with the process (``DupFd``, pickled while
    ``Process.start`` launches it), which hands them to the process it forks."""

    def __reduce__(self) -> tuple[object, tuple[object, ...]]:
        return _received, tuple(reduction.DupFd(fd) for fd in (0, 1, 2))


def _received(*sent: _DupFd) -> list[int]:
    """Return the descriptors the fork server handed this process for ``_Stdio``'s."""
    return [fd.detach() for fd in sent]


def _run_program(
    program: str,
    module: bool,
    argv: list[str],
    cwd: str,
    environ: dict[str, str],
    output: Path | list[int],
    *,
    path: list[str],
    terminal: str | None = None,
) -> None:
    """Run the program as a new interpreter would, then end the process with its status.

    ``output``: the folder whose files take stdout and stderr (stdin is empty), or the
    descriptors of stdin, stdout and stderr (``_Stdio``).
    """
    if isinstance(output, Path):
        _write_to_files(output, terminal)
    else:
        _use_stdio(output)
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(environ)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # what a new interpreter has
    gc.set_threshold(GC_THRESHOLD)
    # what the fork server imported lives as long as the process: a full collection that
    # walked it (300,000 objects, 0.1 CPU-s; a test worker makes several) walks only the
    # process's own objects once they are frozen
    gc.freeze()
    # at its exit a new interpreter would finalize the objects its imports made; here the
    # fork server made them (torch's ~170 operator libraries: ~0.03 CPU-s a program), and
    # their finalizers only undo this process's memory, which os._exit drops unseen. The
    # objects the program makes, and its own exit handlers, are finalized as Python does.
    for finalizer in list(weakref.finalize._registry):
        finalizer.atexit = False
    status = 0
    # as ``python -m`` and ``-c`` do: the working directory first on the path
    sys.path[:0] = [cwd if module else "", *path]
    try:
        if module:
            sys.argv = [program, *argv]
            runpy.run_module(program, run_name="__main__", alter_sys=True)
        else:
            sys.argv = ["-c", *argv]
            main = types.ModuleType("__main__")
            sys.modules["__main__"] = main
            exec(compile(program, "<string>", "exec"), main.__dict__)
    except SystemExit as done:
        status = _exit_status(done.code)
    except BaseException as failed:
        # as the interpreter prints it: from the program's frames, not this function's
        traceback.print_exception(failed.with_traceback(failed.__traceback__.tb_next))
        status = 1
    atexit._run_exitfuncs()  # what the interpreter runs before it exits
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def _write_to_files(folder: Path, terminal: str | None) -> None:
    """Point stdout and stderr at ``folder``'s files (stderr at ``terminal`` if given)."""
    for fd, name in ((1, "stdout"), (2, "stderr")):
        if fd == 2 and terminal is not None:
            file = os.open(terminal, os.O_WRONLY | os.O_NOCTTY)
        else:
            file = os.open(folder / name, os.O_WRONLY | os.O_APPEND)
        os.dup2(file, fd)
        os.close(file)


def _use_stdio(given: list[int]) -> None:
    """Make ``given`` this process's stdin, stdout and stderr, as ``python -u`` has them:
    stdin read as text, stdout and stderr unbuffered."""
    for fd, sent in enumerate(given):
        os.dup2(sent, fd)
        os.close(sent)
    sys.stdin = open(0, encoding="utf-8", closefd=False)  # noqa: SIM115
    sys.stdout = open(1, "w", encoding="utf-8", closefd=False)  # noqa: SIM115
    sys.stdout.reconfigure(write_through=True)
    sys.stderr.reconfigure(write_through=True)


def _exit_status(code: object) -> int:
    """Return the exit status ``sys.exit(code)`` gives, printing a message as Python does."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1
