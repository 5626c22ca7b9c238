"""Custom paths of the folder kinds (T5, CLIP, the VAE) equal their native paths."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from attention import (
    Attention,
    ComponentRequests,
    Platform,
    arm_layers,
    component_attention_scope,
    registry,
)
from attention.testing import explicit, rel_err
from benchmarks.make_pipeline import Family
from components.accounting import module_bytes
from components.folders.custom import CustomFolderLoader
from components.kinds.autoencoder_kl import AutoencoderKlLoader
from components.kinds.clip_text_encoder import ClipTextEncoderLoader
from components.kinds.t5_encoder import T5EncoderLoader
from components.loader import PathUnavailable
from components.offload import LayerwiseStore
from components.recipes.folder import FolderPipeline
from lifecycle import AdmissionRefused, Orchestrator
from lifecycle.spec.reading import decode_spec
from lifecycle.spec.structs import PipelineSpec
from tests.components.encoder_outputs import TEXTS, outputs
from tests.conftest import PipelineFolders

pytestmark = [pytest.mark.long, pytest.mark.usefixtures("one_thread")]

# B texts or images, L tokens, E width, T packed tokens

FLOAT32_TOLERANCE = 1e-5
HALF_TOLERANCE = {torch.bfloat16: 3e-2, torch.float16: 5e-3}
"""Custom against native, max|a - b| / max|a|. bfloat16: measured 1.3e-2 for T5 (each path
is 1.6-1.7e-2 from its float32 result: our tanh GELU is one fused op, transformers' five
rounded ones), 0 for CLIP and the VAE; float16: 1.4e-3 for T5."""

CASES: dict[str, tuple[Family, str]] = {
    "t5": ("pixart", "text_encoder"),
    "clip": ("flux", "text_encoder"),
    "clip_projected": ("sd3", "text_encoder"),
    "vae": ("pixart", "vae"),
    "vae_unquantised": ("flux", "vae"),
}


def loader_of(folder: Path, name: str) -> CustomFolderLoader:
    """Return the loader of component ``name`` of the pipeline ``folder``."""
    loader = FolderPipeline.read(folder).loaders()[name]
    assert isinstance(loader, CustomFolderLoader)
    return loader


def dense_backends(loader: CustomFolderLoader) -> list[str]:
    """Return every dense backend this CPU has that the loader's sites admit."""
    cpu = Platform("cpu")
    return [
        name
        for name in registry.names()
        if cpu.is_available(name)
        and not registry.get(name).is_sparse
        and all(
            not registry.get(name).unsupported_requirements(site.requirements)
            for site in loader.sites() or ()
        )
    ]


def custom(loader: CustomFolderLoader, backend: str | None = None) -> nn.Module:
    """Build the custom path (under an explicit backend, if given) and arm its layers."""
    requests = ComponentRequests(
        component="c", component_backend=None if backend is None else explicit(backend)
    )
    with component_attention_scope(requests, platform=Platform("cpu")):
        module = loader.build("custom")
    arm_layers(module)
    return module


def encoded_moments(module: nn.Module, images: torch.Tensor) -> torch.Tensor:
    """Return the encoder's mean and log-variance stacked along channels, from either path."""
    encode: Any = module.encode
    found = encode(images)
    if isinstance(found, torch.Tensor):
        return found
    posterior = found.latent_dist
    return torch.cat([posterior.mean, posterior.logvar], dim=1)


def assert_close(got: list[torch.Tensor], want: list[torch.Tensor], tolerance: float) -> None:
    """Assert each output's relative max error is within ``tolerance``."""
    assert len(got) == len(want)
    for a, b in zip(got, want, strict=True):
        assert a.shape == b.shape
        assert rel_err(a.float(), b.float()) <= tolerance


