"""Compiled components: equal to eager, compiled once, no recompile when offload moves them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from attention import Platform
from components.batch import Batch
from lifecycle.orchestrator import Orchestrator
from lifecycle.serving.metrics import ServingMetrics
from lifecycle.serving.worker import Phase, Worker
from lifecycle.spec.reading import decode_spec
from tests.conftest import Lifecycle
from tests.lifecycle.compiled import Compiled
from tests.lifecycle.test_quantization import tiny_t2i

pytestmark = pytest.mark.long  # one compile by inductor: tens of CPU-seconds

SIZES = ((4, 4), (6, 6), (8, 8))
"""Three latent sizes, the requests cycling through them."""
REQUESTS = 22
DIT = 'residency = "component_offload"'
"""The tiny DiT (two blocks) offloaded whole after every request: each request moves it back."""


def run(root: Path, folder: Path, keys: str) -> tuple[list[torch.Tensor], list[Compiled]]:
    """Run ``REQUESTS`` 2-step requests of the tiny pipeline, sizes in turn, with ``keys`` on
    its DiT offloaded to disk; return the images and the DiT's compile counts after each."""
    spec = decode_spec(tiny_t2i(root, folder, f"{keys}\n{DIT}", "disk"))
    found, compiled = [], []
    with Orchestrator(spec) as pipeline:
        pipeline.admit()
        pipeline.load()
        for seed in range(REQUESTS):
            size = SIZES[seed % len(SIZES)]
            batch = Batch(generator=torch.Generator().manual_seed(seed), steps=2, latent_size=size)
            with pipeline.request(f"r{seed}") as request:
                request.run_all(batch)
            assert batch.images is not None
            found.append(batch.images)
            compilation = pipeline.compilations().get("transformer")
            compiled.append(Compiled(-1, -1) if compilation is None else Compiled.of(compilation))
    return found, compiled


@pytest.fixture(scope="module")
def eager(root: Path, tmp_path_factory: pytest.TempPathFactory) -> list[torch.Tensor]:
    """The images of the DiT uncompiled."""
    return run(root, tmp_path_factory.mktemp("eager"), "")[0]


class TestCompileBlocks:
    def test_blocks_equal_eager_and_stop_recompiling_after_two_sizes(
        self, root: Path, tmp_path: Path, eager: list[torch.Tensor]
    ) -> None:
        """A DiT compiled by blocks makes eager's images within 1e-5 at three sizes. Its
        two blocks compile to one graph at its first request (nothing in a block breaks the
        graph: the packed self-attention reads no tensor's values) and recompile once, with
        dynamic shapes, at the first request of a second size; then nothing over 20
        requests of the three sizes, each of which onloads its weights again from the disk
        file."""
        found, compiled = run(root, tmp_path, 'compile = "blocks"')
        for image, reference in zip(found, eager, strict=True):
            torch.testing.assert_close(image, reference, rtol=0, atol=1e-5)
        assert compiled[0] == Compiled(graphs=1, recompiles=0)
        # the second shape class: dynamic shapes from here on
        assert set(compiled[1:]) == {Compiled(graphs=2, recompiles=1)}

    def test_run_json_counts_recompiles(
        self, lifecycle: Lifecycle, root: Path, tmp_path: Path
    ) -> None:
        """run --json reports a compiled component's recompiles (0 over requests of one
        size after the first) and its compile seconds; an uncompiled one reports null."""
        spec = tmp_path / "spec.toml"
        spec.write_text(tiny_t2i(root, tmp_path / "offload", f'compile = "blocks"\n{DIT}', "disk"))
        done = lifecycle("run", spec, "--json", "--requests", "3", "--steps", "2")
        assert done.returncode == 0, done.stderr
        components = json.loads(done.stdout)["summary"]["components"]
        assert components["transformer"]["recompiles"] == 0
        assert components["transformer"]["compile_seconds"] >= 0
        assert components["vae"]["recompiles"] is None

    def test_serving_reports_compile_seconds_and_recompiles(
        self, cpu: Platform, root: Path, tmp_path: Path
    ) -> None:
        """A worker's warm-up compiles the DiT: its startup (serving.ready, /readyz) gives the
        compile seconds, and /metrics counts lifecycle_recompiles_total for it."""
        spec = decode_spec(tiny_t2i(root, tmp_path, f'compile = "blocks"\n{DIT}', "disk"))
        holder: list[Worker] = []
        metrics = ServingMetrics(lambda: 0, lambda: 0, lambda: holder[0].recompiles())
        worker = Worker([Orchestrator(spec, platform=cpu, observer=metrics.observe)], metrics)
        holder.append(worker)
        worker.start()
        try:
            assert worker.phase is Phase.READY, worker.error
            assert worker.startup[spec.name].compile_s["transformer"] > 0
            text = metrics.render().decode()
            line = (
                f'lifecycle_recompiles_total{{component="transformer",pipeline="{spec.name}"}} 0.0'
            )
            assert line in text
        finally:
            worker.drain()
