"""Pipeline folders as the Hub ships them: extra files ignored, pickles never read, variants.

Each family's tiny folder is laid out as its hub repository is (``tests.hub_layout``): a
README and ``.gitattributes``, a pickled ``.bin`` beside every safetensors file (one that
raises if it is ever unpickled), ``fp16`` variant files holding other values, and the
transformer's variant in two shards under an index. The image proves which files were
read: the variant's make another image than the full files.
"""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from attention import Platform
from benchmarks.make_pipeline import Family
from lifecycle.config import decode_spec
from lifecycle.orchestrator import Orchestrator
from tests.components.folder_runs import Request, batch_of, call_pipeline
from tests.conftest import Lifecycle, PipelineFolders
from tests.hub_layout import POISON, hub_folder
from tests.lifecycle.folder_specs import REQUESTS

pytestmark = pytest.mark.usefixtures("one_thread")

FAMILIES: tuple[Family, ...] = ("pixart", "flux", "sd3")
TOLERANCE = 1e-5
"""Largest absolute pixel difference (images in [0, 1], float32, CPU) from diffusers."""


@pytest.fixture(scope="module")
def hub(pipeline_folder: PipelineFolders, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder holding each family's tiny folder laid out as its hub repository."""
    root = tmp_path_factory.mktemp("hub")
    for family in FAMILIES:
        hub_folder(pipeline_folder(family), root / family)
    return root


def ours(spec_text: str, request: Request, cpu: Platform) -> torch.Tensor:
    """Return the image of ``request`` through the orchestrator of ``spec_text``, in [0, 1]."""
    batch = batch_of(request)
    with Orchestrator(decode_spec(spec_text), platform=cpu) as orchestrator:
        orchestrator.load()
        with orchestrator.request() as running:
            running.run_all(batch)
    assert batch.images is not None
    return (batch.images / 2 + 0.5).clamp(0, 1)


def diffusers_image(folder: Path, request: Request, variant: str | None) -> torch.Tensor:
    """Return diffusers' image of ``request`` from ``folder``'s ``variant`` files."""
    from diffusers import DiffusionPipeline

    pipeline = DiffusionPipeline.from_pretrained(str(folder), variant=variant)
    return call_pipeline(pipeline, request, negative_prompt=request.negative_prompt)


class TestAsShipped:
    @pytest.mark.parametrize("family", FAMILIES)
    def test_the_full_files_or_the_variant_make_diffusers_image(
        self, family: Family, hub: Path, cpu: Platform
    ) -> None:
        """Without a variant the full safetensors are read, with ``variant = "fp16"`` the
        variant's (sharded for the transformer): each image equals diffusers' from the same
        files, and the two differ; the README, ``.gitattributes`` and pickles are ignored."""
        folder, request = hub / family, REQUESTS[family]
        full = ours(f'source = "{folder}"\ndevice = "cpu"\n', request, cpu)
        variant = ours(f'source = "{folder}"\ndevice = "cpu"\nvariant = "fp16"\n', request, cpu)
        assert (full - diffusers_image(folder, request, None)).abs().max() <= TOLERANCE
        assert (variant - diffusers_image(folder, request, "fp16")).abs().max() <= TOLERANCE
        assert (full - variant).abs().max() > 0.05

    def test_the_pickles_beside_them_would_fail_loudly(self, hub: Path) -> None:
        """Each ``.bin`` of the layout raises when unpickled: a load that read one could not
        have made the images above."""
        pickles = sorted(hub.glob("*/*/*.bin"))
        assert len(pickles) == 3 + 4 + 5  # every component of the three families
        for path in pickles:
            with pytest.raises(RuntimeError, match=POISON):
                pickle.loads(path.read_bytes())

    def test_a_component_reads_its_own_variant(self, hub: Path, cpu: Platform) -> None:
        """``[components.X.options] variant`` applies to that component alone: the
        transformer holds its fp16 shards' values, the VAE its full file's."""
        folder = hub / "pixart"
        spec = decode_spec(
            f'source = "{folder}"\ndevice = "cpu"\n'
            '[components.transformer.options]\nvariant = "fp16"\n'
        )
        assert "variant" not in spec.components["vae"].options
        index = json.loads(
            (
                folder / "transformer" / "diffusion_pytorch_model.safetensors.index.fp16.json"
            ).read_text()
        )
        shards = {}
        for shard in set(index["weight_map"].values()):
            shards.update(load_file(folder / "transformer" / shard))
        vae = load_file(folder / "vae" / "diffusion_pytorch_model.safetensors")
        assert len(shards) > 1
        assert vae
        with Orchestrator(spec, platform=cpu) as orchestrator:
            orchestrator.load()
            held = orchestrator.module("transformer").state_dict()
            assert all(torch.equal(held[n], t.float()) for n, t in shards.items())
            held = orchestrator.module("vae").state_dict()
            assert all(torch.equal(held[n], t) for n, t in vae.items())


class TestRefused:
    def test_a_variant_a_component_lacks_is_refused_naming_its_files(
        self, hub: Path, lifecycle: Lifecycle, tmp_path: Path
    ) -> None:
        """``variant = "bf16"`` where the folders have fp16 and full files only: check
        refuses each component with ``loader.unavailable``, naming the files it has and the
        variants to ask for; nothing is read from the other files."""
        spec = tmp_path / "spec.toml"
        spec.write_text(f'source = "{hub / "pixart"}"\nvariant = "bf16"\n')
        result = lifecycle("check", "--json", spec)
        assert result.returncode == 1
        refusals = {r["component"]: r for r in json.loads(result.stdout)["refusals"]}
        assert sorted(refusals) == ["text_encoder", "transformer", "vae"]
        vae = refusals["vae"]
        assert (vae["code"], vae["message"], vae["hint"]) == (
            "loader.unavailable",
            f"{hub / 'pixart' / 'vae'} has no bf16 variant of its weights: its weights files "
            "are diffusion_pytorch_model.bin, diffusion_pytorch_model.fp16.safetensors, "
            "diffusion_pytorch_model.safetensors",
            "'vae' has variant \"fp16\" or no variant: set variant to one it has (at top level "
            "for every component, in [components.vae.options] for it alone), or leave both "
            "unset to read its files without one",
        )

    def test_variant_files_alone_need_a_variant(
        self, hub: Path, lifecycle: Lifecycle, tmp_path: Path
    ) -> None:
        """A component whose folder holds only variant files is refused when no variant is
        asked for (never read from them unasked); asking for it admits the pipeline."""
        folder = tmp_path / "pixart"
        folder.symlink_to(hub / "pixart", target_is_directory=True)
        vae = tmp_path / "vae"
        (tmp_path / "vae").mkdir()
        for name in ("config.json", "diffusion_pytorch_model.fp16.safetensors"):
            (vae / name).symlink_to(hub / "pixart" / "vae" / name)
        spec = tmp_path / "spec.toml"
        spec.write_text(f'source = "{folder}"\n[components.vae.options]\npath = "{vae}"\n')
        result = lifecycle("check", "--json", spec)
        assert result.returncode == 1
        (refusal,) = json.loads(result.stdout)["refusals"]
        assert refusal["message"] == (
            f"{vae} holds its weights only in variant files "
            "(diffusion_pytorch_model.fp16.safetensors)"
        )
        assert refusal["hint"].startswith("'vae' has variant \"fp16\": set variant to one it")
        spec.write_text(spec.read_text() + 'variant = "fp16"\n')
        assert lifecycle("check", spec).returncode == 0

    def test_variant_without_source_is_bad_input(
        self, lifecycle: Lifecycle, tmp_path: Path, root: Path
    ) -> None:
        """A top-level ``variant`` in a spec of kinds (no folder) is a ConfigError at its key."""
        spec = tmp_path / "spec.toml"
        spec.write_text('variant = "fp16"\n' + (root / "examples" / "tiny_t2i.toml").read_text())
        result = lifecycle("check", spec)
        assert result.returncode == 2
        assert result.stderr.endswith(
            "Expected no variant without source: it picks the weight files of a pipeline "
            "folder's components; name the folder with source, or set a folder component's "
            "own in [components.NAME.options] - at `$.variant`\n"
        )
