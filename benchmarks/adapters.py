"""Adapters (LoRA, DESIGN §14): a merged switch against unmerged per-request overhead, and
throughput with several adapters against one.

- **ranks**: a bench Flux folder's transformer (8 + 8 blocks, width 384) with a LoRA of
  its attention projections at rank 4, 16 and 64. Side by side: a request (256x256, 4
  steps) on the base weights, with the LoRA merged, and unmerged (each linear layer adds
  ``B A x`` in the forward); and a switch: merging the LoRA from the kept base, then
  putting the base back (what ``lifecycle.adapters`` does on a change of merged set).
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
from pathlib import Path

import msgspec
import torch

from benchmarks.attention_overhead import interleaved
from benchmarks.folders import Loaded, load_ours, request_ours
from benchmarks.make_adapter import DEFAULT_TARGETS, linear_shapes, write_lora
from benchmarks.make_pipeline import write_pipeline
from components.adapters import AdapterFile, attach, linear_layers, merged_weight, read_matrices
from components.libraries import is_importable
from lifecycle.config import decode_spec, load_spec
from lifecycle.orchestrator import Orchestrator
from lifecycle.serving.jobs import BatchKey, Job
from lifecycle.serving.metrics import ServingMetrics
from lifecycle.serving.worker import Worker

RANKS = (4, 16, 64)
ROUNDS = 5
CLIENTS = 16
REQUESTS_PER_CLIENT = 4
SPEC = Path(__file__).resolve().parents[1] / "examples" / "tiny_t2i.toml"


def ranks(root: Path) -> None:
    """Print the merged-switch and unmerged-overhead table of the Flux bench folder."""
    folder = write_pipeline("flux", root / "flux", size="bench")
    loaded = load_ours(folder)
    shapes = linear_shapes(folder, "transformer", DEFAULT_TARGETS)
    print(f"### Ranks (Flux bench transformer, {len(shapes)} target layers, 256x256, 4 steps)")
    print()
    print(
        "| rank | MiB of LoRA | request base s | merged / base | unmerged / base "
        "| switch ms (merge + unmerge) | switch / request |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for rank in RANKS:
        lora = write_lora(shapes, root / f"r{rank}.safetensors", prefix="transformer", rank=rank)
        print(f"| {rank} | {rank_row(loaded, lora)}", flush=True)
    print()


def rank_row(loaded: Loaded, lora: Path) -> str:
    """Measure one LoRA on the transformer of ``loaded``; return the rest of its table row."""
    module = loaded.modules["transformer"]
    guidance = loaded.recipe.default_guidance
    file = AdapterFile.read(lora)
    targets, _ = file.targets("transformer")
    layers = linear_layers(module, targets)
    matrices = read_matrices(lora, targets, layers, file.alpha_ratio, torch.device("cpu"))
    bases = {path: layer.weight.data for path, layer in layers.items()}
    size = sum(m.nbytes for m in matrices.values()) / 2**20

    def merge() -> None:
        for path, layer in layers.items():
            layer.weight.data = merged_weight(bases[path], [(matrices[path], 1.0)])

    def unmerge() -> None:
        for path, layer in layers.items():
            layer.weight.data = bases[path]

    def switch() -> None:
        merge()
        unmerge()

    def merged_request() -> None:
        merge()
        try:
            request_ours(loaded, guidance)
        finally:
            unmerge()

    def unmerged_request() -> None:
        handles = [attach(layer, "a", matrices[p]) for p, layer in layers.items()]
        try:
            request_ours(loaded, guidance, adapters=[{"a": 1.0}])
        finally:
            for handle in handles:
                handle.remove()

    with torch.inference_mode():
        switches = interleaved({"switch": switch}, rounds=ROUNDS, inner=5)["switch"]
    samples = interleaved(
        {
            "base": lambda: request_ours(loaded, guidance),
            "merged": merged_request,
            "unmerged": unmerged_request,
        },
        rounds=ROUNDS,
        inner=1,
    )
    base = statistics.median(samples["base"])
    switch_s = statistics.median(switches)
    merged = statistics.median(
        m / b for m, b in zip(samples["merged"], samples["base"], strict=True)
    )
    unmerged = statistics.median(
        u / b for u, b in zip(samples["unmerged"], samples["base"], strict=True)
    )
    return (
        f"{size:.2f} | {base:.3f} | {merged:.3f}x | {unmerged:.3f}x "
        f"| {1e3 * switch_s:.1f} | {switch_s / base:.3f} |"
    )


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
        worker = Worker(Orchestrator(spec), metrics)
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
