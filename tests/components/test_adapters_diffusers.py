"""LoRA on a real folder equals diffusers' own LoRA loading, merged and unmerged, per row."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from benchmarks.make_adapter import DEFAULT_TARGETS, linear_shapes, write_lora
from components.adapters import (
    AdapterFile,
    LoraMatrices,
    attach,
    batch_rows,
    linear_layers,
    merged_weight,
    read_matrices,
)
from tests.components.folder_runs import Loaded, Request, batch_of, call_pipeline, load
from tests.conftest import PipelineFolders

pytestmark = pytest.mark.usefixtures("one_thread")

TOLERANCE = 1e-5
"""Largest absolute pixel difference (images in [0, 1], float32, CPU) the issue allows."""
RANK, ALPHA = 4, 8.0

CASES = {
    "pixart": Request(size=(64, 96), guidance_scale=4.5, count=2),
    "flux": Request(size=(32, 48), guidance_scale=3.5, count=2),
}


class Family:
    """One folder with its LoRA file, its native modules and the LoRA read for them."""

    def __init__(self, folder: Path, lora: Path) -> None:
        self.folder = folder
        self.lora = lora
        self.loaded = load(folder)
        module = self.loaded.modules["transformer"]
        file = AdapterFile.read(lora)
        targets, problems = file.targets("transformer")
        assert not problems, problems
        self.layers = linear_layers(module, targets)
        self.matrices: dict[str, LoraMatrices] = read_matrices(
            lora, targets, self.layers, file.alpha_ratio, torch.device("cpu")
        )


@pytest.fixture(scope="module")
def families(
    pipeline_folder: PipelineFolders, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Family]:
    """Each tiny folder with a rank-4, alpha-8 LoRA of its transformer's attention projections."""
    root = tmp_path_factory.mktemp("loras")
    found = {}
    for family in CASES:
        folder = pipeline_folder(family)  # type: ignore[arg-type]
        shapes = linear_shapes(folder, "transformer", DEFAULT_TARGETS)
        lora = write_lora(
            shapes, root / f"{family}.safetensors", prefix="transformer", rank=RANK, alpha=ALPHA
        )
        found[family] = Family(folder, lora)
    return found


def run(loaded: Loaded, request: Request, adapters: list[dict[str, float]] | None = None) -> Any:
    """Run every stage of ``request`` with rows naming ``adapters``; images in [0, 1]."""
    batch = batch_of(request)
    batch.adapters = adapters
    with torch.inference_mode(), batch_rows(batch):
        for stage in loaded.recipe.stages:
            modules = {name: loaded.modules[name] for name in stage.uses}
            loaded.recipe.run(stage.name, modules, batch)
    assert batch.images is not None
    return (batch.images / 2 + 0.5).clamp(0, 1)


@contextmanager
def merged(family: Family, scale: float) -> Iterator[None]:
    """Merge the LoRA at ``scale`` into the transformer, keeping the base; put it back after."""
    bases = {path: layer.weight.data for path, layer in family.layers.items()}
    for path, layer in family.layers.items():
        layer.weight.data = merged_weight(bases[path], [(family.matrices[path], scale)])
    try:
        yield
    finally:
        for path, layer in family.layers.items():
            layer.weight.data = bases[path]


@contextmanager
def attached(family: Family, name: str) -> Iterator[None]:
    """Attach the LoRA unmerged as ``name``; detach it after."""
    handles = [attach(layer, name, family.matrices[p]) for p, layer in family.layers.items()]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def with_peft(family: str, folder: Path, lora: Path, scale: float) -> dict[str, Any]:
    """Load the LoRA the way diffusers does for ``family``; return what its pipeline call needs.

    Flux: the pipeline's ``load_lora_weights`` and ``set_adapters``. PixArt: diffusers
    0.42's pipeline has no LoRA loader, so its transformer gets the adapter through
    PEFT itself (``inject_adapter_in_model``, the state dict, the scale).
    """
    from diffusers import DiffusionPipeline

    pipeline = DiffusionPipeline.from_pretrained(str(folder))
    if family == "flux":
        pipeline.load_lora_weights(str(lora), adapter_name="a")
        pipeline.set_adapters(["a"], [scale])
        return {"pipeline": pipeline}
    from peft import LoraConfig, inject_adapter_in_model, set_peft_model_state_dict
    from peft.tuners.lora import LoraLayer
    from safetensors.torch import load_file

    state = {k.removeprefix("transformer."): v for k, v in load_file(str(lora)).items()}
    targets = sorted({k.rsplit(".lora_", 1)[0] for k in state})
    config = LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=targets)
    inject_adapter_in_model(config, pipeline.transformer, adapter_name="a")
    loaded = set_peft_model_state_dict(pipeline.transformer, state, adapter_name="a")
    assert not loaded.unexpected_keys
    for module in pipeline.transformer.modules():
        if isinstance(module, LoraLayer):
            module.set_scale("a", scale)
    return {"pipeline": pipeline}


