"""Image jobs of different sizes share one batch on a folder pipeline's custom DiT."""

from __future__ import annotations

import pytest
import torch

from attention import arm_layers
from components.batch import Batch
from lifecycle.serving.jobs import (
    OUTPUT_TOLERANCE,
    BatchKey,
    Job,
    Shapes,
    merged_batch,
    split_outputs,
)
from tests.components.folder_runs import Loaded, load
from tests.conftest import PipelineFolders

pytestmark = pytest.mark.usefixtures("one_thread")

KEY = BatchKey(endpoint="images", steps=2, guidance_scale=3.5)
"""What the jobs share: a DiT that packs sizes leaves the size out of the key."""
SHAPES = Shapes(embeddings=False, images=True)
JOBS = [
    Job(id="a", key=KEY, prompts=["a red fox"], tokens=6, seed=1, size=(32, 48)),
    Job(id="b", key=KEY, prompts=["a lighthouse at dusk"] * 2, tokens=12, seed=2, size=(48, 32)),
    Job(id="c", key=KEY, prompts=["ramen"], tokens=6, seed=3, size=(64, 64)),
]


@pytest.fixture(scope="module")
def flux(pipeline_folder: PipelineFolders) -> Loaded:
    """The tiny Flux folder, its transformer on the custom path."""
    loaded = load(pipeline_folder("flux"))
    custom = loaded.loaders["transformer"].build("custom")
    arm_layers(custom)
    return loaded._replace(modules={**loaded.modules, "transformer": custom})


def run(loaded: Loaded, batch: Batch) -> int:
    """Run every stage of the recipe on ``batch``; return the transformer's forwards."""
    forwards = [0]
    hook = loaded.modules["transformer"].register_forward_pre_hook(
        lambda module, args: forwards.__setitem__(0, forwards[0] + 1)
    )
    try:
        with torch.inference_mode():
            for stage in loaded.recipe.stages:
                modules = {name: loaded.modules[name] for name in stage.uses}
                loaded.recipe.run(stage.name, modules, batch)
    finally:
        hook.remove()
    return forwards[0]


class TestMixedSizes:
    def test_jobs_of_three_sizes_share_one_batch(self, flux: Loaded) -> None:
        """Three sizes run as one batch, one DiT forward a step; each job equals it alone."""
        batch = merged_batch(JOBS, SHAPES, flux.recipe)
        assert batch.image_sizes == [(32, 48), (48, 32), (48, 32), (64, 64)]
        assert run(flux, batch) == KEY.steps
        split_outputs(JOBS, batch)
        for job in JOBS:
            assert job.output is not None
            assert job.size is not None
            assert job.output.shape == (len(job.prompts), 3, *job.size)
            alone = merged_batch([job], SHAPES, flux.recipe)
            run(flux, alone)
            assert isinstance(alone.images, torch.Tensor)  # one size: one tensor
            assert (job.output - alone.images).abs().max() <= OUTPUT_TOLERANCE

    def test_a_job_without_a_size_is_named(self, flux: Loaded) -> None:
        """A pipeline that mixes sizes needs each job's size; the error names the job."""
        sizeless = Job(id="z", key=KEY, prompts=["x"], tokens=3)
        with pytest.raises(
            ValueError, match="image job 'z' has no size: give the job or its key one"
        ):
            merged_batch([sizeless], SHAPES, flux.recipe)
