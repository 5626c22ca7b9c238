"""The worker over time (issue 21): swap, wake and sharing, each beside its baseline.

The pipeline is ``examples/t2i_minilm.toml`` (the real all-MiniLM-L6-v2 as the text
encoder, 87 MiB, a tiny DiT and VAE), on the CPU with the host target.

- **Swap vs a cold process start.** A running worker (in this process) swaps its
  pipeline for the same one with another DiT seed, through ``changes.swap``: once
  with no budget (the new one loads beside the old, which serves meanwhile) and once
  under a budget that cannot hold both pinned DiTs (the old one is drained and
  released first). Either way the encoder and the VAE are equal, so they stay loaded.
  The baseline is what restarting costs: ``lifecycle serve`` from the process's spawn
  to its first ``/readyz`` 200. Rounds alternate the three.
- **Wake vs a cold load.** The pipeline sleeps, then ``Orchestrator.wake()`` brings
  back what it keeps resident (the DiT) and a request runs (onloading the encoder and
  the VAE from their target); the baseline is a fresh ``Orchestrator(spec).load()``
  (admit, build, read the weights, place) and the same request. Host and disk targets;
  rounds alternate. On a CPU the host target's moves are pointer swaps: the wake
  itself costs next to nothing, and what a sleep frees there is the disk target's.
- **Memory saved by sharing.** Two pipelines differing only in the DiT seed are
  loaded in a fresh process each, on one worker device (the encoder and the VAE are
  shared) or on two devices of their own; the table gives the growth of the process's
  resident memory (RSS, from before the first load to after the second) and the bytes
  the device reports saved.

Figures are medians of the rounds. Run: ``python -m benchmarks worker``.
"""

from __future__ import annotations

import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import msgspec
import torch

from components import registry as kinds
from components.batch import Batch
from lifecycle.admission.budget import declared_bytes
from lifecycle.device.shared import SharedDevice
from lifecycle.orchestrator import Orchestrator
from lifecycle.serving import changes
from lifecycle.serving.metrics import ServingMetrics
from lifecycle.serving.worker import Worker
from lifecycle.spec.reading import load_spec
from lifecycle.spec.structs import PipelineSpec

ROOT = Path(__file__).resolve().parents[1]
SPEC = ROOT / "examples" / "t2i_minilm.toml"
ROUNDS = 3
WAKE_ROUNDS = 5
READY_TIMEOUT_S = 300.0


def variant(seed: int, *, pinned: bool = False, target: str = "host") -> PipelineSpec:
    """Return the pipeline with DiT ``seed`` (pinned if asked) offloading to ``target``."""
    raw = msgspec.to_builtins(load_spec(SPEC))
    raw["device"] = "cpu"
    raw["memory"]["offload_target"] = target
    raw["memory"]["offload_dir"] = str(Path(tempfile.gettempdir()) / "lifecycle-bench-worker")
    raw["components"]["transformer"]["options"]["seed"] = seed
    if pinned:
        raw["components"]["transformer"]["residency"] = "resident"
    return msgspec.convert(raw, PipelineSpec)


def median_ms(samples: list[float]) -> float:
    """Return the median of ``samples`` (seconds) in milliseconds."""
    return statistics.median(samples) * 1e3


