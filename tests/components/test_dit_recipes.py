"""Recipes on the custom DiTs: the whole image equals native, and sizes mix in one batch."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
from torch import nn

from attention import arm_layers
from components.batch import Batch, StepDone
from tests.components.folder_runs import Loaded, Request, batch_of, load, run_recipe
from tests.conftest import PipelineFolders

pytestmark = pytest.mark.usefixtures("one_thread")

TOLERANCE = 1e-5
"""Largest absolute pixel difference (images in [0, 1], float32) the issue allows."""

CASES = {
    "pixart": Request(negative_prompt="blurry, dark", size=(64, 96), guidance_scale=4.5),
    "pixart-sigma": Request(size=(48, 48), count=2, steps=3),
    "flux": Request(size=(32, 48), count=2, guidance_scale=3.5),
    "sd3": Request(negative_prompt="a grey dog", size=(32, 64), steps=3),
    "qwen-image": Request(negative_prompt="a grey dog", size=(32, 48), count=2, guidance_scale=3),
}
# three requests of three sizes and prompt lengths
MIXED = [
    ((32, 48), "A red fox"),
    ((48, 32), "A red fox leaps over the snow"),
    ((64, 64), "A red fox leaps over the snow at dawn"),
]


def with_custom_transformer(loaded: Loaded) -> Loaded:
    """Return ``loaded`` with its transformer built through the custom path (armed)."""
    custom = loaded.loaders["transformer"].build("custom")
    arm_layers(custom)
    return loaded._replace(modules={**loaded.modules, "transformer": custom})


@pytest.fixture(scope="module")
def pipelines(pipeline_folder: PipelineFolders) -> dict[str, tuple[Loaded, Loaded]]:
    """Each family loaded natively, and again with the custom transformer."""
    found = {}
    for family in CASES:
        native = load(pipeline_folder(family))
        found[family] = (native, with_custom_transformer(native))
    return found


def guided(family: str, batch: Batch) -> Batch:
    """Return ``batch``, given a negative prompt per row where the class guides only against
    one (Qwen-Image's true CFG)."""
    if family == "qwen-image":
        batch.negative_prompts = ["a grey dog"] * batch.size
    return batch


def run_batch(loaded: Loaded, batch: Batch) -> list[torch.Tensor]:
    """Run every stage on ``batch``; return each image in [0, 1]."""
    with torch.inference_mode():
        for stage in loaded.recipe.stages:
            modules = {name: loaded.modules[name] for name in stage.uses}
            loaded.recipe.run(stage.name, modules, batch)
    assert batch.images is not None
    return [(image / 2 + 0.5).clamp(0, 1) for image in batch.images]


class TestWholeImage:
    """The recipe's image on the custom transformer equals the native one (and so diffusers')."""

    @pytest.mark.parametrize("family", list(CASES))
    def test_custom_equals_native(
        self, family: str, pipelines: dict[str, tuple[Loaded, Loaded]]
    ) -> None:
        """Every pixel of every image agrees within 1e-5."""
        native, custom = pipelines[family]
        want, got = run_recipe(native, CASES[family]), run_recipe(custom, CASES[family])
        assert got.shape == want.shape
        assert (got - want).abs().max().item() <= TOLERANCE


class TestMixedSizes:
    """Requests of different sizes share one batch (one DiT forward a step); each equals alone."""

    @pytest.mark.parametrize("family", ["pixart", "flux", "qwen-image"])
    def test_each_image_equals_its_request_alone(
        self, family: str, pipelines: dict[str, tuple[Loaded, Loaded]]
    ) -> None:
        """Three sizes and prompt lengths in one batch make each request's image alone."""
        _, custom = pipelines[family]
        recipe = custom.recipe
        noise = [
            recipe.draw_latents(torch.Generator().manual_seed(seed), 1, size)[0]
            for seed, (size, _) in enumerate(MIXED)
        ]
        mixed = guided(family, batch_of(Request(count=len(MIXED), steps=2)))
        mixed.prompts = [prompt for _, prompt in MIXED]
        mixed.image_sizes = [size for size, _ in MIXED]
        mixed.latents = list(noise)
        with counting(custom) as forwards:
            together = run_batch(custom, mixed)
        assert forwards == [2]  # one packed forward per step for all three sizes
        for (size, prompt), latents, image in zip(MIXED, noise, together, strict=True):
            alone = guided(family, batch_of(Request(prompt=prompt, size=size, steps=2)))
            alone.latents = [latents]
            (want,) = run_batch(custom, alone)
            assert image.shape == want.shape == (3, *size)
            assert (image - want).abs().max().item() <= TOLERANCE

    @pytest.mark.parametrize("family", ["pixart", "flux", "qwen-image"])
    def test_cancelled_rows_leave_their_groups(
        self, family: str, pipelines: dict[str, tuple[Loaded, Loaded]]
    ) -> None:
        """Rows cancelled after step 1 leave: a group that empties stops, one that keeps a
        row narrows (latents, guided text, scheduler state); what stays equals it alone."""
        _, custom = pipelines[family]
        sizes = [(32, 48), (48, 32), (32, 48)]
        noise = [
            custom.recipe.draw_latents(torch.Generator().manual_seed(seed), 1, size)[0]
            for seed, size in enumerate(sizes)
        ]
        batch = guided(family, batch_of(Request(count=3, steps=3)))
        batch.prompts = ["A red fox", "A grey cat", "A lighthouse at dusk"]
        batch.image_sizes = list(sizes)
        batch.latents = list(noise)
        seen: list[tuple[int, ...]] = []

        def cancel(done: StepDone) -> None:
            seen.append(done.rows)
            if done.step == 1:
                batch.cancellation.cancel("r1", [0, 1])

        batch.on_step = cancel
        with counting(custom) as forwards:
            (image,) = run_batch(custom, batch)
        assert forwards == [3]
        assert seen == [(0, 1, 2), (2,), (2,)]
        assert batch.image_sizes == [(32, 48)]
        alone = guided(
            family, batch_of(Request(prompt="A lighthouse at dusk", size=(32, 48), steps=3))
        )
        alone.latents = [noise[2]]
        (want,) = run_batch(custom, alone)
        assert (image - want).abs().max().item() <= TOLERANCE

    def test_native_runs_a_mixed_batch_group_by_group(
        self, pipelines: dict[str, tuple[Loaded, Loaded]]
    ) -> None:
        """diffusers' class cannot pack sizes: the recipe calls it once per size and step."""
        native, _ = pipelines["flux"]
        batch = batch_of(Request(count=len(MIXED), steps=2))
        batch.prompts = [prompt for _, prompt in MIXED]
        batch.image_sizes = [size for size, _ in MIXED]
        with counting(native) as forwards:
            images = run_batch(native, batch)
        assert forwards == [2 * len(MIXED)]
        assert [tuple(image.shape[1:]) for image in images] == [size for size, _ in MIXED]

    def test_one_size_per_image(self, pipelines: dict[str, tuple[Loaded, Loaded]]) -> None:
        """A batch with fewer sizes than images is refused, naming both counts."""
        _, custom = pipelines["flux"]
        batch = batch_of(Request(count=3))
        batch.image_sizes = [(32, 32)]
        with pytest.raises(ValueError, match="1 image sizes for 3 images; give one size per"):
            custom.recipe.check(batch)


@contextmanager
def counting(loaded: Loaded) -> Iterator[list[int]]:
    """Count the transformer's forwards inside the block (the count is the list's item)."""
    calls = [0]

    def counted(module: nn.Module, args: object) -> None:
        calls[0] += 1

    handle = loaded.modules["transformer"].register_forward_pre_hook(counted)
    try:
        yield calls
    finally:
        handle.remove()
