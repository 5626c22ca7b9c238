"""Compiled and quantized DiTs (design §17): the tiny pipeline's and the tiny PixArt and
Flux folders'. Compiled blocks equal eager within 1e-5, compile at the first request and
recompile once, at the first request of a second size, whether the DiT is offloaded whole
to disk or streamed by layerwise offload; run --json and a serving worker report it; each
quantization keeps its stated PSNR of float32.

One file, so one xdist worker: the first inductor compile of a process imports inductor
and reads its cache, 3.5-4.4 CPU-s that a second worker compiling the same way paid again.
"""

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
from tests.components.test_step_cache import psnr
from tests.conftest import Lifecycle, PipelineFolders
from tests.lifecycle.compiled import Compiled
from tests.lifecycle.test_quantization import tiny_t2i

pytestmark = [pytest.mark.long, pytest.mark.usefixtures("one_thread")]  # inductor: tens of s

FAMILIES = ("pixart", "flux")
QUANTIZATIONS = ("int8_weight_only", "int8_dynamic", "float8_weight_only")
FLOOR_DB = {"int8_weight_only": 50.0, "int8_dynamic": 45.0, "float8_weight_only": 40.0}
"""The PSNR of a folder's images against float32 that each quantization keeps (2 requests
of 2 steps, 64x64; measured PixArt 57.2-58.1, 51.6-51.9, 48.7-49.1 dB, Flux 59.2-61.4,
53.7-54.5, 44.7-45.7 dB)."""
SIZES = ((64, 64), (96, 96), (128, 128))
"""Three image sizes, the requests cycling through them."""
BLOCK_CLASSES = {"pixart": 1, "flux": 2}
"""The block classes of each folder's DiT: Flux has double- and single-stream blocks."""
LATENT_SIZES = ((4, 4), (6, 6), (8, 8))
"""Three latent sizes of the tiny pipeline, its requests cycling through them."""
REQUESTS = 22
DIT = 'residency = "component_offload"'
"""The tiny DiT (two blocks) offloaded whole after every request: each request moves it back."""


def tiny_run(root: Path, folder: Path, keys: str) -> tuple[list[torch.Tensor], list[Compiled]]:
    """Run ``REQUESTS`` 2-step requests of the tiny pipeline, sizes in turn, with ``keys`` on
    its DiT offloaded to disk; return the images and the DiT's compile counts after each."""
    spec = decode_spec(tiny_t2i(root, folder, f"{keys}\n{DIT}", "disk"))
    found, compiled = [], []
    with Orchestrator(spec) as pipeline:
        pipeline.admit()
        pipeline.load()
        for seed in range(REQUESTS):
            size = LATENT_SIZES[seed % len(LATENT_SIZES)]
            batch = Batch(generator=torch.Generator().manual_seed(seed), steps=2, latent_size=size)
            with pipeline.request(f"r{seed}") as request:
                request.run_all(batch)
            assert batch.images is not None
            found.append(batch.images)
            compilation = pipeline.compilations().get("transformer")
            compiled.append(Compiled(-1, -1) if compilation is None else Compiled.of(compilation))
    return found, compiled


@pytest.fixture(scope="module")
def tiny_eager(root: Path, tmp_path_factory: pytest.TempPathFactory) -> list[torch.Tensor]:
    """The tiny pipeline's images, its DiT uncompiled."""
    return tiny_run(root, tmp_path_factory.mktemp("eager"), "")[0]


def images(
    folder: Path, keys: str, sizes: tuple[tuple[int, int], ...] = SIZES[:1], requests: int = 2
) -> tuple[list[torch.Tensor], list[Compiled]]:
    """Run ``requests`` seeded 2-step requests of ``folder`` with ``keys`` on its
    transformer, sizes in turn; return the images and its compile counts after each."""
    spec = decode_spec(f'source = "{folder}"\ndevice = "cpu"\n[components.transformer]\n{keys}\n')
    found, compiled = [], []
    with Orchestrator(spec, platform=Platform("cpu")) as pipeline:
        pipeline.admit()
        pipeline.load()
        for seed in range(requests):
            batch = Batch(
                generator=torch.Generator().manual_seed(seed),
                steps=2,
                prompts=["a red fox in the snow"],
                image_size=sizes[seed % len(sizes)],
            )
            with pipeline.request(f"r{seed}") as request:
                request.run_all(batch)
            assert isinstance(batch.images, torch.Tensor)
            found.append(batch.images)
            compilation = pipeline.compilations().get("transformer")
            compiled.append(Compiled(-1, -1) if compilation is None else Compiled.of(compilation))
    return found, compiled


