"""Requests from many threads under a memory budget against the same requests one at a time.

``examples/tiny_t2i.toml`` (text encoder, DiT, VAE; the encoder and the VAE offloaded
between uses) under a ``memory.device_budget`` that holds its two largest components
at once, so that any two fit and never three (issue 30, item 14b). Each round runs, in
an order rotated every round:

- ``T`` threads, each running ``REQUESTS`` requests through every stage, one after
  another, on one orchestrator (``T`` = 4 and 16);
- the same ``T * REQUESTS`` requests one after another on one thread, on an
  orchestrator of its own;

each without a budget too, the control: what threads cost where nothing waits for memory;
and under the budget with the disk offload target, where every move reads or writes a
file, so that moves cost time on a CPU too (the host target's are pointer swaps there).

Request ``i`` draws from seed ``i`` wherever it runs; every image of the threaded run is
compared with the sequential one (``torch.equal``). The table gives the throughput of
the threaded run over the sequential one (median and range over rounds), the memory
waits per run (``MemoryWait`` events), and the moves (``Move`` events, onloads and
offloads) and bytes moved per request, with the sequential run's beside them.

Threads: torch's intra-op thread count is pinned once for the process before anything
runs (``benchmarks._environment.pin_threads``: ``BENCH_THREADS``, 1 by default), and
torch applies it in every thread, so each request thread computes on one intra-op
thread and the sequential run on the same one: the ratio is the budget's and the
threads' own, not the CLI's default thread policy.

Run: ``python -m benchmarks contention``.
"""

from __future__ import annotations

import statistics
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import torch

from benchmarks._environment import announce
from components.batch import Batch
from lifecycle.events import Event, MemoryWait, Move
from lifecycle.orchestrator import Orchestrator
from lifecycle.spec.reading import load_spec
from lifecycle.spec.structs import PipelineSpec

SPEC = Path(__file__).resolve().parents[1] / "examples" / "tiny_t2i.toml"
THREADS = (4, 16)
REQUESTS = 20
"""Requests each thread runs."""
STEPS = 8
ROUNDS = 3
STAGES = ("encode", "denoise", "decode")


@dataclass
class Tally:
    """What one run's observer saw: memory waits, moves and bytes moved (from any thread)."""

    waits: int = 0
    moves: int = 0
    moved: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def __call__(self, event: Event) -> None:
        if isinstance(event, MemoryWait):
            with self.lock:
                self.waits += 1
        elif isinstance(event, Move):
            with self.lock:
                self.moves += 1
                self.moved += event.bytes


@dataclass(frozen=True)
class Run:
    """One timed run: its seconds, its images by request index, and its tally."""

    seconds: float
    images: dict[int, torch.Tensor]
    tally: Tally


def budgeted_spec() -> PipelineSpec:
    """Return tiny-t2i under a budget of its two largest components (measured once)."""
    spec = load_spec(SPEC)
    with Orchestrator(spec) as orch:
        orch.load()
        sizes = sorted(orch.component(name).footprint for name in spec.components)
    memory = msgspec.structs.replace(spec.memory, device_budget=sum(sizes[-2:]))
    return msgspec.structs.replace(spec, memory=memory)


def run(spec: PipelineSpec, threads: int, requests: int) -> Run:
    """Run ``requests`` requests on ``threads`` threads (1: one after another); time them."""
    tally = Tally()
    images: dict[int, torch.Tensor] = {}
    errors: list[BaseException] = []
    with Orchestrator(spec, observer=tally) as orch:
        orch.load()

        def worker(indices: range) -> None:
            try:
                for index in indices:
                    batch = Batch(generator=torch.Generator().manual_seed(index), steps=STEPS)
                    with orch.request(f"r{index}") as request:
                        for stage in STAGES:
                            request.run(stage, batch)
                    images[index] = batch.images
            except BaseException as err:  # re-raised below, in the main thread
                errors.append(err)

        each = requests // threads
        workers = [
            threading.Thread(target=worker, args=(range(t * each, (t + 1) * each),))
            for t in range(threads)
        ]
        start = time.perf_counter()
        for thread in workers:
            thread.start()
        for thread in workers:
            thread.join()
        seconds = time.perf_counter() - start
    if errors:
        raise errors[0]
    return Run(seconds, images, tally)


def main() -> None:
    """Print the table: threaded over sequential throughput, waits, moves, bytes moved."""
    with tempfile.TemporaryDirectory(prefix="contention-") as folder:
        budgeted = budgeted_spec()
        on_disk = msgspec.structs.replace(
            budgeted.memory, offload_target="disk", offload_dir=folder
        )
        limit = f"{budgeted.memory.device_budget:,} bytes"
        measure(
            {
                "none": load_spec(SPEC),
                f"{limit}, host": budgeted,
                f"{limit}, disk": msgspec.structs.replace(budgeted, memory=on_disk),
            }
        )


def measure(specs: dict[str, PipelineSpec]) -> None:
    """Run every spec of ``specs`` (by the budget's name) in interleaved rounds; print."""
    modes = [
        (budget, count, threads) for budget in specs for count in THREADS for threads in (count, 1)
    ]
    runs: dict[tuple[str, int, int], list[Run]] = {mode: [] for mode in modes}
    for round_ in range(ROUNDS + 1):
        shift = round_ % len(modes)
        for budget, count, threads in modes[shift:] + modes[:shift]:
            result = run(specs[budget], threads, count * REQUESTS)
            if round_:  # round 0 warms the allocator and the kernels
                runs[budget, count, threads].append(result)
    print(
        f"### {REQUESTS} requests a thread, {STEPS} steps, tiny-t2i without a budget and "
        f"under one of its two largest components (host, disk offload); {ROUNDS} interleaved "
        "rounds"
    )
    print()
    print(
        "| budget | threads | throughput vs one at a time (median, range) | memory waits a run "
        "| moves a request (one at a time) | bytes moved a request (one at a time) "
        "| images equal |"
    )
    print("|---|---:|---:|---:|---:|---:|---|")
    for budget, count, threads in modes:
        if threads == 1:
            continue
        threaded, alone = runs[budget, count, count], runs[budget, count, 1]
        ratios = [a.seconds / t.seconds for t, a in zip(threaded, alone, strict=True)]
        equal = all(
            torch.equal(t.images[i], alone[0].images[i]) for t in threaded for i in t.images
        )
        requests = count * REQUESTS
        waits = statistics.median(t.tally.waits for t in threaded)
        moves = statistics.median(t.tally.moves for t in threaded) / requests
        moves_alone = statistics.median(a.tally.moves for a in alone) / requests
        moved = statistics.median(t.tally.moved for t in threaded) / requests
        moved_alone = statistics.median(a.tally.moved for a in alone) / requests
        print(
            f"| {budget} | {count} | {statistics.median(ratios):.2f}x "
            f"({min(ratios):.2f}-{max(ratios):.2f}) | {waits:.0f} | {moves:.2f} "
            f"({moves_alone:.2f}) | {moved:,.0f} ({moved_alone:,.0f}) | "
            f"{'yes' if equal else 'NO'} |"
        )
    print()


if __name__ == "__main__":
    announce("contention")
    main()
