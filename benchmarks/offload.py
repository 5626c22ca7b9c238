"""Measure disk onload throughput against a plain sequential read of the same file (issue 5).

A 256 MiB module (16 float32 Linear 2048x2048 layers) is offloaded once with
``DiskStore``; then, with the page cache warm, rounds alternate (order rotated
every round so drift hits all alike) between:

- ``DiskStore.onload()`` then a sum over every weight - on a CPU device onload
  maps the file (verifying each tensor's checksum, which reads it); the sum
  touches every page, so the bytes are really read as in the other methods;
- a plain ``readinto`` of the whole file into a fresh ``bytearray`` (which
  CPython zero-fills first: a second pass over the memory);
- the same read into one buffer reused every round (no allocation, no page
  faults: the bound a read can reach);
- the same read followed by a ``torch.frombuffer(...).clone()`` into a tensor;
- ``safetensors.torch.load_file`` with every tensor cloned (its tensors are
  memory-mapped: without the clone nothing would be read).

Each is summarised by its fastest round (load only adds time) and its median.
GB/s counts 1e9 bytes: the weights for onload, the whole file for the reads; the
last column is the best throughput over the plain read's.

Run: ``python -m benchmarks.offload``.
"""

from __future__ import annotations

import datetime
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import nn

from components.offload import DiskStore

LAYERS, WIDTH = 16, 2048
ROUNDS = 7
THREADS = 1


def read_plain(path: Path, buffer: bytearray | None = None) -> bytearray:
    """Read the whole file sequentially, unbuffered, into ``buffer`` or a fresh bytearray."""
    if buffer is None:
        buffer = bytearray(path.stat().st_size)
    view = memoryview(buffer)
    filled = 0
    with open(path, "rb", buffering=0) as file:
        while filled < len(buffer):
            filled += file.readinto(view[filled:])
    return buffer


def read_to_tensor(path: Path) -> torch.Tensor:
    """Read the whole file, then copy it into a tensor through ``torch.frombuffer``."""
    return torch.frombuffer(read_plain(path), dtype=torch.uint8).clone()


def load_cloned(path: Path) -> dict[str, torch.Tensor]:
    """Load with safetensors and clone every tensor, so the mapped bytes are really read."""
    return {name: tensor.clone() for name, tensor in load_file(path).items()}


def onload_touched(store: DiskStore, module: nn.Module) -> float:
    """Onload, then read every weight through a sum (a map alone reads nothing)."""
    store.onload()
    with torch.no_grad():
        return float(sum(parameter.sum() for parameter in module.parameters()))


def main() -> None:
    """Print the throughput table."""
    torch.set_num_threads(THREADS)
    generator = torch.Generator().manual_seed(0)
    layers = [nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(LAYERS)]
    with torch.no_grad():
        for layer in layers:
            layer.weight.normal_(generator=generator)
    module = nn.Sequential(*layers)
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "module.safetensors"
        store = DiskStore(module, path, "cpu")
        file_bytes = path.stat().st_size
        reused = read_plain(path)

        methods: dict[str, tuple[int, Callable[[], object]]] = {
            "DiskStore.onload + sum": (store.nbytes, lambda: onload_touched(store, module)),
            "readinto bytearray": (file_bytes, lambda: read_plain(path)),
            "readinto reused buffer": (file_bytes, lambda: read_plain(path, reused)),
            "readinto + frombuffer clone": (file_bytes, lambda: read_to_tensor(path)),
            "safetensors load_file + clone": (file_bytes, lambda: load_cloned(path)),
        }
        names = list(methods)
        times: dict[str, list[float]] = {name: [] for name in names}
        for round_ in range(ROUNDS + 1):
            for name in names[round_ % len(names) :] + names[: round_ % len(names)]:
                _, call = methods[name]
                start = time.perf_counter()
                result = call()
                elapsed = time.perf_counter() - start
                del result
                store.offload()  # untimed: frees the onloaded weights before the next call
                if round_:  # round 0 warms the page cache and the allocator
                    times[name].append(elapsed)

    plain = file_bytes / min(times["readinto bytearray"])
    print(f"### Disk onload vs sequential read ({store.nbytes / 2**20:.0f} MiB, warm page cache)")
    print()
    threads = torch.get_num_threads()
    print(
        f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC; {ROUNDS} rounds, "
        f"interleaved; torch {torch.__version__}, {threads} thread(s)"
    )
    print()
    print("| method | best s | median s | best GB/s | vs plain read |")
    print("|---|---:|---:|---:|---:|")
    for name in names:
        nbytes, _ = methods[name]
        best, median = min(times[name]), statistics.median(times[name])
        rate = nbytes / best
        print(f"| {name} | {best:.4f} | {median:.4f} | {rate / 1e9:.2f} | {rate / plain:.2f}x |")
    print()


if __name__ == "__main__":
    main()