class TestEqualToNative:
    """Our modules load the folder's files as they are and compute what the library does."""

    @pytest.mark.parametrize("case", list(CASES))
    def test_float32_on_every_admitted_backend(
        self, case: str, pipeline_folder: PipelineFolders
    ) -> None:
        """Within 1e-5 of the native path on each dense backend the sites admit."""
        loader = loader_of(pipeline_folder(CASES[case][0]), CASES[case][1])
        want = outputs(loader, loader.build("native"))
        backends = dense_backends(loader)
        assert "torch_sdpa" in backends
        assert "reference" in backends
        for backend in backends:
            module = custom(loader, backend)
            layers = [m for m in module.modules() if isinstance(m, Attention)]
            assert layers
            assert {layer.backend_name for layer in layers} == {backend}
            assert_close(outputs(loader, module), want, FLOAT32_TOLERANCE)

    @pytest.mark.parametrize("case", list(CASES))
    @pytest.mark.parametrize("dtype", list(HALF_TOLERANCE), ids=str)
    def test_half_precision(
        self, case: str, dtype: torch.dtype, pipeline_folder: PipelineFolders
    ) -> None:
        """Loaded in bfloat16 or float16, both paths hold the same dtypes and bytes and agree
        within the stated tolerance (T5 keeps ``wo`` in float32 under float16, as transformers
        does)."""
        loader = loader_of(pipeline_folder(CASES[case][0]), CASES[case][1])
        loader.dtype = dtype
        module, native = custom(loader), loader.build("native")
        assert {n: p.dtype for n, p in module.named_parameters()} == {
            n: p.dtype for n, p in native.named_parameters()
        }
        assert dtype in {p.dtype for p in module.parameters()}
        assert loader.declared_bytes() == module_bytes(module) == module_bytes(native)
        assert_close(outputs(loader, module), outputs(loader, native), HALF_TOLERANCE[dtype])

    @pytest.mark.parametrize("case", ["vae", "vae_unquantised"])
    def test_vae_encoder(self, case: str, pipeline_folder: PipelineFolders) -> None:
        """The encoder's latent moments equal diffusers' mean and log-variance."""
        loader = loader_of(pipeline_folder(CASES[case][0]), CASES[case][1])
        images = torch.rand(2, 3, 32, 24, generator=torch.Generator().manual_seed(5)) * 2 - 1
        want = encoded_moments(loader.build("native"), images)
        assert rel_err(encoded_moments(custom(loader), images), want) <= FLOAT32_TOLERANCE

    @pytest.mark.parametrize("case", list(CASES))
    def test_every_declared_layer_runs(self, case: str, pipeline_folder: PipelineFolders) -> None:
        """Each attention layer of the declared sites runs (the VAE's encoder on encode)."""
        loader = loader_of(pipeline_folder(CASES[case][0]), CASES[case][1])
        module = custom(loader)
        layers = [m for m in module.modules() if isinstance(m, Attention)]
        calls = dict.fromkeys(range(len(layers)), 0)
        for index, layer in enumerate(layers):
            layer.register_forward_pre_hook(lambda *_, i=index: calls.__setitem__(i, calls[i] + 1))
        outputs(loader, module)
        if isinstance(loader, AutoencoderKlLoader):
            encoded_moments(module, torch.zeros(1, 3, 16, 16))
        assert {layer.site for layer in layers} == {site.name for site in loader.sites()}
        assert all(count > 0 for count in calls.values())

    @pytest.mark.parametrize("case", list(CASES))
    def test_same_tensors_as_the_library_loads(
        self, case: str, pipeline_folder: PipelineFolders
    ) -> None:
        """Every weight and buffer equals the native module's, and the declaration is the load."""
        loader = loader_of(pipeline_folder(CASES[case][0]), CASES[case][1])
        module, native = custom(loader), loader.build("native")
        ours, theirs = module.state_dict(), native.state_dict()
        assert ours.keys() == theirs.keys()
        assert all(torch.equal(ours[name], theirs[name]) for name in ours)
        assert loader.declared_bytes() == module_bytes(module) == module_bytes(native)
        blocks = loader.blocks(module)
        assert (None if blocks is None else len(blocks)) == loader.block_count()


def spec_of(
    folder: Path,
    name: str,
    offload_dir: Path,
    top: dict[str, object] | None = None,
    **component: object,
) -> PipelineSpec:
    """Return a one-component spec of ``folder``'s ``name``, offloaded to disk, used by a stage;
    ``top`` adds top-level tables, ``component`` keys of the component's."""
    plan = FolderPipeline.read(folder).components[name]
    table = {
        **(top or {}),
        "name": "custom-paths",
        "device": "cpu",
        "memory": {"offload_target": "disk", "offload_dir": str(offload_dir)},
        "components": {
            name: {
                "kind": plan.kind,
                "options": plan.options,
                "residency": "component_offload",
                **component,
            }
        },
        "stages": [{"name": "run", "uses": [name]}],
    }
    return decode_spec(msgspec.json.encode(table).decode(), fmt="json")


