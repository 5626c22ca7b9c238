"""Quantized components through torchao: the bytes admission counts, offload, adapters, quality."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from components.accounting import inner_tensors, module_bytes
from components.batch import Batch
from components.libraries import is_importable
from lifecycle.orchestrator import Orchestrator
from lifecycle.spec.reading import decode_spec
from lifecycle.spec.sizes import format_bytes
from tests.components.test_step_cache import psnr
from tests.conftest import Lifecycle

# find_spec, not importorskip: every xdist worker collects this file, and importing
# torchao (with torch's dynamo when nothing imported it yet) costs 0.2-1.3 CPU-s in a
# worker that may run none of these tests; the product imports it when it quantizes.
needs_torchao = pytest.mark.skipif(
    not is_importable("torchao"),
    reason="torchao is not installed: pip install 'pipeline-lifecycle[accel]'",
)
pytestmark = needs_torchao

QUANTIZATIONS = ("int8_weight_only", "int8_dynamic", "float8_weight_only")
FLOOR_DB = {"int8_weight_only": 50.0, "int8_dynamic": 50.0, "float8_weight_only": 40.0}
"""The PSNR of the tiny pipeline's images against float32 each quantization keeps (4 steps,
3 requests; measured 57.6-58.8, 55.4-56.3 and 46.3-47.2 dB)."""
LORA = Path(__file__).resolve().parents[2] / "examples" / "refused" / "weights"


def tiny_t2i(root: Path, folder: Path, transformer: str, target: str = "host") -> str:
    """Return examples/tiny_t2i.toml with ``transformer`` keys on its DiT, offloading to
    ``target`` (disk files under ``folder``)."""
    text = (root / "examples" / "tiny_t2i.toml").read_text()
    text = text.replace('kind = "tiny_dit"\n', f'kind = "tiny_dit"\n{transformer}\n')
    return text.replace(
        'offload_target = "host"', f'offload_target = "{target}"\noffload_dir = "{folder}"'
    )


def images(pipeline: Orchestrator, requests: int = 3) -> list[torch.Tensor]:
    """Run ``requests`` seeded 4-step requests through every stage; return their images."""
    found = []
    for seed in range(requests):
        batch = Batch(generator=torch.Generator().manual_seed(seed), steps=4)
        with pipeline.request(f"r{seed}") as request:
            request.run_all(batch)
        assert batch.images is not None
        found.append(batch.images)
    return found


@pytest.fixture(scope="module")
def float32_images(root: Path, tmp_path_factory: pytest.TempPathFactory) -> list[torch.Tensor]:
    """The tiny pipeline's images, nothing quantized."""
    folder = tmp_path_factory.mktemp("offload")
    with Orchestrator(decode_spec(tiny_t2i(root, folder, ""))) as pipeline:
        pipeline.admit()
        pipeline.load()
        return images(pipeline)


@pytest.fixture
def quantized(root: Path, tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Orchestrator]:
    """A loaded tiny pipeline whose DiT is quantized as the test's parameter says."""
    with Orchestrator(
        decode_spec(tiny_t2i(root, tmp_path, f'quantization = "{request.param}"'))
    ) as pipeline:
        pipeline.admit()
        pipeline.load()
        yield pipeline


class TestQuantized:
    @pytest.mark.parametrize("quantized", QUANTIZATIONS, indirect=True)
    def test_admitted_bytes_are_the_bytes_the_module_holds(self, quantized: Orchestrator) -> None:
        """The bytes admission counts from the shapes equal, to the byte, what the loaded
        module's tensors hold (int8 or float8 data, scales, zero points), and are fewer."""
        planned = quantized.snapshot().components["transformer"].bytes
        module = quantized.module("transformer")
        held = sum(
            inner.numel() * inner.element_size()
            for tensor in (*module.parameters(), *module.buffers())
            for _, inner in inner_tensors(tensor)
        )
        assert planned == held == module_bytes(module)
        assert any(
            inner is not tensor
            for tensor in module.parameters()
            for _, inner in inner_tensors(tensor)
        )

    @pytest.mark.parametrize("quantization", QUANTIZATIONS)
    def test_a_one_column_linear_stays_as_it_is(self, quantization: str) -> None:
        """A DiT reading one latent channel loads quantized (torchao cannot quantize the
        one-column weight of its input layer, which keeps its dtype), and admission counts
        the bytes the module holds."""
        spec = decode_spec(
            f'name = "one-column"\ndevice = "cpu"\n[components.transformer]\nkind = "tiny_dit"\n'
            f'quantization = "{quantization}"\noptions = {{ in_channels = 1 }}\n'
            '[[stages]]\nname = "denoise"\nuses = ["transformer"]\n'
        )
        with Orchestrator(spec) as pipeline:
            pipeline.admit()
            pipeline.load()
            planned = pipeline.snapshot().components["transformer"].bytes
            assert planned == module_bytes(pipeline.module("transformer"))

    @pytest.mark.parametrize("quantized", QUANTIZATIONS, indirect=True)
    def test_images_keep_the_stated_psnr(
        self, quantized: Orchestrator, float32_images: list[torch.Tensor]
    ) -> None:
        """Each quantization's images stay within its stated PSNR of the float32 ones."""
        name = quantized.spec.components["transformer"].quantization_mode
        for image, reference in zip(images(quantized), float32_images, strict=True):
            assert psnr(image, reference) >= FLOOR_DB[name]


