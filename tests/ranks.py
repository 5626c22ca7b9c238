"""Start the ranks of a gloo process group as processes of their own, and wait for them."""

from __future__ import annotations

import atexit
import gc
import importlib
import multiprocessing
import os
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from multiprocessing.context import ForkServerProcess
from pathlib import Path

import torch
import torch.distributed as dist

from tests.processes import GC_THRESHOLD, fork_server

TOKENIZERS = ("transformers.tokenization_utils_tokenizers",)
"""What ranks that tokenise with a pipeline folder's tokenizer import (transformers' fast
tokenizers, the tokenizers library): about 0.6 CPU-s a process. The folders' DiTs and
encoders load through their custom path, which imports neither diffusers nor a model class
of transformers."""

LAUNCHER_SLACK_S = 60.0
"""How much longer than its deadline the launcher may take to start, stop the ranks, report."""


def run_ranks(
    target: Callable[..., None],
    world: int,
    folder: Path,
    *args: object,
    deadline_s: float,
    preload: Sequence[str] = (),
) -> list[int | None]:
    """Run ``target(rank, world, init_file, *args)`` on ``world`` new processes.

    The ranks fork from one launcher process, forked once per test process from the fork
    server (which has imported torch) and kept for every later spawn: it imports
    ``target``'s module and the modules named in ``preload`` (those of earlier spawns
    stay imported), then forks the ranks, so what every rank imports is imported once.
    Each rank computes on one thread, as torchrun's workers do (``OMP_NUM_THREADS=1``).
    The ranks meet through a file under ``folder`` (no TCP port that another test could
    take first). A rank that fails leaves its peers blocked in a collective, so the
    first failure, or the deadline (``deadline_s`` after the launcher takes the spawn,
    its imports included), stops every rank still running. Returns each rank's exit code
    (None: it was still running at the deadline).
    """
    launcher, connection = _launcher()
    connection.send((target, world, str(folder / "rendezvous"), args, tuple(preload), deadline_s))
    if not connection.poll(deadline_s + LAUNCHER_SLACK_S):
        _stop_launcher()
        raise AssertionError(f"the ranks' launcher did not report within {deadline_s} s")
    try:
        exits: list[int | None] = connection.recv()
    except (EOFError, ConnectionResetError):  # it ended without replying
        _stop_launcher()
        raise AssertionError(f"the ranks' launcher ended with {launcher.exitcode}") from None
    return exits


_started: list[tuple[ForkServerProcess, Connection]] = []
"""The launcher of this process's spawns and the parent's end of its pipe, once started."""


def _launcher() -> tuple[ForkServerProcess, Connection]:
    """Return the running launcher, starting it on the first spawn."""
    if not _started:
        context = fork_server()
        connection, launcher_end = context.Pipe()
        launcher = context.Process(target=_serve, args=(launcher_end,))
        launcher.start()
        launcher_end.close()  # only the launcher holds its end now: its exit reads as EOF
        _started.append((launcher, connection))
    return _started[0]


def _stop_launcher() -> None:
    """Close the launcher's pipe (it ends when it reads the end) and wait for it to end."""
    if _started:
        launcher, connection = _started.pop()
        connection.close()
        launcher.join(LAUNCHER_SLACK_S)
        if launcher.exitcode is None:
            launcher.kill()
            launcher.join()


# at exit, before multiprocessing's own hook (registered when it was imported) joins it
atexit.register(_stop_launcher)


def _serve(connection: Connection) -> None:
    """Launch each spawn the parent sends, reply with its ranks' exit codes; end at EOF.

    Unpickling a spawn imports its target's module here, once for all spawns.
    """
    while True:
        try:
            spawn = connection.recv()
        except EOFError:
            return
        connection.send(_launch(connection, *spawn))


def _launch(
    connection: Connection,
    target: Callable[..., None],
    world: int,
    init_file: str,
    args: tuple[object, ...],
    preload: tuple[str, ...],
    deadline_s: float,
) -> list[int | None]:
    """Fork the ranks from this process, wait for them, and return their exit codes.

    Forking is safe here: this process never starts a thread or runs a torch operation.
    The deadline counts from here, imports included.
    """
    deadline = time.monotonic() + deadline_s
    for name in preload:
        importlib.import_module(name)
    context = multiprocessing.get_context("fork")
    processes = [
        context.Process(target=_rank, args=(connection, target, rank, world, init_file, *args))
        for rank in range(world)
    ]
    for process in processes:
        process.start()
    try:
        running = list(processes)
        while running and time.monotonic() < deadline:
            wait([p.sentinel for p in running], timeout=max(0.0, deadline - time.monotonic()))
            running = [p for p in running if p.exitcode is None]
            if any(p.exitcode for p in processes):
                break
        return [p.exitcode for p in processes]
    finally:
        for process in processes:
            if process.is_alive():
                process.terminate()
            process.join()


def _rank(launcher_end: Connection, target: Callable[..., None], *args: object) -> None:
    launcher_end.close()  # the parent reads EOF when the launcher ends, whatever ranks run
    torch.set_num_threads(1)
    gc.set_threshold(GC_THRESHOLD)
    target(*args)


@contextmanager
def joined(rank: int, world: int, init_file: str) -> Iterator[None]:
    """Join the gloo group through ``init_file`` as ``rank`` of ``world``; leave it at the end.

    The rank variables torchrun would set are set first (the lifecycle reads them).
    """
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world)
    )
    dist.init_process_group(
        "gloo",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=30),  # a mismatched collective fails instead of hanging
    )
    try:
        yield
    finally:
        dist.destroy_process_group()