class TestThroughTheLifecycle:
    """Admitted, loaded, offloaded to disk and onloaded again, the custom path still equals."""

    @pytest.mark.parametrize("case", list(CASES))
    def test_offload_and_onload(
        self, case: str, pipeline_folder: PipelineFolders, tmp_path: Path
    ) -> None:
        """Custom is the default path; its outputs equal native's before and after a round trip."""
        folder, name = pipeline_folder(CASES[case][0]), CASES[case][1]
        loader = loader_of(folder, name)
        want = outputs(loader, loader.build("native"))
        with Orchestrator(spec_of(folder, name, tmp_path)) as pipeline:
            plan = pipeline.admit()
            assert plan.components[name].loader == "custom"
            pipeline.load()
            pipeline.onload(name)
            before = outputs(loader, pipeline.module(name))
            pipeline.offload(name)
            pipeline.onload(name)
            after = outputs(loader, pipeline.module(name))
        assert_close(before, want, FLOAT32_TOLERANCE)
        assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))

    @pytest.mark.parametrize("case", ["t5", "clip_projected"])
    def test_layerwise_offload_from_disk(
        self, case: str, pipeline_folder: PipelineFolders, tmp_path: Path
    ) -> None:
        """Admitted for layerwise offload (its stack found on the meta build), it streams."""
        folder, name = pipeline_folder(CASES[case][0]), CASES[case][1]
        loader = loader_of(folder, name)
        want = outputs(loader, loader.build("native"))
        spec = spec_of(folder, name, tmp_path, residency="layerwise_offload")
        with Orchestrator(spec) as pipeline:
            assert pipeline.admit().components[name].loader == "custom"
            pipeline.load()
            with pipeline.request() as request, request.stage("run") as modules:
                got = outputs(loader, modules[name])
        assert_close(got, want, FLOAT32_TOLERANCE)

    def test_native_is_still_chosen_by_name(
        self, pipeline_folder: PipelineFolders, tmp_path: Path
    ) -> None:
        """loader = "native" builds transformers' class."""
        folder = pipeline_folder("pixart")
        with Orchestrator(spec_of(folder, "text_encoder", tmp_path, loader="native")) as pipeline:
            assert pipeline.admit().components["text_encoder"].loader == "native"
            pipeline.load()
            assert type(pipeline.module("text_encoder")).__name__ == "T5EncoderModel"


class TestT5Bias:
    """T5 adds its position bias to the scores: a flash kernel cannot serve it."""

    def test_explicit_torch_flash_is_refused_by_capability(
        self, pipeline_folder: PipelineFolders, tmp_path: Path
    ) -> None:
        """An explicit torch_flash for T5 is attention.capability_missing, naming the bias."""
        spec = spec_of(
            pipeline_folder("pixart"), "text_encoder", tmp_path, attention_backend="torch_flash"
        )
        with pytest.raises(AdmissionRefused) as refused, Orchestrator(spec) as pipeline:
            pipeline.admit()
        (refusal,) = refused.value.refusals
        assert refusal.code == "attention.capability_missing"
        assert "backend 'torch_flash' does not implement an additive attention bias" in (
            refusal.message
        )

    def test_global_torch_flash_falls_back_for_the_text_encoder(
        self, pipeline_folder: PipelineFolders, tmp_path: Path
    ) -> None:
        """A global torch_flash falls back to torch_sdpa for T5, an auxiliary component."""
        top: dict[str, object] = {"attention": {"backend": "torch_flash"}}
        spec = spec_of(pipeline_folder("pixart"), "text_encoder", tmp_path, top)
        with Orchestrator(spec) as pipeline:
            (site,) = pipeline.admit().components["text_encoder"].attention
        assert (site.backend, site.reason) == ("torch_sdpa", "global backend fallback")


