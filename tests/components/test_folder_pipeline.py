"""Reading a pipeline folder: its recipe and kinds, what is refused, what is bad input."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import ClassVar

import pytest

from components import registry
from components.folders.index import PipelineIndex
from components.folders.loader import FolderLoader
from components.folders.problems import Problem
from components.recipes.folder import FolderPipeline, kind_for_class
from components.weights import read_header, stored_bytes
from tests.blocked_imports import blocking
from tests.components.folder_runs import KINDS
from tests.conftest import PipelineFolders
from tests.processes import run_python


def edited(folder: Path, into: Path, **entries: object) -> Path:
    """Copy ``folder`` into ``into`` with ``model_index.json`` entries replaced."""
    copy = shutil.copytree(folder, into / folder.name)
    index = copy / "model_index.json"
    index.write_text(json.dumps({**json.loads(index.read_text()), **entries}))
    return copy


class TestRead:
    """A folder's components, kinds and options come from its index and subfolders."""

    @pytest.mark.parametrize("family", list(KINDS))
    def test_components_and_kinds(self, family: str, pipeline_folder: PipelineFolders) -> None:
        """Each component's kind is found from its class; text encoders own their tokenizer."""
        folder = pipeline_folder(family)
        pipeline = FolderPipeline.read(folder)
        assert pipeline.problems == []
        assert pipeline.recipe is not None
        assert pipeline.recipe.pipeline_class == pipeline.model_index.pipeline_class
        assert {name: plan.kind for name, plan in pipeline.components.items()} == KINDS[family]
        assert [stage.name for stage in pipeline.recipe.stages] == ["encode", "denoise", "decode"]
        encoder = pipeline.components["text_encoder"].options
        assert encoder["path"] == str(folder / "text_encoder")
        assert encoder["tokenizer"] == str(folder / "tokenizer")
        assert encoder["tokenizer_class"] == pipeline.model_index.entries["tokenizer"].class_name

    def test_null_entries_are_absent(self, pipeline_folder: PipelineFolders) -> None:
        """``[null, null]`` marks a component the folder lacks (Flux's image encoder)."""
        index = PipelineIndex.read(pipeline_folder("flux"))
        assert "image_encoder" not in index.entries
        assert index.entries["vae"].library == "diffusers"


class TestRefused:
    """Folders that are whole but cannot be run are problems with their code, all reported."""

    def test_unsupported_pipeline_class(
        self, pipeline_folder: PipelineFolders, tmp_path: Path
    ) -> None:
        """A pipeline class with no recipe is named with the supported ones."""
        folder = edited(pipeline_folder("sd3"), tmp_path, _class_name="StableDiffusionXLPipeline")
        pipeline = FolderPipeline.read(folder)
        assert pipeline.recipe is None
        assert pipeline.problems == [
            Problem(
                "pipeline.unsupported_class",
                "pipeline",
                "pipeline class 'StableDiffusionXLPipeline' has no recipe here; supported: "
                "PixArtAlphaPipeline, PixArtSigmaPipeline, FluxPipeline, StableDiffusion3Pipeline, "
                "QwenImagePipeline, ZImagePipeline, Flux2KleinPipeline, "
                "WanPipeline, WanImageToVideoPipeline",
                "use a folder of a supported pipeline class",
            )
        ]

    def test_an_edit_pipeline_names_the_package_it_needs(
        self, pipeline_folder: PipelineFolders, tmp_path: Path
    ) -> None:
        """Qwen-Image's edit pipeline is refused at read, naming torchvision, never at load."""
        folder = edited(
            pipeline_folder("qwen-image"), tmp_path, _class_name="QwenImageEditPipeline"
        )
        pipeline = FolderPipeline.read(folder)
        assert pipeline.recipe is None
        (problem,) = pipeline.problems
        assert problem.code == "pipeline.unsupported_class"
        assert "'QwenImageEditPipeline' has no recipe here (its image processor needs " in (
            problem.message
        )
        assert "torchvision, which is not a dependency)" in problem.message

    def test_code_in_the_folder_is_never_imported(
        self, pipeline_folder: PipelineFolders, tmp_path: Path
    ) -> None:
        """An entry naming a module shipped in the folder is refused, not imported."""
        folder = edited(pipeline_folder("flux"), tmp_path, transformer=["my_dit", "MyDit"])
        (folder / "transformer" / "my_dit.py").write_text("raise SystemExit('imported!')\n")
        (problem,) = FolderPipeline.read(folder).problems
        assert problem.code == "pipeline.custom_code"
        assert problem.component == "transformer"
        assert "takes 'transformer' (MyDit) from module 'my_dit'" in problem.message

    def test_a_class_no_kind_loads(self, pipeline_folder: PipelineFolders, tmp_path: Path) -> None:
        """A component class no kind claims names the entry-point group that adds one."""
        folder = edited(pipeline_folder("flux"), tmp_path, vae=["diffusers", "AutoencoderTiny"])
        (problem,) = FolderPipeline.read(folder).problems
        assert problem == Problem(
            "pipeline.unsupported_class",
            "vae",
            "no component kind loads class 'AutoencoderTiny' of 'vae'",
            "install a package whose kind lists 'AutoencoderTiny' in ComponentLoader.classes, "
            "registered through the entry-point group 'pipeline_lifecycle.kinds'",
        )

    def test_pickled_weights(self, pipeline_folder: PipelineFolders, tmp_path: Path) -> None:
        """A component whose weights are only pickled is refused, naming the file."""
        folder = shutil.copytree(pipeline_folder("pixart"), tmp_path / "pixart")
        weights = folder / "vae" / "diffusion_pytorch_model.safetensors"
        weights.rename(weights.with_suffix(".bin"))
        (problem,) = FolderPipeline.read(folder).problems
        assert problem.code == "loader.unsafe_weights"
        assert problem.component == "vae"
        assert "(diffusion_pytorch_model.bin)" in problem.message


