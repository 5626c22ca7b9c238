"""Folder kinds: admission's answers from config and headers equal what the load builds."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from components import registry
from components.accounting import module_bytes
from components.folders.files import UnsafeWeightsError, weight_files
from components.folders.loader import FolderLoader
from components.loader import PathUnavailable
from components.recipes.folder import FolderPipeline
from tests.conftest import PipelineFolders

pytestmark = pytest.mark.usefixtures("one_thread")

COMPONENTS = [
    ("pixart", "text_encoder", "t5_encoder"),
    ("pixart", "transformer", "pixart_transformer"),
    ("pixart", "vae", "autoencoder_kl"),
    ("flux", "text_encoder", "clip_text_encoder"),
    ("flux", "transformer", "flux_transformer"),
    ("sd3", "text_encoder_2", "clip_text_encoder"),
    ("sd3", "transformer", "sd3_transformer"),
    ("wan-i2v", "text_encoder", "umt5_encoder"),
    ("wan-i2v", "image_encoder", "clip_vision_encoder"),
    ("wan-i2v", "transformer", "wan_transformer"),
    ("wan-i2v", "vae", "autoencoder_kl_wan"),
    ("wan-ti2v", "vae", "autoencoder_kl_wan"),
]


def loader_of(folder: Path, name: str) -> FolderLoader:
    """Return the loader of component ``name`` of the pipeline ``folder``."""
    loader = FolderPipeline.read(folder).loaders()[name]
    assert isinstance(loader, FolderLoader)
    return loader


def copy_component(folder: Path, name: str, into: Path) -> Path:
    """Copy component ``name`` of ``folder`` into ``into`` and return the copy."""
    return shutil.copytree(folder / name, into / name)


class TestDeclarations:
    """Tensors, bytes and blocks declared without loading equal what the native path loads."""

    @pytest.mark.parametrize(("family", "name", "kind"), COMPONENTS)
    def test_declaration_equals_the_loaded_module(
        self, family: str, name: str, kind: str, pipeline_folder: PipelineFolders
    ) -> None:
        """Names, shapes, bytes and block count from the meta build and headers fit the load."""
        loader = loader_of(pipeline_folder(family), name)
        assert loader.kind == kind
        module = loader.build("native")
        declared = loader.tensors()
        assert declared is not None
        state = module.state_dict()
        assert {n: tuple(t.shape) for n, t in state.items() if n in declared} == {
            n: t.shape for n, t in declared.items()
        }
        assert loader.weight_problems() == []
        assert loader.declared_bytes() == module_bytes(module)
        blocks = loader.blocks(module)
        assert (None if blocks is None else len(blocks)) == loader.block_count()

    @pytest.mark.parametrize(("family", "name", "kind"), COMPONENTS)
    def test_load_equals_the_library_load(
        self, family: str, name: str, kind: str, pipeline_folder: PipelineFolders
    ) -> None:
        """Every parameter and buffer equals what the library's own from_pretrained loads."""
        loader = loader_of(pipeline_folder(family), name)
        ours = loader.build("native")
        theirs = loader.model_class().from_pretrained(str(loader.folder))  # type: ignore[attr-defined]
        for held in ("named_parameters", "named_buffers"):
            mine, library = dict(getattr(ours, held)()), dict(getattr(theirs, held)())
            assert mine.keys() == library.keys()
            assert all(torch.equal(mine[n], library[n]) for n in mine), held

    def test_tied_weights_are_declared_once(self, pipeline_folder: PipelineFolders) -> None:
        """T5's embedding is one tensor under two names; the file stores it once, as loaded."""
        loader = loader_of(pipeline_folder("pixart"), "text_encoder")
        assert loader.layout is not None
        assert loader.layout.expected.aliases == {"encoder.embed_tokens.weight": "shared.weight"}
        module = loader.build("native")
        assert module.get_submodule("encoder.embed_tokens").weight is module.shared.weight

    def test_a_native_load_of_a_known_folder_declares_nothing_again(
        self, pipeline_folder: PipelineFolders
    ) -> None:
        """A second loader of a folder takes the library layout the first one declared
        (names renamed once per process), and its native build loads the same tensors."""
        first = loader_of(pipeline_folder("flux"), "text_encoder")
        second = loader_of(pipeline_folder("flux"), "text_encoder")
        assert first.library_layout is not None
        assert second.library_layout is first.library_layout
        ours, again = first.build("native"), second.build("native")
        assert ours is not again
        assert ours.state_dict().keys() == again.state_dict().keys()
        assert all(torch.equal(t, again.state_dict()[n]) for n, t in ours.state_dict().items())

    def test_the_meta_build_holds_no_weights(self, pipeline_folder: PipelineFolders) -> None:
        """Parameters are built on meta; computed buffers are real (PixArt's position table)."""
        loader = loader_of(pipeline_folder("pixart"), "transformer")
        module = loader.empty()
        assert {p.device.type for p in module.parameters()} == {"meta"}
        assert {b.device.type for b in module.buffers()} == {"cpu"}

    def test_the_meta_build_keeps_buffers_real_under_a_meta_device(
        self, pipeline_folder: PipelineFolders
    ) -> None:
        """Built inside an enclosing ``torch.device("meta")`` (admission's), computed buffers
        are real as well, and equal the plain build's."""
        loader = loader_of(pipeline_folder("pixart"), "transformer")
        with torch.device("meta"):
            module = loader.empty()
        assert {p.device.type for p in module.parameters()} == {"meta"}
        plain = dict(loader.empty().named_buffers())
        assert {n: b.device.type for n, b in module.named_buffers()} == dict.fromkeys(plain, "cpu")
        assert all(torch.equal(b, plain[n]) for n, b in module.named_buffers())

    def test_the_load_maps_the_file(self, pipeline_folder: PipelineFolders) -> None:
        """A float32 load keeps the tensors safetensors maps: their bytes are the file's."""
        loader = loader_of(pipeline_folder("flux"), "vae")
        module = loader.build("native")
        (path,) = weight_files(loader.folder)
        stored = load_file(path)
        assert all(torch.equal(stored[n], t) for n, t in module.state_dict().items())
        assert all(not p.requires_grad for p in module.parameters())


