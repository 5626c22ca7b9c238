"""Disk offload against its peers on one module and input, warm and cold page cache (issue 12).

The module is 8 blocks of two float32 Linear 2048x2048 layers (32 MiB a block,
256 MiB in all), run on a batch of 16 rows on the CPU. One call is what a
request pays for the module: bring the weights in, run the forward, send them
out. Methods, each on its own copy of the same weights:

- ``resident``: the forward alone (the ratio's denominator);
- ``ours component``: ``DiskStore`` onload, forward, offload (checksum, then stat verification);
- ``ours layerwise``: ``LayerwiseStore`` on disk, prefetch 1 and 0 (checksum and stat);
- ``diffusers group``: ``apply_group_offloading(offload_type="block_level",
  offload_to_disk_path=...)``, one block a group, and all eight blocks as one group;
- ``accelerate disk``: ``accelerate.disk_offload``.

Rounds interleave the methods (the order rotates each round, so drift hits all
alike) and each cell is the median of its rounds; the ratio is over the resident
median of the same run. The cold runs drop each method's files from the page
cache before its call with ``posix_fadvise(POSIX_FADV_DONTNEED)``.

A second table times ``DiskStore.onload`` alone, warm: ``checksum`` on a version
of the file it has not hashed yet, on one it hashed before, and ``stat``, to
give the hash's cost and what a request pays once the file's version is hashed.

Run: ``python -m benchmarks.disk_offload`` (the peers come from the ``bench``
extra: ``pip install -e '.[bench]'``; a missing one is skipped with a line).
"""

from __future__ import annotations

import contextlib
import datetime
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from torch import nn

from components.offload import DiskStore, LayerwiseStore
from components.offload.disk_file import SETTLED_NS
from components.residency import OffloadVerify

BLOCKS, WIDTH, ROWS = 8, 2048, 16
ROUNDS = 7
THREADS = 1
HASHING = "checksum, a new version of the file (hashes)"
VERIFICATIONS: dict[str, OffloadVerify] = {
    HASHING: "checksum",
    "checksum, a version hashed before": "checksum",
    "stat": "stat",
}


class Block(nn.Module):
    """Two square Linear layers with a residual: 32 MiB of float32 weights."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(WIDTH, WIDTH, bias=False)
        self.down = nn.Linear(WIDTH, WIDTH, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = x + self.down(torch.relu(self.up(x)))
        return out


class Stack(nn.Module):
    """The benchmark's module: a stack of blocks and nothing else."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(BLOCKS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def build() -> Stack:
    """Return the module with weights that depend only on the fixed seed."""
    generator = torch.Generator().manual_seed(0)
    model = Stack().eval()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.normal_(std=WIDTH**-0.5, generator=generator)
    return model


INPUT = torch.randn(ROWS, WIDTH, generator=torch.Generator().manual_seed(1))


class Method:
    """One way of running the module: a call that returns its output, and its files."""

    def __init__(self, name: str, call: Callable[[], torch.Tensor], folder: Path | None) -> None:
        self.name = name
        self.call = call
        self.folder = folder

    def drop_cache(self) -> None:
        """Drop this method's files from the page cache (pages still mapped stay)."""
        if self.folder is None:
            return
        for path in self.folder.rglob("*"):
            if path.is_file():
                fd = os.open(path, os.O_RDONLY)
                try:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(fd)


def forward(model: nn.Module) -> torch.Tensor:
    """Run the module on the fixed input."""
    with torch.inference_mode():
        out: torch.Tensor = model(INPUT)
    return out


def ours_component(folder: Path, verify: OffloadVerify) -> Callable[[], torch.Tensor]:
    """Return a call that onloads a DiskStore, runs the forward and offloads it."""
    model = build()
    store = DiskStore(model, folder / "module.safetensors", "cpu", verify=verify)

    def call() -> torch.Tensor:
        store.onload()
        out = forward(model)
        store.offload()
        return out

    return call


def ours_layerwise(
    folder: Path, verify: OffloadVerify, prefetch: int
) -> Callable[[], torch.Tensor]:
    """Return a call that runs the forward through a disk LayerwiseStore."""
    model = build()
    path = folder / "module.safetensors"
    store = LayerwiseStore(
        model,
        model.blocks,
        target="disk",
        path=path,
        device="cpu",
        prefetch=prefetch,
        verify=verify,
    )

    def call() -> torch.Tensor:
        store.onload()
        out = forward(model)
        store.offload()
        return out

    return call


def peers(root: Path) -> Iterator[Method]:
    """Yield the diffusers and accelerate methods that are installed; say which are not."""
    try:
        from diffusers.hooks import apply_group_offloading
    except ImportError:
        print(
            "diffusers not installed: its group offloading is skipped (pip install -e '.[bench]')"
        )
    else:
        for per_group in (1, BLOCKS):
            model = build()
            folder = root / f"diffusers-{per_group}"
            folder.mkdir()
            apply_group_offloading(
                model,
                onload_device=torch.device("cpu"),
                offload_type="block_level",
                num_blocks_per_group=per_group,
                offload_to_disk_path=str(folder),
            )
            label = "one block a group" if per_group == 1 else "one group"
            yield Method(f"diffusers group ({label})", _bound(forward, model), folder)
    try:
        from accelerate import disk_offload
    except ImportError:
        print("accelerate not installed: its disk offload is skipped (pip install -e '.[bench]')")
    else:
        model = build()
        folder = root / "accelerate"
        disk_offload(model, str(folder), execution_device=torch.device("cpu"))
        yield Method("accelerate disk_offload", _bound(forward, model), folder)