class ShapeLog(TorchDispatchMode):
    """Record the shape of every tensor each aten op returns."""

    def __init__(self) -> None:
        super().__init__()
        self.shapes: list[tuple[str, tuple[int, ...]]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        """Run the op and note its outputs' shapes."""
        out = func(*args, **(kwargs or {}))
        for tensor in out if isinstance(out, tuple | list) else (out,):
            if isinstance(tensor, torch.Tensor):
                self.shapes.append((str(func), tuple(tensor.shape)))
        return out


def packed_clip(folder: Path) -> ClipTextEncoderLoader:
    """Return the Flux CLIP loader with ``packed_sequences`` on."""
    loader = loader_of(folder, "text_encoder")
    assert isinstance(loader, ClipTextEncoderLoader)
    options = msgspec.structs.replace(loader.options, packed_sequences=True)
    return ClipTextEncoderLoader(options)


class TestClipCausal:
    """CLIP attends causally through the kernel's causal mode, packed or dense."""

    def test_packed_pooled_equals_padded(self, pipeline_folder: PipelineFolders) -> None:
        """Pooled outputs of unpadded prompts packed in one sequence equal the padded ones."""
        folder = pipeline_folder("flux")
        loader = packed_clip(folder)
        module = custom(loader)
        assert {m.backend_name for m in module.modules() if isinstance(m, Attention)} == {
            "torch_flash"
        }
        padded = loader.encode(loader_of(folder, "text_encoder").build("native"), TEXTS).pooled
        assert rel_err(loader.pooled(module, TEXTS), padded) <= FLOAT32_TOLERANCE

    def test_packed_path_never_allocates_sequence_by_sequence(
        self, pipeline_folder: PipelineFolders
    ) -> None:
        """No op of the packed forward makes a tensor ending in (S, S) for any prompt length."""
        loader = packed_clip(pipeline_folder("flux"))
        module = custom(loader)
        lengths = [7, 11, 13]  # prompt lengths no width of the tiny model shares
        ids = torch.randint(2, 100, (sum(lengths),), generator=torch.Generator().manual_seed(0))
        cu_seqlens = torch.tensor([0, 7, 18, 31], dtype=torch.int32)
        with ShapeLog() as log:
            module(ids, cu_seqlens)
        squares = {*lengths, sum(lengths)}
        found = [
            (op, shape)
            for op, shape in log.shapes
            if len(shape) >= 2 and shape[-1] == shape[-2] and shape[-1] in squares
        ]
        assert log.shapes
        assert found == []


def streamed_outputs(
    loader: CustomFolderLoader, module: nn.Module, path: Path
) -> tuple[list[torch.Tensor], int, int]:
    """Stream ``module``'s blocks from disk; return the outputs, the peak and the bound."""
    blocks = loader.blocks(module)
    assert blocks is not None
    block = max(module_bytes(b) for b in blocks)
    store = LayerwiseStore(module, blocks, target="disk", path=path, device="cpu", prefetch=1)
    try:
        rest = store.nbytes - sum(module_bytes(b) for b in blocks)
        store.onload()
        got = outputs(loader, module)
        return got, store.peak_bytes, rest + 2 * block
    finally:
        store.close()


class TestLayerwise:
    """Layerwise offload streams our T5 and CLIP stacks, bounded, bit for bit."""

    @pytest.mark.parametrize("case", ["t5", "clip", "clip_projected"])
    def test_streams_within_bound_bit_identical(
        self, case: str, pipeline_folder: PipelineFolders, tmp_path: Path
    ) -> None:
        """Outputs equal a resident run exactly; the peak stays within rest + 2 blocks."""
        loader = loader_of(pipeline_folder(CASES[case][0]), CASES[case][1])
        resident = outputs(loader, custom(loader))
        got, peak, bound = streamed_outputs(loader, custom(loader), tmp_path / "blocks.safetensors")
        assert all(torch.equal(a, b) for a, b in zip(got, resident, strict=True))
        assert peak <= bound


@pytest.fixture
def edited_t5(pipeline_folder: PipelineFolders, tmp_path: Path) -> Path:
    """A copy of PixArt's T5 folder, for a test to edit."""
    return shutil.copytree(pipeline_folder("pixart") / "text_encoder", tmp_path / "text_encoder")


class TestStrict:
    """The custom path loads exactly the module's names and shapes, or says why not."""

    def test_an_unknown_tensor_is_refused(
        self, edited_t5: Path, pipeline_folder: PipelineFolders
    ) -> None:
        """A file with a tensor our module does not hold fails, naming it and the fix."""
        weights = edited_t5 / "model.safetensors"
        tensors = load_file(weights)
        tensors["encoder.block.0.layer.0.SelfAttention.q.bias"] = torch.zeros(64)
        save_file(tensors, weights)
        loader = T5EncoderLoader.from_options({"path": str(edited_t5)})
        with pytest.raises(ValueError, match=r"unexpected 'encoder\.block\.0\.layer\.0\.Self"):
            custom(loader)
        assert loader.weight_problems() == [
            "unexpected 'encoder.block.0.layer.0.SelfAttention.q.bias'"
        ]

    def test_a_config_our_module_lacks_makes_the_custom_path_unavailable(
        self, edited_t5: Path
    ) -> None:
        """An activation we do not implement is a reason: admission would load it natively."""
        config = edited_t5 / "config.json"
        raw = msgspec.json.decode(config.read_bytes())
        raw["feed_forward_proj"] = "gated-silu"
        config.write_bytes(msgspec.json.encode(raw))
        loader = T5EncoderLoader.from_options({"path": str(edited_t5)})
        reason = loader.unavailable_reason("custom")
        assert reason == (
            "its feed-forward activation 'silu' is not one of gelu_new, gelu, relu "
            "(the custom path implements those)"
        )
        with pytest.raises(PathUnavailable, match="custom path of 't5_encoder' cannot run"):
            loader.build("custom")
        assert loader.unavailable_reason("native") is None
