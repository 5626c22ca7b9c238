"""Admission, loading and serving costs of the orchestrator itself, side by side.

Run: ``python -m benchmarks orchestrator``.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import ClassVar

import msgspec
import torch
from torch import nn

from attention import Platform
from components import registry
from components.batch import Batch
from components.loader import ComponentLoader
from lifecycle.admission import admit_pipeline
from lifecycle.config import PipelineSpec, decode_spec, load_spec
from lifecycle.orchestrator import Orchestrator

ROOT = Path(__file__).resolve().parents[1]
CPU = Platform("cpu")
STAGES = ("encode", "denoise", "decode")


class NoopLoader(ComponentLoader):
    """A kind whose module does nothing: what remains is the orchestrator's own cost."""

    kind: ClassVar[str] = "bench_noop"

    def build_custom(self) -> nn.Module:
        """Build a module with one small weight and no attention."""
        return nn.Linear(4, 4)

    def run(self, module: nn.Module, batch: Batch) -> None:
        """Do nothing."""


def timed(action: Callable[[], object], repeats: int) -> list[float]:
    """Return the wall time of ``action`` in seconds, ``repeats`` times."""
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        action()
        times.append(time.perf_counter() - started)
    return times


def reference(target: str, offload_dir: Path, resident: bool = False) -> PipelineSpec:
    """Return the reference spec with ``target`` offload, or all components resident."""
    raw = msgspec.to_builtins(load_spec(ROOT / "examples" / "tiny_t2i.toml"))
    raw["memory"].update(offload_target=target, offload_dir=str(offload_dir))
    if resident:
        for component in raw["components"].values():
            component["residency"] = "resident"
    return msgspec.convert(raw, PipelineSpec)


def wide_spec(count: int) -> PipelineSpec:
    """Return a spec of ``count`` components of the reference kinds, one stage each."""
    kinds = ("tiny_text_encoder", "tiny_dit", "tiny_vae", "tiny_upsampler")
    lines = ['name = "wide"']
    for index in range(count):
        lines += [f"[components.c{index}]", f'kind = "{kinds[index % 4]}"']
        lines += ['residency = "component_offload"'] if index % 2 else []
    for index in range(count):
        lines += ["[[stages]]", f'name = "s{index}"', f'uses = ["c{index}"]']
    return decode_spec("\n".join(lines))


def serve(orchestrator: Orchestrator, stages: tuple[str, ...], steps: int) -> None:
    """Run one request through ``stages``."""
    batch = Batch(generator=torch.Generator().manual_seed(0), steps=steps)
    with orchestrator.request() as request:
        for stage in stages:
            request.run(stage, batch)


def main() -> None:
    """Print admission, load and per-request figures as a markdown table."""
    registry.register_kind(NoopLoader)
    spec64 = wide_spec(64)
    admission = timed(lambda: admit_pipeline(spec64, CPU), 20)
    rows = [("admit a 64-component pipeline", statistics.median(admission) * 1e3, "ms")]

    def load_reference() -> None:
        with Orchestrator(load_spec(ROOT / "examples" / "tiny_t2i.toml"), platform=CPU) as o:
            o.load()

    load = timed(load_reference, 10)
    rows.append(
        ("load the reference pipeline (admit + build + place)", statistics.median(load) * 1e3, "ms")
    )

    with tempfile.TemporaryDirectory() as folder:
        setups = {
            "all resident": reference("host", Path(folder), resident=True),
            "encoder + VAE offloaded to host": reference("host", Path(folder)),
            "encoder + VAE offloaded to disk": reference("disk", Path(folder)),
        }
        orchestrators = {label: Orchestrator(spec, platform=CPU) for label, spec in setups.items()}
        for orchestrator in orchestrators.values():
            orchestrator.load()
            serve(orchestrator, STAGES, 8)
        samples: dict[str, list[float]] = {label: [] for label in setups}
        for _ in range(15):  # interleaved so that machine noise hits every setup alike
            for label, orchestrator in orchestrators.items():
                samples[label] += timed(lambda o=orchestrator: serve(o, STAGES, 8), 1)
        base = statistics.median(samples["all resident"])
        for label, times in samples.items():
            median = statistics.median(times)
            rows.append((f"request, {label} (8 steps)", median * 1e3, f"ms ({median / base:.2f}x)"))
        for orchestrator in orchestrators.values():
            orchestrator.close()

    noop = decode_spec(
        'name = "noop"\n'
        + "".join(
            f'[components.{n}]\nkind = "bench_noop"\nresidency = "component_offload"\n'
            for n in ("a", "b", "c")
        )
        + "".join(f'[[stages]]\nname = "{n}"\nuses = ["{n}"]\n' for n in ("a", "b", "c"))
    )
    with Orchestrator(noop, platform=CPU) as orchestrator:
        orchestrator.load()
        serve(orchestrator, ("a", "b", "c"), 1)
        overhead = timed(lambda: serve(orchestrator, ("a", "b", "c"), 1), 300)
    rows.append(
        (
            "orchestrator overhead per request (3 stages, 6 moves, no-op modules)",
            statistics.median(overhead) * 1e6,
            "us",
        )
    )
    registry.unregister_kind(NoopLoader.kind)
    print("| measure | value | unit |\n|---|---:|---|")
    for label, value, unit in rows:
        print(f"| {label} | {value:.2f} | {unit} |")


if __name__ == "__main__":
    main()
