"""Loading a pipeline: components built in parallel threads against one at a time (issue 21).

``Orchestrator.load()`` builds the components it may in parallel threads
(``load_threads`` None, the default) while their transitions run in order; with
``load_threads = 1`` it builds them one at a time, as it did before. The two are timed
side by side in interleaved rounds, each on a fresh orchestrator (admission outside the
timing), and the figure is the median over rounds of sequential / parallel wall time
within a round. Pipelines:

- ``t2i_minilm``: examples/t2i_minilm.toml (all-MiniLM-L6-v2 read from its safetensors
  file, a seeded tiny DiT and VAE): one component dominates;
- ``seeded``: examples/tiny_t2i.toml with its text encoder and DiT widened (width
  768, 8 layers: ~62 M and ~106 M parameters), weights drawn from their seeds;
- ``files``: the same three read from safetensors files written beforehand, from the
  page cache, and ``files, cold``: each file dropped from the page cache before each
  load (``posix_fadvise(POSIX_FADV_DONTNEED)``), so that reading waits on the disk.

Run: ``python -m benchmarks loading`` (``BENCH_THREADS`` sets torch's intra-op threads).
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from pathlib import Path

import msgspec
from safetensors.torch import save_file

from benchmarks._environment import announce
from components import registry
from lifecycle.orchestrator import Orchestrator
from lifecycle.spec.reading import load_spec
from lifecycle.spec.structs import PipelineSpec

ROOT = Path(__file__).resolve().parents[1]
ROUNDS = 7
WIDE = {"dim": 768, "heads": 8, "layers": 8, "ffn_dim": 3072}
"""The text encoder's and the DiT's options in the wide pipeline (the DiT's context too)."""


def widened(spec: PipelineSpec) -> PipelineSpec:
    """Return the reference pipeline with its text encoder and DiT at ``WIDE``."""
    components = dict(spec.components)
    for name, extra in (("text_encoder", {}), ("transformer", {"context_dim": WIDE["dim"]})):
        options = {**components[name].options, **WIDE, **extra}
        components[name] = msgspec.structs.replace(components[name], options=options)
    return msgspec.structs.replace(spec, components=components, device="cpu")


def from_files(spec: PipelineSpec, folder: Path) -> PipelineSpec:
    """Return ``spec`` with every component's weights written to, and read from, a file."""
    components = {}
    for name, component in spec.components.items():
        module = registry.get(component.kind).from_options(component.options).build("custom")
        path = folder / f"{name}.safetensors"
        save_file({k: v.contiguous() for k, v in module.state_dict().items()}, str(path))
        components[name] = msgspec.structs.replace(
            component, options={**component.options, "weights": str(path)}
        )
    return msgspec.structs.replace(spec, components=components)


def drop_from_page_cache(spec: PipelineSpec) -> None:
    """Drop every weights file of ``spec`` from the page cache (the next read waits on disk)."""
    for component in spec.components.values():
        fd = os.open(component.options["weights"], os.O_RDONLY)
        try:
            os.fsync(fd)  # the kernel drops only clean pages: a file just written is dirty
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def timed_load(
    spec: PipelineSpec, threads: int | None, cold: bool = False
) -> tuple[float, tuple[str, ...]]:
    """Load ``spec`` on a fresh orchestrator; return the wall seconds and what was parallel."""
    with Orchestrator(spec, load_threads=threads) as orchestrator:
        orchestrator.admit()
        if cold:
            drop_from_page_cache(spec)
        started = time.perf_counter()
        report = orchestrator.load()
        return time.perf_counter() - started, report.parallel


def compare(label: str, spec: PipelineSpec, cold: bool = False) -> None:
    """Time sequential and parallel loads of ``spec`` in interleaved rounds; print a row."""
    timed_load(spec, None)  # first touches: imports, files into the page cache
    sequential: list[float] = []
    parallel: list[float] = []
    built: tuple[str, ...] = ()
    for round_ in range(ROUNDS):
        # alternate which goes first, so that drift over a round hits both alike
        for threads in (1, None) if round_ % 2 == 0 else (None, 1):
            seconds, found = timed_load(spec, threads, cold)
            if threads == 1:
                sequential.append(seconds)
            else:
                parallel.append(seconds)
                built = found
    ratios = [one / many for one, many in zip(sequential, parallel, strict=True)]
    print(
        f"| {label} | {', '.join(built) or 'none'} | {statistics.median(sequential) * 1e3:.0f} "
        f"| {statistics.median(parallel) * 1e3:.0f} | {statistics.median(ratios):.2f}x "
        f"({min(ratios):.2f}-{max(ratios):.2f}) |",
        flush=True,
    )


def main() -> None:
    """Print the sequential and parallel load times of each pipeline, side by side."""
    announce("loading")
    print("| pipeline | built in parallel | one at a time ms | parallel ms | speed-up (range) |")
    print("|---|---|---|---|---|")
    compare("t2i_minilm", load_spec(ROOT / "examples" / "t2i_minilm.toml"))
    seeded = widened(load_spec(ROOT / "examples" / "tiny_t2i.toml"))
    compare("seeded", seeded)
    with tempfile.TemporaryDirectory() as folder:
        files = from_files(seeded, Path(folder))
        compare("files", files)
        compare("files, cold", files, cold=True)