class TestOffload:
    def test_disk_offload_of_int8_weights_is_bit_for_bit(self, root: Path, tmp_path: Path) -> None:
        """A quantized DiT offloaded to disk between requests makes the images the one never
        offloaded makes, bit for bit; its file holds the int8 data and the float32 scales,
        and once onloaded from it the budget counts the bytes its tensors hold."""
        keys = 'quantization = "int8_dynamic"'
        with Orchestrator(decode_spec(tiny_t2i(root, tmp_path / "a", keys))) as resident:
            resident.admit()
            resident.load()
            expected = images(resident)
        moved = tiny_t2i(root, tmp_path / "b", keys + '\nresidency = "component_offload"', "disk")
        with Orchestrator(decode_spec(moved)) as offloaded:
            offloaded.admit()
            offloaded.load()
            files = list((tmp_path / "b").rglob("*transformer*.safetensors"))
            assert len(files) == 1
            with safe_open(files[0], "pt") as stored:
                names = stored.keys()  # safe_open is not iterable
                dtypes = {
                    name.rsplit(".", 1)[-1]: stored.get_slice(name).get_dtype() for name in names
                }
            assert dtypes["qdata"] == "I8"
            assert dtypes["scale"] == "F32"
            found = images(offloaded)
            offloaded.onload("transformer")
            held = offloaded.component("transformer").resident_bytes
            planned = offloaded.snapshot().components["transformer"].bytes
            assert held == planned == module_bytes(offloaded.module("transformer"))
        for image, reference in zip(found, expected, strict=True):
            assert torch.equal(image, reference)


class TestAdapters:
    def test_unmerged_adapter_adds_its_delta_on_a_quantized_base(
        self, root: Path, tmp_path: Path
    ) -> None:
        """An unmerged LoRA over an int8 DiT changes its images, and a request without it
        makes the base's images again."""
        text = tiny_t2i(root, tmp_path, 'quantization = "int8_dynamic"')
        text += (
            f'\n[adapters.style]\npath = "{LORA / "dit_mlp_lora.safetensors"}"\nmode = "unmerged"\n'
        )
        with Orchestrator(decode_spec(text)) as pipeline:
            pipeline.admit()
            pipeline.load()
            base = images(pipeline, 1)[0]
            batch = Batch(
                generator=torch.Generator().manual_seed(0), steps=4, adapters=[{"style": 1.0}]
            )
            with pipeline.request("styled") as request:
                request.run_all(batch)
            assert batch.images is not None
            assert not torch.equal(batch.images, base)
            assert torch.equal(images(pipeline, 1)[0], base)


class TestReports:
    def test_run_json_and_the_summary_give_compile_quantization_and_bytes(
        self, lifecycle: Lifecycle, root: Path, tmp_path: Path
    ) -> None:
        """run --json's summary gives each component's compile, quantization and bytes as
        admission counted them (the int8 transformer's data and scales), and the printed
        summary shows the three on the transformer's row."""
        spec = tmp_path / "spec.toml"
        spec.write_text(tiny_t2i(root, tmp_path / "offload", 'quantization = "int8_weight_only"'))
        done = lifecycle("run", spec, "--json", "--requests", "1", "--steps", "2")
        assert done.returncode == 0, done.stderr
        result = json.loads(done.stdout)
        keys = ("compile", "quantization", "bytes")
        reported = {n: [c[k] for k in keys] for n, c in result["summary"]["components"].items()}
        planned = {n: [c[k] for k in keys] for n, c in result["snapshot"]["components"].items()}
        assert reported == planned
        assert reported["transformer"][:2] == ["off", "int8_weight_only"]
        printed = lifecycle("run", spec, "--requests", "1", "--steps", "2")
        assert printed.returncode == 0, printed.stderr
        lines = printed.stdout.splitlines()
        assert lines[1].split()[-2:] == ["compile", "quantization"]
        row = next(line for line in lines if line.split()[0] == "transformer")
        assert row.split()[-2:] == ["off", "int8_weight_only"]
        assert f" {format_bytes(reported['transformer'][2])} " in row