class TestDtype:
    """A component loads in the dtype asked for, sized for it before loading."""

    def test_bfloat16_halves_the_weights(self, pipeline_folder: PipelineFolders) -> None:
        """In bfloat16 every floating weight is bfloat16, and the declared bytes say so."""
        loader = loader_of(pipeline_folder("sd3"), "transformer")
        float32 = loader.declared_bytes()
        loader.dtype = torch.bfloat16
        module = loader.build("native")
        assert {p.dtype for p in module.parameters()} == {torch.bfloat16}
        assert loader.declared_bytes() == module_bytes(module) < float32

    def test_float16_keeps_t5_feed_forward_outputs_in_float32(
        self, pipeline_folder: PipelineFolders
    ) -> None:
        """T5's ``wo`` layers stay float32 in float16, as transformers keeps them."""
        loader = loader_of(pipeline_folder("flux"), "text_encoder_2")
        loader.dtype = torch.float16
        module = loader.build("native")
        kept = {n for n, p in module.named_parameters() if p.dtype == torch.float32}
        assert kept == {n for n, _ in module.named_parameters() if ".wo." in n}
        assert loader.declared_bytes() == module_bytes(module)


class TestWeightFiles:
    """Weights are safetensors, sharded or not, held to the class from their headers."""

    def test_sharded_weights_load_like_one_file(
        self, pipeline_folder: PipelineFolders, tmp_path: Path
    ) -> None:
        """A sharded index is followed: the same tensors, bytes and module as one file."""
        from diffusers import FluxTransformer2DModel

        whole = loader_of(pipeline_folder("flux"), "transformer")
        folder = tmp_path / "transformer"
        FluxTransformer2DModel.from_pretrained(str(whole.folder)).save_pretrained(
            str(folder), max_shard_size="200KB"
        )
        sharded = registry.get("flux_transformer").from_options({"path": str(folder)})
        assert isinstance(sharded, FolderLoader)
        assert len(weight_files(folder)) > 1
        assert sharded.weight_problems() == []
        assert sharded.declared_bytes() == whole.declared_bytes()
        expected = whole.build("native").state_dict()
        assert all(
            torch.equal(expected[n], t) for n, t in sharded.build("native").state_dict().items()
        )

    def test_wrong_shape_and_missing_tensor_are_named(
        self, pipeline_folder: PipelineFolders, tmp_path: Path
    ) -> None:
        """Headers alone show a tensor of another shape and one that is missing."""
        folder = copy_component(pipeline_folder("sd3"), "vae", tmp_path)
        (path,) = weight_files(folder)
        tensors = load_file(path)
        tensors["decoder.conv_in.bias"] = torch.zeros(3)
        del tensors["decoder.conv_out.weight"]
        save_file(tensors, path)
        loader = registry.get("autoencoder_kl").from_options({"path": str(folder)})
        assert isinstance(loader, FolderLoader)
        assert loader.weight_problems() == [
            "missing 'decoder.conv_out.weight'",
            "'decoder.conv_in.bias' has shape [3], the kind declares [8]",
        ]

    def test_pickled_weights_are_never_read(
        self, pipeline_folder: PipelineFolders, tmp_path: Path
    ) -> None:
        """A component whose only weights are a .bin file is refused, naming the file."""
        folder = copy_component(pipeline_folder("sd3"), "vae", tmp_path)
        (path,) = weight_files(folder)
        path.rename(folder / "diffusion_pytorch_model.bin")
        loader = registry.get("autoencoder_kl").from_options({"path": str(folder)})
        with pytest.raises(UnsafeWeightsError, match=r"only as pickled files \(diffusion_py"):
            loader.declared_bytes()
        assert "only safetensors are read" in str(loader.unavailable_reason("native"))


