"""Compiled and quantized DiTs of the tiny PixArt and Flux folders (design §17): compiled
blocks equal eager within 1e-5, each quantization keeps its stated PSNR of float32, and
blocks streamed by layerwise offload stop recompiling once a second size has been seen."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from attention import Platform
from components.batch import Batch
from lifecycle.orchestrator import Orchestrator
from lifecycle.spec.reading import decode_spec
from tests.components.test_step_cache import psnr
from tests.conftest import PipelineFolders
from tests.lifecycle.compiled import Compiled

pytestmark = [pytest.mark.long, pytest.mark.usefixtures("one_thread")]  # inductor: tens of s

FAMILIES = ("pixart", "flux")
QUANTIZATIONS = ("int8_weight_only", "int8_dynamic", "float8_weight_only")
FLOOR_DB = {"int8_weight_only": 50.0, "int8_dynamic": 45.0, "float8_weight_only": 40.0}
"""The PSNR of a folder's images against float32 that each quantization keeps (2 requests
of 2 steps, 64x64; measured PixArt 57.2-58.1, 51.6-51.9, 48.7-49.1 dB, Flux 59.2-61.4,
53.7-54.5, 44.7-45.7 dB)."""
SIZES = ((64, 64), (96, 96), (128, 128))
BLOCK_CLASSES = {"pixart": 1, "flux": 2}
"""The block classes of each folder's DiT: Flux has double- and single-stream blocks."""
"""Three image sizes, the requests cycling through them."""


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
