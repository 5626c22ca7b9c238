"""The DiTs' custom paths: diffusers' tensors loaded as they are, equal to diffusers' class."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from attention import (
    AttentionRole,
    BackendChoice,
    ComponentRequests,
    Platform,
    Provenance,
    arm_layers,
    component_attention_scope,
)
from components import registry
from components.accounting import module_bytes
from components.folders.files import weight_files
from components.folders.meta import build_empty, expected_tensors
from components.kinds.dit_loader import DitLoader
from components.loader import PathUnavailable
from components.models.dit.base import PackedTransformer
from components.offload.disk import DiskStore
from components.offload.layerwise import LayerwiseStore
from tests.blocked_imports import blocking
from tests.components.dit_inputs import KINDS, MIXED, group_of, mixed_groups
from tests.conftest import PipelineFolders
from tests.processes import run_python

pytestmark = pytest.mark.usefixtures("one_thread")

TOLERANCE = 1e-5
"""Float32: max |custom - native| / max |native| (measured about 3e-7)."""
BFLOAT16_TOLERANCE = 3e-2
"""bfloat16, the same measure (measured 4e-3 to 1.3e-2): both round to 8 bits of mantissa at
different points (the custom path keeps adaLN and rotary products in float32 longer)."""
FAMILIES = list(KINDS)
CROSS = ("pixart", "wan")
"""The families whose DiT attends to its text apart (site ``cross``)."""
# the backends each site admits: packed self-attention needs a varlen kernel
PACKED_BACKENDS = ["torch_flash", "reference"]
DENSE_BACKENDS = ["torch_sdpa", "torch_flash", "reference"]


def loader_of(folder: Path, family: str, **options: Any) -> DitLoader:
    """Return the DiT loader of a pipeline folder, with ``options`` added."""
    loader = registry.get(KINDS[family]).from_options(
        {"path": str(folder / "transformer"), **options}
    )
    assert isinstance(loader, DitLoader)
    return loader


def build(loader: DitLoader, backend: str | None = None) -> nn.Module:
    """Build the custom path in its scope (``backend`` explicit for every site), armed."""
    requests = ComponentRequests(
        component="transformer",
        component_backend=None
        if backend is None
        else BackendChoice(name=backend, provenance=Provenance.EXPLICIT),
    )
    with component_attention_scope(requests, platform=Platform("cpu")):
        module = loader.build("custom")
    arm_layers(module)
    return module


def relative(got: torch.Tensor, want: torch.Tensor) -> float:
    """Return max |got - want| / max |want|."""
    return ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()


def native_outputs(native: nn.Module, groups: list[Any]) -> list[torch.Tensor]:
    """Run diffusers' class on each group alone (Z-Image's list of images stacked, as the
    custom path returns them)."""
    with torch.inference_mode():
        outputs = [native(**group._asdict(), return_dict=False)[0] for group in groups]
    return [torch.stack(out) if isinstance(out, list) else out for out in outputs]


def custom_outputs(custom: nn.Module, groups: list[Any]) -> list[torch.Tensor]:
    """Run the custom module on every group in one packed forward."""
    with torch.inference_mode():
        out: list[torch.Tensor] = custom(groups)
        return out


def mapped_ranges(path: Path) -> list[tuple[int, int]]:
    """Return the address ranges this process maps ``path`` at (``/proc/self/maps``)."""
    ranges = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5] == str(path.resolve()):
            start, end = fields[0].split("-")
            ranges.append((int(start, 16), int(end, 16)))
    return ranges


@pytest.fixture(scope="module")
def folders(pipeline_folder: PipelineFolders) -> dict[str, Path]:
    """The tiny folder of each family."""
    return {family: pipeline_folder(family) for family in FAMILIES}


class TestCustomPath:
    """The custom path is the default, declares its sites and loads the files as they are."""

    @pytest.mark.parametrize("family", FAMILIES)
    def test_custom_is_the_default(self, family: str, folders: dict[str, Path]) -> None:
        """Nothing is missing for the custom path, so admission chooses it; it splits."""
        loader = loader_of(folders[family], family)
        assert loader.unavailable_reason("custom") is None
        assert loader.sequence_parallel
        assert loader.tensor_parallel
        assert loader.fully_shardable
        sites = {site.name: site for site in loader.sites()}
        assert sites["self"].role is AttentionRole.SELF
        assert sites["self"].requirements.packed_varlen
        assert sorted(sites) == (["cross", "self"] if family in CROSS else ["self"])

    @pytest.mark.parametrize("family", FAMILIES)
    def test_tensors_are_diffusers(self, family: str, folders: dict[str, Path]) -> None:
        """The custom module holds diffusers' class's tensors: same names, shapes, buffers."""
        loader = loader_of(folders[family], family)
        theirs = loader.library_layout
        assert theirs is not None
        ours = expected_tensors(build_empty(loader.custom_module))
        assert ours.tensors == theirs.expected.tensors
        assert ours.unstored.keys() == theirs.expected.unstored.keys()

    @pytest.mark.parametrize("family", FAMILIES)
    def test_declared_bytes_are_the_module(self, family: str, folders: dict[str, Path]) -> None:
        """The bytes admission declares are the bytes the custom module holds."""
        loader = loader_of(folders[family], family)
        assert loader.declared_bytes() == module_bytes(build(loader))

    @pytest.mark.parametrize("family", FAMILIES)
    def test_weights_are_the_mapped_files(self, family: str, folders: dict[str, Path]) -> None:
        """Every float32 parameter lies in the file's mapped pages: no conversion, no copy."""
        loader = loader_of(folders[family], family)
        module = build(loader)
        (path,) = weight_files(loader.folder)
        stored = load_file(path)
        for name, param in module.named_parameters():
            assert torch.equal(param, stored[name]), name
        ranges = mapped_ranges(path)
        assert all(any(a <= p.data_ptr() < b for a, b in ranges) for p in module.parameters())

    def test_a_tensor_the_module_lacks_is_refused(
        self, folders: dict[str, Path], tmp_path: Path
    ) -> None:
        """A file holding a tensor the config does not describe fails the load, naming it."""
        folder = shutil.copytree(folders["flux"] / "transformer", tmp_path / "transformer")
        (path,) = weight_files(folder)
        tensors = load_file(path)
        tensors["extra.weight"] = torch.zeros(2)
        save_file(tensors, path)
        loader = loader_of(tmp_path, "flux")
        with pytest.raises(
            ValueError, match="hold tensors the flux_transformer module does not: extra"
        ):
            loader.build("custom")

    def test_an_unbuilt_config_leaves_native(
        self, folders: dict[str, Path], tmp_path: Path
    ) -> None:
        """SD3.5's dual attention is not built here: the custom path says so and refuses."""
        folder = shutil.copytree(folders["sd3"] / "transformer", tmp_path / "transformer")
        config = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps(config | {"dual_attention_layers": [0]}))
        loader = loader_of(tmp_path, "sd3")
        reason = "its custom path builds SD3 blocks without dual_attention_layers"
        assert str(loader.unavailable_reason("custom")).startswith(reason)
        with pytest.raises(PathUnavailable, match=reason):
            loader.build("custom")
        declared = loader.tensors()  # diffusers' class's, its second attention included
        assert declared is not None
        assert any(".attn2." in name for name in declared)

    def test_an_uneven_feed_forward_split_is_planned(self, folders: dict[str, Path]) -> None:
        """Z-Image's tiny feed-forward of 85 units splits over two ranks (unevenly, as any
        split linear): every block plans w1 and w3 column-wise, w2 row-wise."""
        loader = loader_of(folders["z-image"], "z-image")
        module = build_empty(loader.custom_module)
        assert isinstance(module, PackedTransformer)
        plans = [plan for _, plan in module.tensor_plans(2)]
        assert len(plans) == loader.block_count()
        for plan in plans:
            split = [plan[f"feed_forward.w{i}"] for i in (1, 2, 3)]
            assert split == ["colwise", "rowwise", "colwise"]


