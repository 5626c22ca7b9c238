"""Start the ranks of a gloo process group as processes of their own, and wait for them."""

from __future__ import annotations

import time
from collections.abc import Callable
from multiprocessing.connection import wait
from pathlib import Path

import torch

from tests.processes import fork_server


def run_ranks(
    target: Callable[..., None], world: int, folder: Path, *args: object, deadline_s: float
) -> list[int | None]:
    """Run ``target(rank, world, init_file, *args)`` on ``world`` new processes.

    Each is forked from the fork server, which has imported torch, and computes on one
    thread, as torchrun's workers do (``OMP_NUM_THREADS=1``). The ranks meet
    through a file under ``folder`` (no TCP port that another test could take first).
    A rank that fails leaves its peers blocked in a collective, so the first failure,
    or the deadline, stops every rank still running. Returns each rank's exit code
    (None: it was still running at the deadline).
    """
    context = fork_server()
    init_file = str(folder / "rendezvous")
    processes = [
        context.Process(target=_rank, args=(target, rank, world, init_file, *args))
        for rank in range(world)
    ]
    for process in processes:
        process.start()
    deadline = time.monotonic() + deadline_s
    exits: list[int | None] = [None] * world
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
    return exits


def _rank(target: Callable[..., None], *args: object) -> None:
    torch.set_num_threads(1)
    target(*args)
