"""Adapters (LoRA, design §14): a merged switch against unmerged per-request overhead, and
throughput with several adapters against one.

- **ranks**: a bench Flux folder (transformer of 8 + 8 blocks, width 384) loaded by the
  orchestrator, with a LoRA of its attention projections at rank 4, 16 and 64 added at
  run time, merged and unmerged. Side by side: a request (256x256, 4 steps) on the base
  weights, naming the merged adapter (the base request before it unmerged it, so each
  one switches), and naming the unmerged one (each linear layer adds ``B A x`` in the
  forward); the switch's own time is read from its ``adapter.switched`` event.
- **clients**: ``tiny_t2i`` through the serving worker's queue (no HTTP), 16 submitting
  threads: every request with one adapter, against 4 adapters in turn; merged (the batcher
  keys by set, and a change of set switches the weights) and unmerged.

Run: ``python -m benchmarks adapters``.
"""

from __future__ import annotations

import statistics
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path

import msgspec

from benchmarks.attention_overhead import interleaved
from benchmarks.folders import SIZE, STEPS, load_ours, request_ours
from benchmarks.make_adapter import DEFAULT_TARGETS, linear_shapes, write_lora
from benchmarks.make_pipeline import write_pipeline
from components.libraries import is_importable
from lifecycle.events import AdapterSwitched
from lifecycle.orchestrator import Orchestrator
from lifecycle.serving.jobs import BatchKey, Job
from lifecycle.serving.metrics import ServingMetrics
from lifecycle.serving.worker import Worker
from lifecycle.spec.reading import decode_spec, load_spec
from lifecycle.spec.structs import AdapterSpec

RANKS = (4, 16, 64)
ROUNDS = 5
RANK_ROUNDS = 3
CLIENTS = 16
REQUESTS_PER_CLIENT = 4
SPEC = Path(__file__).resolve().parents[1] / "examples" / "tiny_t2i.toml"


def ranks(root: Path) -> None:
    """Print the merged-switch and unmerged-overhead table of the Flux bench folder."""
    folder = write_pipeline("flux", root / "flux", size="bench")
    orchestrator = load_ours(folder)
    assert orchestrator.recipe is not None
    guidance = orchestrator.recipe.default_guidance
    shapes = linear_shapes(folder, "transformer", DEFAULT_TARGETS)
    switches: list[float] = []
    orchestrator.observe(
        lambda event: switches.append(event.seconds) if isinstance(event, AdapterSwitched) else None
    )
    print(
        f"### Ranks (Flux bench folder through the orchestrator, LoRA of {len(shapes)} "
        f"attention projections, {SIZE[0]}x{SIZE[1]}, {STEPS} steps, {RANK_ROUNDS} rounds)"
    )
    print()
    print(
        "| rank | MiB of LoRA | request base s | merged (a switch each) / base "
        "| unmerged / base | switch ms (unmerge + merge) | switch / request |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for rank in RANKS:
        lora = write_lora(shapes, root / f"r{rank}.safetensors", prefix="transformer", rank=rank)
        for mode in ("merged", "unmerged"):
            orchestrator.add_adapter(f"{mode}{rank}", AdapterSpec(path=str(lora), mode=mode))
        switches.clear()
        samples = interleaved(
            {
                "base": lambda: request_ours(orchestrator, guidance),
                "merged": partial(request_ours, orchestrator, guidance, {f"merged{rank}": 1.0}),
                "unmerged": partial(request_ours, orchestrator, guidance, {f"unmerged{rank}": 1.0}),
            },
            rounds=RANK_ROUNDS,
            inner=1,
        )
        for mode in ("merged", "unmerged"):
            orchestrator.remove_adapter(f"{mode}{rank}")
        size = lora.stat().st_size / 2**20
        base = statistics.median(samples["base"])
        switch = statistics.median(switches)
        print(
            f"| {rank} | {size:.2f} | {base:.3f} | {ratio(samples, 'merged'):.3f}x "
            f"| {ratio(samples, 'unmerged'):.3f}x | {1e3 * switch:.1f} | {switch / base:.3f} |",
            flush=True,
        )
    orchestrator.close()
    print()


def ratio(samples: dict[str, list[float]], name: str) -> float:
    """Return the median over rounds of ``name``'s time over the base's in the same round."""
    return statistics.median(t / b for t, b in zip(samples[name], samples["base"], strict=True))


def clients(root: Path) -> None:
    """Print the throughput of 16 clients with one adapter and with four, merged and unmerged."""
    shapes = {
        f"blocks.{block}.mlp.{layer}": ((64, 32) if layer == 0 else (32, 64))
        for block in range(2)
        for layer in (0, 2)
    }
    names = [f"a{i}" for i in range(4)]
    for i, name in enumerate(names):
        write_lora(shapes, root / f"{name}.safetensors", prefix="transformer", seed=i)
    print(f"### {CLIENTS} clients through the worker's queue (tiny_t2i, 2 steps, {ROUNDS} rounds)")
    print()
    print("| mode | one adapter req/s | four adapters req/s | four / one | switches (four) |")
    print("|---|---:|---:|---:|---:|")
    for mode in ("merged", "unmerged"):
        raw = msgspec.to_builtins(load_spec(SPEC))
        raw["device"] = "cpu"
        raw["adapters"] = {
            name: {"path": str(root / f"{name}.safetensors"), "mode": mode} for name in names
        }
        raw["components"]["transformer"]["residency"] = "resident"
        spec = decode_spec(msgspec.json.encode(raw).decode(), "json")
        metrics = ServingMetrics(queue_depth=lambda: 0, resident_bytes=lambda: 0)
        worker = Worker([Orchestrator(spec)], metrics)
        worker.start()
        one, four, switched = [], [], []
        for _ in range(ROUNDS):
            one.append(throughput(worker, lambda i: names[0]))
            before = worker.orchestrator.adapter_switches
            four.append(throughput(worker, lambda i: names[i % len(names)]))
            switched.append(worker.orchestrator.adapter_switches - before)
        worker.drain()
        worker.orchestrator.close()
        ratio = statistics.median(f / o for f, o in zip(four, one, strict=True))
        print(
            f"| {mode} | {statistics.median(one):.1f} | {statistics.median(four):.1f} "
            f"| {ratio:.2f}x | {statistics.median(switched):.0f} |",
            flush=True,
        )
    print()


def throughput(worker: Worker, adapter_of: object) -> float:
    """Return the requests a second of ``CLIENTS`` threads submitting jobs to ``worker``."""
    assert callable(adapter_of)
    counter = iter(range(10**9))
    lock = threading.Lock()

    def client(k: int) -> None:
        for _ in range(REQUESTS_PER_CLIENT):
            with lock:
                i = next(counter)
            key = BatchKey(
                endpoint="images", steps=2, latent_size=(4, 4), adapters=((adapter_of(i), 1.0),)
            )
            job = Job(id=f"j{i}", key=key, prompts=["a red fox"], tokens=16, seed=i)
            worker.submit(job).result()

    started = time.perf_counter()
    with ThreadPoolExecutor(CLIENTS) as pool:
        list(pool.map(client, range(CLIENTS)))
    return CLIENTS * REQUESTS_PER_CLIENT / (time.perf_counter() - started)


def main() -> None:
    """Print both tables."""
    with tempfile.TemporaryDirectory() as folder:
        root = Path(folder)
        clients(root)
        if all(is_importable(name) for name in ("diffusers", "transformers")):
            ranks(root)
        else:
            print("ranks: skipped, needs the diffusers extra")