class TestEqualToNative:
    """Custom and native agree on the same weights, on every backend the sites admit."""

    @pytest.mark.parametrize("family", FAMILIES)
    @pytest.mark.parametrize(
        ("packed", "backend"),
        [(True, b) for b in PACKED_BACKENDS] + [(False, b) for b in DENSE_BACKENDS],
    )
    def test_float32(
        self, family: str, packed: bool, backend: str, folders: dict[str, Path]
    ) -> None:
        """Every group of a mixed forward equals diffusers' class on it within 1e-5."""
        loader = loader_of(folders[family], family, packed_sequences=packed)
        custom, native = build(loader, backend), loader.build("native")
        groups = (
            mixed_groups(family, loader.config)
            if packed
            else [group_of(family, loader.config, MIXED[:1], 0)]
        )
        for got, want in zip(
            custom_outputs(custom, groups), native_outputs(native, groups), strict=True
        ):
            assert got.shape == want.shape
            assert relative(got, want) <= TOLERANCE

    @pytest.mark.parametrize("family", FAMILIES)
    def test_bfloat16(self, family: str, folders: dict[str, Path]) -> None:
        """In bfloat16 both paths agree within the stated tolerance."""
        loader = loader_of(folders[family], family)
        loader.dtype = torch.bfloat16
        custom, native = build(loader), loader.build("native")
        groups = [_cast(g, torch.bfloat16) for g in mixed_groups(family, loader.config)]
        for got, want in zip(
            custom_outputs(custom, groups), native_outputs(native, groups), strict=True
        ):
            assert got.dtype == want.dtype == torch.bfloat16
            assert relative(got, want) <= BFLOAT16_TOLERANCE

    @pytest.mark.parametrize("family", FAMILIES)
    def test_through_disk_offload_and_onload(
        self, family: str, folders: dict[str, Path], tmp_path: Path
    ) -> None:
        """Offloaded to a file and onloaded, the custom module gives the same output exactly."""
        loader = loader_of(folders[family], family)
        custom = build(loader)
        groups = mixed_groups(family, loader.config)
        before = custom_outputs(custom, groups)
        store = DiskStore(custom, tmp_path / "transformer.safetensors", "cpu")
        try:
            assert module_bytes(custom) == 0
            store.onload()
            after = custom_outputs(custom, groups)
        finally:
            store.close()
        assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
        native = native_outputs(loader.build("native"), groups)
        assert all(relative(a, n) <= TOLERANCE for a, n in zip(after, native, strict=True))


