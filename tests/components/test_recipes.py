"""Recipes: a folder run stage by stage on its native modules equals diffusers' own pipeline."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator, Mapping
from contextlib import ExitStack, contextmanager
from pathlib import Path

import pytest
import torch
from torch import nn

from components.batch import Cancelled, Left, StepDone
from components.offload.layerwise import LayerwiseStore
from tests.components.folder_runs import (
    Loaded,
    Request,
    batch_of,
    load,
    recipe_of,
    run_batch,
    run_diffusers,
    run_recipe,
)
from tests.conftest import PipelineFolders

pytestmark = pytest.mark.usefixtures("one_thread")

TOLERANCE = 1e-5
"""Largest absolute pixel difference (images in [0, 1], float32, CPU) the issue allows."""

CASES = {
    # PixArt's tiny DiT has sample_size 32: diffusers bins the size (to 192x320 here)
    "pixart": Request(negative_prompt="blurry, dark", size=(64, 96), guidance_scale=4.5),
    "pixart-sigma": Request(size=(48, 48), count=2, steps=3),
    "flux": Request(size=(32, 48), count=2, guidance_scale=3.5),
    "sd3": Request(negative_prompt="a grey dog", size=(32, 64), steps=3),
}


def with_config(folder: Path, into: Path, component: str, **changes: object) -> Path:
    """Copy pipeline ``folder`` into ``into`` with keys of ``component``'s config.json changed."""
    copy = shutil.copytree(folder, into / folder.name)
    path = copy / component / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))
    return copy


@pytest.fixture(scope="module")
def loaded(pipeline_folder: PipelineFolders) -> dict[str, Loaded]:
    """Every tiny folder's recipe with its components built natively, once per module."""
    return {family: load(pipeline_folder(family)) for family in CASES}


class TestEqualToDiffusers:
    """Each supported pipeline class makes diffusers' images from the same folder and request."""

    @pytest.mark.parametrize("family", list(CASES))
    def test_images_equal_diffusers(
        self, family: str, loaded: dict[str, Loaded], pipeline_folder: PipelineFolders
    ) -> None:
        """Prompt, negative prompt, seed, steps, guidance, size, count: as diffusers reads them."""
        request = CASES[family]
        ours = run_recipe(loaded[family], request)
        theirs = run_diffusers(pipeline_folder(family), request)
        assert ours.shape == theirs.shape == (request.count, 3, *request.size)
        assert (ours - theirs).abs().max() <= TOLERANCE

    def test_unguided_request_equals_diffusers(
        self, loaded: dict[str, Loaded], pipeline_folder: PipelineFolders
    ) -> None:
        """Guidance scale 1 runs one branch and no negative prompt, as diffusers does."""
        request = Request(guidance_scale=1.0, seed=5)
        ours = run_recipe(loaded["sd3"], request)
        assert (ours - run_diffusers(pipeline_folder("sd3"), request)).abs().max() <= TOLERANCE

    def test_unbinned_pixart_equals_diffusers_without_binning(
        self, pipeline_folder: PipelineFolders, tmp_path: Path
    ) -> None:
        """A DiT of a size diffusers does not bin runs at the size asked, like binning off."""
        folder = with_config(pipeline_folder("pixart"), tmp_path, "transformer", sample_size=8)
        request = Request(size=(16, 32), steps=3)
        ours = run_recipe(load(folder), request)
        theirs = run_diffusers(folder, request, use_resolution_binning=False)
        assert ours.shape == (1, 3, 16, 32)
        assert (ours - theirs).abs().max() <= TOLERANCE

    def test_each_seed_draws_its_own_image(self, loaded: dict[str, Loaded]) -> None:
        """Two seeds make two different images; one seed makes the same image twice."""
        first, again = (run_recipe(loaded["flux"], Request(seed=1)) for _ in range(2))
        other = run_recipe(loaded["flux"], Request(seed=2))
        assert torch.equal(first, again)
        assert (first - other).abs().max() > 0.01


class TestLayerwise:
    """Layerwise offload streams the real block stacks and leaves every image unchanged."""

    @pytest.mark.parametrize("family", ["flux", "sd3"])
    def test_streamed_blocks_make_the_same_image(
        self, family: str, loaded: dict[str, Loaded]
    ) -> None:
        """Every component with a block stack streams it block by block; the image is the same."""
        pipeline = loaded[family]
        streamed: dict[str, int] = {}

        @contextmanager
        def layerwise(stage: str, modules: Mapping[str, nn.Module]) -> Iterator[None]:
            with ExitStack() as stores:
                for name, module in modules.items():
                    blocks = pipeline.loaders[name].blocks(module)
                    if blocks is None:
                        continue
                    store = LayerwiseStore(module, blocks, target="host", device="cpu")
                    stores.callback(store.close)
                    store.onload()
                    streamed[name] = len(blocks)
                yield

        request = CASES[family]
        assert torch.equal(run_recipe(pipeline, request, layerwise), run_recipe(pipeline, request))
        assert streamed == {
            name: loader.block_count()
            for name, loader in pipeline.loaders.items()
            if loader.block_stack is not None
        }
        if family == "flux":  # two stacks, double-stream then single-stream blocks
            assert streamed["transformer"] == 4