class TestBadInput:
    """A missing or malformed path is an exception naming it (the CLI's exit 2)."""

    def test_missing_subfolder(self, pipeline_folder: PipelineFolders, tmp_path: Path) -> None:
        """A subfolder the index lists but the folder lacks is named."""
        folder = shutil.copytree(pipeline_folder("sd3"), tmp_path / "sd3")
        shutil.rmtree(folder / "text_encoder_2")
        with pytest.raises(FileNotFoundError, match=r"text_encoder_2 does not exist, but model_"):
            FolderPipeline.read(folder)

    def test_missing_weights(self, pipeline_folder: PipelineFolders, tmp_path: Path) -> None:
        """A component folder without weights is named with the files looked for."""
        folder = shutil.copytree(pipeline_folder("sd3"), tmp_path / "sd3")
        (folder / "vae" / "diffusion_pytorch_model.safetensors").unlink()
        with pytest.raises(FileNotFoundError, match=r"vae holds no weights: expected diffusion_"):
            FolderPipeline.read(folder)

    def test_not_a_pipeline_folder(self, tmp_path: Path) -> None:
        """A folder without model_index.json says what a pipeline folder holds."""
        with pytest.raises(FileNotFoundError, match=r"a pipeline folder holds a model_index\.json"):
            FolderPipeline.read(tmp_path)

    def test_malformed_entry(self, pipeline_folder: PipelineFolders, tmp_path: Path) -> None:
        """An entry that is not a [library, class] pair is named."""
        folder = edited(pipeline_folder("sd3"), tmp_path, vae="AutoencoderKL")
        with pytest.raises(ValueError, match="entry 'vae' is \"AutoencoderKL\"; expected"):
            FolderPipeline.read(folder)


class PluginTransformer(FolderLoader):
    """A kind an installed package could add for a class the project does not know."""

    kind: ClassVar[str] = "plugin_transformer"
    library = "diffusers"
    classes = ("PluginTransformer2DModel",)


@pytest.fixture
def plugin_kind() -> Iterator[type[FolderLoader]]:
    """Register ``PluginTransformer`` for one test."""
    registry.register_kind(PluginTransformer)
    yield PluginTransformer
    registry.unregister_kind(PluginTransformer.kind)


class TestClaimedClasses:
    """A kind claims the library classes it loads; a package's kind can claim more."""

    def test_builtin_classes(self) -> None:
        """Every class design §12 names maps to its kind."""
        assert {
            name: kind_for_class(name)
            for name in (
                "T5EncoderModel",
                "CLIPTextModel",
                "CLIPTextModelWithProjection",
                "PixArtTransformer2DModel",
                "FluxTransformer2DModel",
                "SD3Transformer2DModel",
                "AutoencoderKL",
                "UNet2DConditionModel",
            )
        } == {
            "T5EncoderModel": "t5_encoder",
            "CLIPTextModel": "clip_text_encoder",
            "CLIPTextModelWithProjection": "clip_text_encoder",
            "PixArtTransformer2DModel": "pixart_transformer",
            "FluxTransformer2DModel": "flux_transformer",
            "SD3Transformer2DModel": "sd3_transformer",
            "AutoencoderKL": "autoencoder_kl",
            "UNet2DConditionModel": None,
        }

    def test_a_registered_kind_claims_its_class(
        self, plugin_kind: type[FolderLoader], pipeline_folder: PipelineFolders, tmp_path: Path
    ) -> None:
        """A folder whose transformer is a class only a registered kind loads is read with it."""
        folder = edited(
            pipeline_folder("flux"),
            tmp_path,
            transformer=["diffusers", "PluginTransformer2DModel"],
        )
        pipeline = FolderPipeline.read(folder)
        assert pipeline.problems == []
        assert pipeline.components["transformer"].kind == "plugin_transformer"