class TestPaths:
    """The native path says why it cannot build."""

    def test_a_class_of_another_kind_is_named(self, pipeline_folder: PipelineFolders) -> None:
        """A class the kind does not load is refused, naming the classes it does."""
        folder = pipeline_folder("flux") / "text_encoder"
        loader = registry.get("t5_encoder").from_options(
            {"path": str(folder), "class_name": "CLIPTextModel"}
        )
        assert loader.unavailable_reason("native") == (
            "kind 't5_encoder' loads T5EncoderModel, not 'CLIPTextModel'"
        )
        with pytest.raises(PathUnavailable, match="loads T5EncoderModel"):
            loader.build("native")

    def test_weights_option_is_refused(self) -> None:
        """A folder component's weights are its folder's files; ``weights`` is bad input."""
        with pytest.raises(ValueError, match=r"drop options\.weights"):
            registry.get("autoencoder_kl").from_options({"path": "x", "weights": "y.safetensors"})

    def test_missing_config_is_named(self, tmp_path: Path) -> None:
        """A folder without config.json says so through the native path's reason."""
        loader = registry.get("autoencoder_kl").from_options({"path": str(tmp_path)})
        assert loader.unavailable_reason("native") == (
            f"{tmp_path / 'config.json'} does not exist: a component folder holds its config"
        )


class TestCheckpointNames:
    """Tensors stored under a library's older names load under today's."""

    def test_clip_saved_with_its_text_model_prefix_loads(
        self, pipeline_folder: PipelineFolders, tmp_path: Path
    ) -> None:
        """transformers 4.x wrote CLIPTextModel's tensors under text_model.: they still load."""
        folder = copy_component(pipeline_folder("flux"), "text_encoder", tmp_path)
        (path,) = weight_files(folder)
        save_file({f"text_model.{n}": t for n, t in load_file(path).items()}, path)
        config = json.loads((folder / "config.json").read_text())
        assert config["architectures"] == ["CLIPTextModel"]
        old = registry.get("clip_text_encoder").from_options({"path": str(folder)})
        new = loader_of(pipeline_folder("flux"), "text_encoder")
        assert old.weight_problems() == []
        expected = new.build("native").state_dict()
        assert all(torch.equal(expected[n], t) for n, t in old.build("native").state_dict().items())