def _bound(
    function: Callable[[nn.Module], torch.Tensor], model: nn.Module
) -> Callable[[], torch.Tensor]:
    return lambda: function(model)


def methods(root: Path) -> list[Method]:
    """Build every method once, each on its own copy of the weights and its own folder."""
    found = [Method("resident", _bound(forward, build()), None)]
    for verify in ("checksum", "stat"):
        folder = root / f"component-{verify}"
        found.append(Method(f"ours component ({verify})", ours_component(folder, verify), folder))
        for prefetch in (1, 0):
            folder = root / f"layerwise-{verify}-{prefetch}"
            found.append(
                Method(
                    f"ours layerwise ({verify}, prefetch {prefetch})",
                    ours_layerwise(folder, verify, prefetch),
                    folder,
                )
            )
    for method in found:
        if method.folder is not None:
            method.folder.mkdir(exist_ok=True)
    found.extend(peers(root))
    return found


def measure(found: list[Method], *, cold: bool) -> dict[str, list[float]]:
    """Time every method over interleaved rounds; round 0 warms up and is not kept."""
    times: dict[str, list[float]] = {method.name: [] for method in found}
    expected = found[0].call()
    for round_ in range(ROUNDS + 1):
        shift = round_ % len(found)
        for method in found[shift:] + found[:shift]:
            if cold:
                method.drop_cache()
            start = time.perf_counter()
            out = method.call()
            elapsed = time.perf_counter() - start
            if not torch.allclose(out, expected, rtol=1e-5, atol=1e-5):
                raise AssertionError(f"{method.name} computed another output")
            if round_:
                times[method.name].append(elapsed)
    return times


def print_table(title: str, times: dict[str, list[float]]) -> None:
    """Print each method's median and its ratio over the resident median."""
    resident = statistics.median(times["resident"])
    print(f"### {title}")
    print()
    print("| method | median ms | min ms | max ms | vs resident |")
    print("|---|---:|---:|---:|---:|")
    for name, samples in times.items():
        median = statistics.median(samples)
        low, high = min(samples), max(samples)
        print(
            f"| {name} | {median * 1e3:.1f} | {low * 1e3:.1f} | {high * 1e3:.1f} "
            f"| {median / resident:.2f}x |"
        )
    print()


def checksum_share(root: Path) -> None:
    """Print a warm DiskStore onload's cost with and without hashing, alone and with the forward.

    ``checksum`` hashes a version of the file once: the "hashing" store's file is
    chmodded before each call (a new ctime, so a new version), the other one's
    is hashed in the warm-up round and trusted after it.
    """
    stores = {}
    for label, verify in VERIFICATIONS.items():
        model = build()
        store = DiskStore(
            model, root / f"share-{verify}-{len(stores)}.safetensors", "cpu", verify=verify
        )
        stores[label] = (store, model)
    time.sleep(2 * SETTLED_NS / 1e9)  # so that the warm-up's hash is trusted
    onload: dict[str, list[float]] = {label: [] for label in stores}
    with_forward: dict[str, list[float]] = {label: [] for label in stores}
    for round_ in range(ROUNDS + 1):
        for label, (store, model) in stores.items():
            if label == HASHING:
                store.path.chmod(0o400)
            start = time.perf_counter()
            store.onload()
            loaded = time.perf_counter()
            forward(model)
            done = time.perf_counter()
            store.offload()
            if round_:
                onload[label].append(loaded - start)
                with_forward[label].append(done - start)
    print("### The checksum's cost (DiskStore, 256 MiB, warm page cache)")
    print()
    print("| verification | onload ms | onload + forward ms |")
    print("|---|---:|---:|")
    for label in stores:
        print(
            f"| {label} | {statistics.median(onload[label]) * 1e3:.2f} "
            f"| {statistics.median(with_forward[label]) * 1e3:.1f} |"
        )
    print()


def main() -> None:
    """Print the warm and cold tables and the checksum's share."""
    torch.set_num_threads(THREADS)
    print(
        f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC; torch {torch.__version__}; "
        f"{torch.get_num_threads()} intra-op thread(s); {BLOCKS} blocks x "
        f"{2 * WIDTH * WIDTH * 4 / 2**20:.0f} MiB; {ROUNDS} rounds, interleaved"
    )
    print()
    with contextlib.ExitStack() as stack:
        root = Path(stack.enter_context(tempfile.TemporaryDirectory()))
        found = methods(root)
        print_table("Warm page cache", measure(found, cold=False))
        os.sync()  # written pages must be clean before they can be dropped
        print_table("Cold page cache", measure(found, cold=True))
        checksum_share(root)


if __name__ == "__main__":
    main()