WITHOUT_LIBRARIES = (
    blocking("diffusers", "transformers")
    + """
import sys

from pathlib import Path

import torch

from attention import ComponentRequests, arm_layers, component_attention_scope
from components import registry
from components.recipes.folder import FolderPipeline

folder = Path(sys.argv[1])
pipeline = FolderPipeline.read(folder)
print(sorted(plan.kind for plan in pipeline.components.values()))
loaders = {
    name: registry.get(plan.kind).from_options(plan.options)
    for name, plan in pipeline.components.items()
    if name in ("vae", "text_encoder")
}
vae = loaders["vae"]
print(vae.unavailable_reason("native"))
print(vae.unavailable_reason("custom"), len(vae.tensors()), vae.declared_bytes())
built = {}
for name, loader in loaders.items():
    with component_attention_scope(ComponentRequests(component=name)):
        built[name] = loader.build("custom")
    arm_layers(built[name])
print(tuple(vae.decode(built["vae"], torch.zeros(1, 4, 4, 4)).shape))
print(tuple(built["text_encoder"](torch.tensor([[5, 6, 1]])).shape))
assert "diffusers" not in sys.modules and "transformers" not in sys.modules
"""
)


class TestOptionalLibraries:
    """Without diffusers and transformers, folders are read and sized, and custom paths run."""

    def test_read_and_sized_without_the_libraries(
        self, pipeline_folder: PipelineFolders, root: Path
    ) -> None:
        """Kinds from the index, bytes from headers, custom paths built and run; native names
        the extra."""
        folder = pipeline_folder("pixart")
        result = run_python(WITHOUT_LIBRARIES, folder, cwd=root)
        assert result.returncode == 0, result.stderr
        weights = folder / "vae" / "diffusion_pytorch_model.safetensors"
        assert result.stdout.splitlines() == [
            "['autoencoder_kl', 'pixart_transformer', 't5_encoder']",
            "the diffusers package is not installed (pip install 'pipeline-lifecycle[diffusers]')",
            f"None {len(read_header(weights))} {stored_bytes(weights)}",
            "(1, 3, 32, 32)",
            "(1, 3, 64)",
        ]


LOAD_PEAK = """
import sys
from pathlib import Path

import torch

from components import registry

STATUS = Path("/proc/self/status")


def peak() -> int:
    # VmHWM, not getrusage's ru_maxrss: that one starts at the parent's peak (the pytest
    # process, kept across fork and exec), which would hide the load
    line = next(l for l in STATUS.read_text().splitlines() if l.startswith("VmHWM:"))
    return int(line.split()[1]) * 1024


loader = registry.get("t5_encoder").from_options({"path": sys.argv[1]})
loader.declared_bytes()  # reads headers, builds on meta once
if sys.argv[2] == "native":
    loader.model_class()  # transformers' T5 imports ~140 MiB of modules: not the load's
Path("/proc/self/clear_refs").write_text("5")  # the peak starts afresh here
before = peak()
module = loader.build(sys.argv[2])
touched = sum(float(p.sum()) for p in module.parameters())  # every page of every weight
print(peak() - before, loader.declared_bytes())
"""
RSS_SLACK = 64 * 2**20
"""What a load may take besides its weights (the meta build, Python objects, allocator).

Measured with transformers 5.24: its own load of this T5 takes 48-57 MiB besides the
weights, ours 2-4 MiB. A second copy (121 MiB) still cannot hide under it."""


@pytest.fixture(scope="module")
def large_t5(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A T5 encoder of 121 MiB, saved once for both loading paths (they only read it)."""
    from transformers import T5Config, T5EncoderModel
    from transformers.initialization import no_init_weights

    config = T5Config(d_model=512, d_kv=64, d_ff=2048, num_layers=10, num_heads=8, vocab_size=512)
    folder = tmp_path_factory.mktemp("large") / "t5"
    # the tests read the weights' pages, never their values: one constant (finite, as a
    # load requires), not transformers' 32 M random draws (0.48 -> 0.09 CPU-s)
    with no_init_weights():
        model = T5EncoderModel(config)
    model.tie_weights()  # which skipping the initialisers skips too: the file stores one copy
    for parameter in model.parameters():
        parameter.detach().fill_(0.01)
    model.save_pretrained(str(folder))
    return folder


class TestOneCopy:
    """A load holds one copy of the weights: the mapped file's pages."""

    @pytest.mark.parametrize("path", ["native", "custom"])
    def test_peak_memory_stays_within_the_weights(
        self, large_t5: Path, root: Path, path: str
    ) -> None:
        """Peak RSS grows by the weights' size and a small constant, never twice the weights."""
        result = run_python(LOAD_PEAK, large_t5, path, cwd=root)
        assert result.returncode == 0, result.stderr
        grown, weights = map(int, result.stdout.split())
        assert weights > 100 * 2**20  # large enough that a second copy could not hide
        assert 0.9 * weights < grown < weights + RSS_SLACK