class TestSteps:
    """Each denoising step is reported; a row cancelled between steps leaves, the rest go on."""

    def test_every_step_reports_each_images_latents(self, loaded: dict[str, Loaded]) -> None:
        """Flux reports each step with every image's unpacked latents ``(h * w, C)``."""
        reports: list[tuple[int, int, tuple[int, ...], list[tuple[int, ...]]]] = []
        batch = batch_of(Request(size=(32, 48), count=2, steps=3))
        batch.on_step = lambda done: reports.append(
            (done.step, done.steps, done.rows, [tuple(x.shape) for x in done.latents])
        )
        run_batch(loaded["flux"], batch)
        channels = loaded["flux"].recipe.channels
        assert reports == [(step, 3, (0, 1), [(4 * 6, channels)] * 2) for step in (1, 2, 3)]

    @pytest.mark.parametrize("family", ["pixart-sigma", "flux"])
    def test_a_cancelled_row_leaves_and_the_others_are_unchanged(
        self, family: str, loaded: dict[str, Loaded]
    ) -> None:
        """Row 0 cancelled after step 1 leaves at once; row 1's image is its image uncancelled
        (PixArt's multistep scheduler keeps per-image state; Flux's latents are packed)."""
        request = Request(size=(48, 48), count=2, steps=3, seed=4)
        whole = run_recipe(loaded[family], request)
        batch = batch_of(request)
        steps: list[tuple[int, tuple[int, ...]]] = []

        def cancel_row_0(done: StepDone) -> None:
            steps.append((done.step, done.rows))
            if done.step == 1:
                batch.cancellation.cancel("r1", [0])

        batch.on_step = cancel_row_0
        images = run_batch(loaded[family], batch)
        assert steps == [(1, (0, 1)), (2, (1,)), (3, (1,))]
        assert batch.left == [Left("r1", (0,), None, 1)]
        assert images.shape == (1, 3, 48, 48)
        assert (images[0] - whole[1]).abs().max() <= TOLERANCE

    def test_cancelling_every_row_stops_the_stage(self, loaded: dict[str, Loaded]) -> None:
        """With no row left after step 1 the stage raises ``Cancelled`` at that step."""
        batch = batch_of(Request(steps=3))
        batch.on_step = lambda done: batch.cancellation.cancel("r1")
        with pytest.raises(Cancelled) as raised:
            run_batch(loaded["sd3"], batch)
        assert raised.value.step == 1


class TestRequestsRefused:
    """What a pipeline class cannot honour is refused with the reason, never ignored."""

    def test_flux_refuses_a_negative_prompt(self, loaded: dict[str, Loaded]) -> None:
        """Flux's distilled guidance has no unconditional pass for a negative prompt to act on."""
        with pytest.raises(ValueError, match="FluxPipeline guides by its distilled guidance"):
            run_recipe(loaded["flux"], Request(negative_prompt="blurry"))

    @pytest.mark.parametrize("family", ["flux", "sd3"])
    def test_a_size_off_the_grid_names_the_multiple(
        self, family: str, loaded: dict[str, Loaded]
    ) -> None:
        """A size the VAE and patch scale cannot honour is refused, naming the valid multiple."""
        with pytest.raises(ValueError, match="cannot make 40x40 images") as err:
            run_recipe(loaded[family], Request(size=(40, 40)))
        assert str(err.value).endswith("height and width must be multiples of 16")

    def test_binned_pixart_takes_any_size(self, loaded: dict[str, Loaded]) -> None:
        """PixArt bins the size asked for and crops back to it, so no size is off its grid."""
        assert run_recipe(loaded["pixart-sigma"], Request(size=(40, 40))).shape == (1, 3, 40, 40)


class TestInterfaces:
    """Widths that do not fit together are found from the configs alone."""

    def test_matching_folders_have_no_problems(self, loaded: dict[str, Loaded]) -> None:
        """Every tiny folder's components fit together."""
        assert {family: p.recipe.interface_problems() for family, p in loaded.items()} == {
            family: [] for family in loaded
        }

    def test_text_width_against_caption_width(
        self, pipeline_folder: PipelineFolders, tmp_path: Path
    ) -> None:
        """A DiT whose caption width differs from T5's is named with both widths."""
        folder = with_config(
            pipeline_folder("pixart"), tmp_path, "transformer", caption_channels=48
        )
        (problem,) = recipe_of(folder).interface_problems()
        assert problem.code == "pipeline.interface_mismatch"
        assert problem.message == (
            "component 'transformer' reads context 48 wide, but 'text_encoder' writes it 64 wide"
        )

    def test_every_width_problem_is_named(
        self, pipeline_folder: PipelineFolders, tmp_path: Path
    ) -> None:
        """SD3 with a narrow T5: the DiT's joint width and the CLIP padding both fail."""
        folder = with_config(pipeline_folder("sd3"), tmp_path, "text_encoder_3", d_model=32)
        assert [p.message for p in recipe_of(folder).interface_problems()] == [
            "component 'transformer' reads context 64 wide, but 'text_encoder_3' writes it 32 wide",
            "the CLIP states (16 + 32 wide) must fit inside T5's 32, where they are padded to "
            "its width",
        ]