def diffusers_images(family: str, fam: Family, request: Request, scale: float) -> Any:
    """Return diffusers' images of ``request`` with the LoRA at ``scale``."""
    return call_pipeline(with_peft(family, fam.folder, fam.lora, scale)["pipeline"], request)


@pytest.fixture(scope="module")
def lora_images(families: dict[str, Family]) -> Callable[[str], Any]:
    """diffusers' images of a family's case with its LoRA at 0.7, made once for the two tests
    that compare with them (in the first one's body, under its ``one_thread``)."""
    made: dict[str, Any] = {}

    def images(family: str) -> Any:
        if family not in made:
            made[family] = diffusers_images(family, families[family], CASES[family], 0.7)
        return made[family]

    return images


@pytest.mark.parametrize("family", list(CASES))
def test_merged_and_unmerged_equal_diffusers(
    family: str, families: dict[str, Family], lora_images: Callable[[str], Any]
) -> None:
    """At scale 0.7 our merged and unmerged images equal diffusers' with its LoRA loading."""
    fam, request = families[family], CASES[family]
    theirs = lora_images(family)
    with merged(fam, 0.7):
        ours_merged = run(fam.loaded, request)
    with attached(fam, "a"):
        ours_unmerged = run(fam.loaded, request, [{"a": 0.7}] * request.count)
    assert (ours_merged - theirs).abs().max() <= TOLERANCE
    assert (ours_unmerged - theirs).abs().max() <= TOLERANCE


@pytest.mark.parametrize("family", list(CASES))
def test_unmerge_gives_the_base_bit_for_bit(family: str, families: dict[str, Family]) -> None:
    """After a merge and unmerge the weights and the image equal the base exactly."""
    fam, request = families[family], CASES[family]
    module: nn.Module = fam.loaded.modules["transformer"]
    before = {k: v.clone() for k, v in module.state_dict().items()}
    base = run(fam.loaded, request)
    with merged(fam, 1.5):
        assert not torch.equal(run(fam.loaded, request), base)
    assert all(torch.equal(v, before[k]) for k, v in module.state_dict().items())
    assert torch.equal(run(fam.loaded, request), base)


def test_rows_with_different_scales_share_one_forward(families: dict[str, Family]) -> None:
    """Flux rows at scale 0.5 and without the LoRA in one batch each equal their own run."""
    fam, request = families["flux"], CASES["flux"]
    with attached(fam, "a"):
        mixed = run(fam.loaded, request, [{"a": 0.5}, {}])
        half = run(fam.loaded, request, [{"a": 0.5}] * 2)
        base = run(fam.loaded, request, [{}, {}])
    assert (mixed[0] - half[0]).abs().max() <= TOLERANCE
    assert (mixed[1] - base[1]).abs().max() <= TOLERANCE
    assert (half[0] - base[0]).abs().max() > 1e-2


@pytest.mark.parametrize("family", list(CASES))
def test_through_the_orchestrator_equals_diffusers(
    family: str,
    families: dict[str, Family],
    lora_images: Callable[[str], Any],
    tmp_path: Path,
) -> None:
    """A folder spec with ``[adapters]``: requests naming them equal diffusers' LoRA images."""
    from attention import Platform
    from lifecycle.orchestrator import Orchestrator
    from lifecycle.spec.reading import load_spec

    fam, request = families[family], CASES[family]
    spec = tmp_path / "spec.toml"
    spec.write_text(
        f'source = "{fam.folder}"\nname = "{family}"\ndevice = "cpu"\n'
        f'[adapters.m]\npath = "{fam.lora}"\n'
        f'[adapters.u]\npath = "{fam.lora}"\nmode = "unmerged"\n'
    )
    theirs = lora_images(family)
    images = {}
    with Orchestrator(load_spec(spec), platform=Platform("cpu")) as orchestrator:
        orchestrator.load()
        for name in ("m", "u"):
            batch = batch_of(request)
            batch.adapters = [{name: 0.7}] * request.count
            with orchestrator.request() as running:
                running.run_all(batch)
            assert batch.images is not None
            images[name] = (batch.images / 2 + 0.5).clamp(0, 1)
    assert (images["m"] - theirs).abs().max() <= TOLERANCE
    assert (images["u"] - theirs).abs().max() <= TOLERANCE