class TestMixedSizes:
    """Requests of different sizes and prompt lengths share one forward; each equals alone."""

    @pytest.mark.parametrize("family", FAMILIES)
    def test_three_sizes_in_one_forward(self, family: str, folders: dict[str, Path]) -> None:
        """Three requests of three sizes and prompt lengths, packed, each equal to alone."""
        loader = loader_of(folders[family], family)
        custom = build(loader)
        groups = mixed_groups(family, loader.config)[:3]
        together = custom_outputs(custom, groups)
        assert len({got.shape for got in together}) == 3
        for group, got in zip(groups, together, strict=True):
            (alone,) = custom_outputs(custom, [group])
            assert relative(got, alone) <= TOLERANCE

    def test_masked_text_is_dropped(self, folders: dict[str, Path]) -> None:
        """PixArt: what masked text tokens hold changes nothing (they take no weight)."""
        loader = loader_of(folders["pixart"], "pixart")
        custom = build(loader)
        group = group_of("pixart", loader.config, MIXED[1:2], 0)
        assert group.encoder_attention_mask is not None
        noisy = group.encoder_hidden_states.masked_fill(
            ~group.encoder_attention_mask.bool()[..., None], 99.0
        )
        (clean,) = custom_outputs(custom, [group])
        (other,) = custom_outputs(custom, [group._replace(encoder_hidden_states=noisy)])
        assert torch.equal(clean, other)


class TestLayerwise:
    """Layerwise offload streams the custom block stacks, bounded, bit-identical."""

    @pytest.mark.parametrize("family", FAMILIES)
    def test_streamed_stacks(self, family: str, folders: dict[str, Path]) -> None:
        """Blocks stream one by one, each once, in the order they are streamed (Flux: both
        stacks; Z-Image: its two refiners, then its main layers); the output is bit-identical."""
        loader = loader_of(folders[family], family)
        custom = build(loader)
        groups = mixed_groups(family, loader.config)
        resident = custom_outputs(custom, groups)
        blocks = loader.blocks(custom)
        assert blocks is not None
        assert len(blocks) == loader.block_count()
        ran: list[int] = []
        for index, block in enumerate(blocks):
            block.register_forward_pre_hook(lambda *_, index=index: ran.append(index))
        store = LayerwiseStore(custom, blocks, target="host", device="cpu")
        try:
            store.onload()
            streamed = custom_outputs(custom, groups)
            assert ran == list(range(len(blocks)))
            block = max(module_bytes(b) for b in blocks)
            rest = module_bytes(custom) - sum(module_bytes(b) for b in blocks)
            assert (
                store.peak_bytes <= rest + 2 * block
            )  # prefetch 1: the running block and the next
        finally:
            store.close()
        assert all(torch.equal(a, b) for a, b in zip(resident, streamed, strict=True))