@pytest.fixture(scope="module")
def folders(pipeline_folder: PipelineFolders) -> dict[str, Path]:
    """The tiny PixArt and Flux folders."""
    return {family: pipeline_folder(family) for family in FAMILIES}


@pytest.fixture(scope="module")
def eager(folders: dict[str, Path]) -> dict[str, list[torch.Tensor]]:
    """Each folder's images, its DiT neither compiled nor quantized."""
    return {family: images(folder, "")[0] for family, folder in folders.items()}


class TestCompiledFolders:
    @pytest.mark.parametrize("family", FAMILIES)
    def test_blocks_equal_eager(
        self, family: str, folders: dict[str, Path], eager: dict[str, list[torch.Tensor]]
    ) -> None:
        """A folder's DiT compiled by blocks makes eager's images within 1e-5 (float32),
        compiled at its first request, one graph per block class (nothing in a block
        breaks the graph: PixArt's packed self-attention, its two guidance branches, reads
        no tensor's values), and not again at its second."""
        found, compiled = images(folders[family], 'compile = "blocks"')
        for image, reference in zip(found, eager[family], strict=True):
            torch.testing.assert_close(image, reference, rtol=0, atol=1e-5)
        assert compiled == [Compiled(graphs=BLOCK_CLASSES[family], recompiles=0)] * 2

    def test_streamed_blocks_stop_recompiling_after_two_sizes(
        self, folders: dict[str, Path]
    ) -> None:
        """Flux's blocks compiled and streamed by layerwise offload recompile at the first
        request of a second size only, once per block class (dynamic shapes), then never
        over 7 more requests of three sizes, each of which streams every block in again."""
        keys = 'compile = "blocks"\nresidency = "layerwise_offload"'
        _, compiled = images(folders["flux"], keys, SIZES, requests=9)
        assert compiled[0] == Compiled(graphs=2, recompiles=0)
        assert set(compiled[1:]) == {Compiled(graphs=4, recompiles=2)}


class TestQuantizedFolders:
    @pytest.mark.parametrize("quantization", QUANTIZATIONS)
    @pytest.mark.parametrize("family", FAMILIES)
    def test_images_keep_the_stated_psnr(
        self,
        family: str,
        quantization: str,
        folders: dict[str, Path],
        eager: dict[str, list[torch.Tensor]],
    ) -> None:
        """Each quantization of a folder's DiT keeps its images within its stated PSNR of
        the float32 ones, and changes them (the weights were quantized)."""
        pytest.importorskip("torchao")
        found, _ = images(folders[family], f'quantization = "{quantization}"')
        for image, reference in zip(found, eager[family], strict=True):
            assert FLOOR_DB[quantization] <= psnr(image, reference) < float("inf")


class TestCompileBlocks:
    def test_blocks_equal_eager_and_stop_recompiling_after_two_sizes(
        self, root: Path, tmp_path: Path, tiny_eager: list[torch.Tensor]
    ) -> None:
        """A DiT compiled by blocks makes eager's images within 1e-5 at three sizes. Its
        two blocks compile to one graph at its first request (nothing in a block breaks the
        graph: the packed self-attention reads no tensor's values) and recompile once, with
        dynamic shapes, at the first request of a second size; then nothing over 20
        requests of the three sizes, each of which onloads its weights again from the disk
        file."""
        found, compiled = tiny_run(root, tmp_path, 'compile = "blocks"')
        for image, reference in zip(found, tiny_eager, strict=True):
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
