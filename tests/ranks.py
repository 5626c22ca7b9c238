"""Start the ranks of a gloo process group as processes of their own, and wait for them."""

from __future__ import annotations

import importlib
import json
import multiprocessing
import os
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from datetime import timedelta
from multiprocessing.connection import wait
from pathlib import Path

import torch
import torch.distributed as dist

from tests.processes import fork_server

DIFFUSERS_MODELS = (
    "diffusers.models.modeling_utils",
    "diffusers.models.transformers",
    "diffusers.models.autoencoders",
)
"""What ranks that load a pipeline folder's classes import: about 3 CPU-s a process."""

LAUNCHER_SLACK_S = 60.0
"""How much longer than the ranks' deadline the launcher may take to stop them and report."""


def run_ranks(
    target: Callable[..., None],
    world: int,
    folder: Path,
    *args: object,
    deadline_s: float,
    preload: Sequence[str] = (),
) -> list[int | None]:
    """Run ``target(rank, world, init_file, *args)`` on ``world`` new processes.

    One launcher process, forked from the fork server (which has imported torch), imports
    ``target``'s module and the modules named in ``preload``, then forks the ranks: what
    every rank imports is imported once. Each rank computes on one thread, as torchrun's
    workers do (``OMP_NUM_THREADS=1``). The ranks meet through a file under ``folder``
    (no TCP port that another test could take first). A rank that fails leaves its peers
    blocked in a collective, so the first failure, or the deadline, stops every rank
    still running. Returns each rank's exit code (None: it was still running at the
    deadline).
    """
    exits_file = folder / "exits.json"
    launcher = fork_server().Process(
        target=_launch,
        args=(
            target,
            world,
            str(folder / "rendezvous"),
            args,
            tuple(preload),
            deadline_s,
            exits_file,
        ),
    )
    launcher.start()
    launcher.join(deadline_s + LAUNCHER_SLACK_S)
    if launcher.exitcode is None:
        launcher.kill()
        launcher.join()
    assert launcher.exitcode == 0, f"the ranks' launcher ended with {launcher.exitcode}"
    exits: list[int | None] = json.loads(exits_file.read_text())
    return exits


def _launch(
    target: Callable[..., None],
    world: int,
    init_file: str,
    args: tuple[object, ...],
    preload: tuple[str, ...],
    deadline_s: float,
    exits_file: Path,
) -> None:
    """Fork the ranks from this process, wait for them, and write their exit codes.

    Forking is safe here: nothing has started a thread or run a torch operation yet.
    """
    for name in preload:
        importlib.import_module(name)
    context = multiprocessing.get_context("fork")
    processes = [
        context.Process(target=_rank, args=(target, rank, world, init_file, *args))
        for rank in range(world)
    ]
    for process in processes:
        process.start()
    deadline = time.monotonic() + deadline_s
    try:
        running = list(processes)
        while running and time.monotonic() < deadline:
            wait([p.sentinel for p in running], timeout=max(0.0, deadline - time.monotonic()))
            running = [p for p in running if p.exitcode is None]
            if any(p.exitcode for p in processes):
                break
        exits = [p.exitcode for p in processes]
    finally:
        for process in processes:
            if process.is_alive():
                process.terminate()
            process.join()
    exits_file.write_text(json.dumps(exits))


def _rank(target: Callable[..., None], *args: object) -> None:
    torch.set_num_threads(1)
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