class TestWanVariants:
    """Wan 2.2 TI2V's timestep per token and Wan 2.1 I2V's image states, as diffusers' class."""

    def test_timestep_per_token(self, pipeline_folder: PipelineFolders) -> None:
        """Each token's own timestep (the first frame's at 0, as TI2V's image to video) and
        one timestep per video given per token, packed, each equal native within 1e-5."""
        loader = loader_of(pipeline_folder("wan-ti2v"), "wan")
        custom, native = build(loader), loader.build("native")
        first, second = (group_of("wan", loader.config, [r], i) for i, r in enumerate(MIXED[1:]))
        tokens = first.hidden_states[0, 0].numel() // 4  # (f, h, w) in 1 x 2 x 2 patches
        per_token = first.timestep[:, None].repeat(1, tokens)
        per_token[:, : tokens // first.hidden_states.shape[2]] = 0  # the first frame's
        tokens = second.hidden_states[0, 0].numel() // 4
        groups = [
            first._replace(timestep=per_token),
            second._replace(timestep=second.timestep[:, None].expand(-1, tokens)),
        ]
        for got, want in zip(
            custom_outputs(custom, groups), native_outputs(native, groups), strict=True
        ):
            assert relative(got, want) <= TOLERANCE

    def test_image_states(self, pipeline_folder: PipelineFolders) -> None:
        """Image states through the added K/V projections, requests of two sizes packed,
        each equal native within 1e-5 (diffusers reads UMT5's 512 tokens after them)."""
        loader = loader_of(pipeline_folder("wan-i2v"), "wan")
        custom, native = build(loader), loader.build("native")
        generator = torch.Generator().manual_seed(0)
        groups = [
            group._replace(
                encoder_hidden_states=torch.randn(
                    1, 512, int(loader.config["text_dim"]), generator=generator
                ),
                encoder_hidden_states_image=torch.randn(
                    1, 5, int(loader.config["image_dim"]), generator=generator
                ),
            )
            for group in (group_of("wan", loader.config, [r], i) for i, r in enumerate(MIXED[:2]))
        ]
        for got, want in zip(
            custom_outputs(custom, groups), native_outputs(native, groups), strict=True
        ):
            assert relative(got, want) <= TOLERANCE

    def test_image_states_without_added_projections_leave_native(
        self, folders: dict[str, Path], tmp_path: Path
    ) -> None:
        """image_dim without added_kv_proj_dim is refused to the native path, naming both."""
        folder = shutil.copytree(folders["wan"] / "transformer", tmp_path / "transformer")
        config = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps(config | {"image_dim": 8}))
        loader = loader_of(tmp_path, "wan")
        assert loader.unavailable_reason("custom") == (
            "the custom Wan DiT does not build image_dim without added_kv_proj_dim (image "
            "states not attended through added projections)"
        )
        with pytest.raises(PathUnavailable, match="image_dim without added_kv_proj_dim"):
            loader.build("custom")


WITHOUT_DIFFUSERS = (
    blocking("diffusers", "transformers")
    + """
import sys

import torch

from attention import arm_layers
from components import registry
from components.accounting import module_bytes

kind, folder, saved = sys.argv[1:]
groups, want = torch.load(saved, weights_only=False)
loader = registry.get(kind).from_options({"path": folder})
print(loader.unavailable_reason("native"))
assert loader.unavailable_reason("custom") is None
module = loader.build("custom")
assert loader.declared_bytes() == module_bytes(module)
arm_layers(module)
with torch.inference_mode():
    got = module(groups)
print(max(((g - w).abs().max() / w.abs().max()).item() for g, w in zip(got, want)) <= 1e-5)
assert "diffusers" not in sys.modules and "transformers" not in sys.modules
"""
)


class TestWithoutDiffusers:
    """The custom path needs neither diffusers nor transformers."""

    @pytest.mark.parametrize("family", ["pixart", "flux"])
    def test_builds_and_equals_native(
        self, family: str, folders: dict[str, Path], tmp_path: Path, root: Path
    ) -> None:
        """With the libraries unimportable the custom module loads, sizes and equals native."""
        loader = loader_of(folders[family], family)
        groups = mixed_groups(family, loader.config)
        saved = tmp_path / "expected.pt"
        torch.save((groups, native_outputs(loader.build("native"), groups)), saved)
        folder = str(loader.folder)
        result = run_python(WITHOUT_DIFFUSERS, KINDS[family], folder, str(saved), cwd=root)
        assert result.returncode == 0, result.stderr
        assert result.stdout.splitlines() == [
            "the diffusers package is not installed (pip install 'pipeline-lifecycle[diffusers]')",
            "True",
        ]


def _cast(group: Any, dtype: torch.dtype) -> Any:
    """Return ``group`` with its floating tensors (in lists too) in ``dtype``; timesteps stay
    as they are."""

    def cast(name: str, value: Any) -> Any:
        if isinstance(value, list):
            return [cast(name, each) for each in value]
        if name in ("timestep", "t") or not isinstance(value, torch.Tensor):
            return value
        return value.to(dtype) if value.is_floating_point() else value

    return type(group)(**{name: cast(name, value) for name, value in group._asdict().items()})


def test_custom_module_packs() -> None:
    """The custom modules are PackedTransformers: recipes run them once per step."""
    from components.models.dit.flux import FluxTransformer
    from components.models.dit.pixart import PixArtTransformer
    from components.models.dit.qwen_image import QwenImageTransformer
    from components.models.dit.sd3 import Sd3Transformer
    from components.models.dit.wan import WanTransformer
    from components.models.dit.z_image import ZImageTransformer

    classes = (FluxTransformer, PixArtTransformer, Sd3Transformer, QwenImageTransformer)
    assert all(
        issubclass(c, PackedTransformer) for c in (*classes, ZImageTransformer, WanTransformer)
    )