def cold_start(spec: Path) -> float:
    """Return the seconds from spawning ``lifecycle serve spec`` to its first ready answer."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    command = [sys.executable, "-m", "lifecycle", "serve", str(spec), "--port", str(port)]
    started = time.perf_counter()
    process = subprocess.Popen(
        [*command, "--threads", "1"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        while time.perf_counter() - started < READY_TIMEOUT_S:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=5).status_code == 200:
                    return time.perf_counter() - started
            except httpx.TransportError:
                pass
            threading.Event().wait(0.02)
        raise RuntimeError("the cold worker never became ready")
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=READY_TIMEOUT_S)


class Swapping:
    """A started worker that swaps its pipeline for one with another DiT seed each time."""

    def __init__(self, *, pinned: bool, budget: int | None) -> None:
        self.pinned = pinned
        self.seed = 0
        self.folder = Path(tempfile.mkdtemp(prefix="lifecycle-bench-swap-"))
        first = variant(self.seed, pinned=pinned)
        metrics = ServingMetrics(queue_depth=lambda: 0, resident_bytes=lambda: 0)
        orchestrator = Orchestrator(first, shared=SharedDevice(device_budget=budget))
        orchestrator.admit()
        self.worker = Worker([orchestrator], metrics)
        self.worker.start()
        self.last: changes.ChangeOutcome | None = None

    def swap(self) -> float:
        """Swap in the next seed; return the seconds it took."""
        self.seed += 1
        spec = variant(self.seed, pinned=self.pinned)
        path = self.folder / f"seed{self.seed}.json"
        path.write_bytes(msgspec.json.encode(spec))
        started = time.perf_counter()
        with self.worker.changing:
            self.last = changes.swap(self.worker, self.worker.only, spec, path)
        elapsed = time.perf_counter() - started
        if self.last.restored or self.last.kept != ("text_encoder", "vae"):
            raise RuntimeError(f"the swap did not go as measured: {self.last}")
        return elapsed


def sequential_budget() -> int:
    """Return a budget that holds one pinned DiT beside the largest stage, never two DiTs."""
    sizes = {
        name: declared_bytes(kinds.get(component.kind).from_options(component.options)) or 0
        for name, component in variant(0, pinned=True).components.items()
    }
    dit = sizes["transformer"]
    return dit + max(sizes.values()) + dit // 2


def swap_table() -> None:
    """Print swap latency beside a cold process start."""
    with tempfile.TemporaryDirectory() as folder:
        spec = Path(folder) / "cold.json"
        spec.write_bytes(msgspec.json.encode(variant(0)))
        beside = Swapping(pinned=False, budget=None)
        after = Swapping(pinned=True, budget=sequential_budget())
        times: dict[str, list[float]] = {"cold": [], "beside": [], "after": []}
        for _ in range(ROUNDS):
            times["cold"].append(cold_start(spec))
            times["beside"].append(beside.swap())
            times["after"].append(after.swap())
        overlapped = (beside.last and beside.last.overlapped, after.last and after.last.overlapped)
        beside.worker.drain()
        after.worker.drain()
    cold = median_ms(times["cold"])
    print("| what | median ms | vs cold process start |\n|---|---:|---:|")
    print(f"| cold process start (`lifecycle serve` spawn to ready) | {cold:.0f} | 1.00x |")
    for key, text in (
        ("beside", f"swap, budget holds both (overlapped: {overlapped[0]})"),
        ("after", f"swap, budget holds one (overlapped: {overlapped[1]})"),
    ):
        value = median_ms(times[key])
        print(f"| {text}, encoder + VAE kept | {value:.0f} | {value / cold:.3f}x |")
    print()


def answer(orchestrator: Orchestrator) -> None:
    """Run one two-step request through every stage."""
    batch = Batch(generator=torch.Generator().manual_seed(0), steps=2, prompts=["a red fox"])
    with orchestrator.request() as request:
        request.run_all(batch)


def wake_table() -> None:
    """Print wake, and wake to the first answer, beside a cold load to the first answer."""
    print(
        "| target | wake ms | wake + first request ms | cold load + first request ms "
        "| ratio |\n|---|---:|---:|---:|---:|"
    )
    for target in ("host", "disk"):
        spec = variant(0, target=target)
        sleeper = Orchestrator(spec)
        sleeper.load()
        answer(sleeper)
        times: dict[str, list[float]] = {"wake": [], "woken": [], "cold": []}
        for _ in range(WAKE_ROUNDS):
            sleeper.sleep()
            started = time.perf_counter()
            sleeper.wake()
            times["wake"].append(time.perf_counter() - started)
            answer(sleeper)
            times["woken"].append(time.perf_counter() - started)
            started = time.perf_counter()
            with Orchestrator(spec) as cold:
                cold.load()
                answer(cold)
                times["cold"].append(time.perf_counter() - started)
        sleeper.close()
        wake, woken, cold_ms = (median_ms(times[key]) for key in ("wake", "woken", "cold"))
        print(f"| {target} | {wake:.2f} | {woken:.1f} | {cold_ms:.1f} | {woken / cold_ms:.3f}x |")
    print()


_MEMORY_PROBE = """
import json, resource, sys
from lifecycle.logs import configure_logging
configure_logging("json", "error")
from benchmarks.worker import variant
from lifecycle.orchestrator import Orchestrator
from lifecycle.device.shared import SharedDevice

def rss():
    with open("/proc/self/statm") as file:
        return int(file.read().split()[1]) * resource.getpagesize()

shared = sys.argv[1] == "shared"
device = SharedDevice() if shared else None
before = rss()
pipelines = [Orchestrator(variant(seed), shared=device) for seed in (0, 1)]
for pipeline in pipelines:
    pipeline.load()
saved = device.saved_bytes() if device else 0
print(json.dumps({"grown": rss() - before, "saved": saved}))
"""


def memory_table() -> None:
    """Print the memory two pipelines take, sharing their equal components or not."""
    runs: dict[str, list[dict[str, int]]] = {"separate": [], "shared": []}
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for _ in range(ROUNDS):
        for how in runs:
            out = subprocess.run(
                [sys.executable, "-c", _MEMORY_PROBE, how],
                capture_output=True,
                text=True,
                check=True,
                cwd=ROOT,
                env=env,
            ).stdout
            runs[how].append(msgspec.json.decode(out.strip().splitlines()[-1]))
    separate = statistics.median(r["grown"] for r in runs["separate"]) / 2**20
    shared = statistics.median(r["grown"] for r in runs["shared"]) / 2**20
    saved = runs["shared"][0]["saved"] / 2**20
    print("| two pipelines (DiT seeds 0, 1) | RSS growth MiB | vs separate |\n|---|---:|---:|")
    print(f"| separate devices | {separate:.1f} | 1.00x |")
    print(f"| one worker device, encoder + VAE shared | {shared:.1f} | {shared / separate:.2f}x |")
    print(
        f"\nthe device reports {saved:.1f} MiB saved; the RSS fell by {separate - shared:.1f} MiB\n"
    )


def main() -> None:
    """Print the three tables."""
    swap_table()
    wake_table()
    memory_table()
