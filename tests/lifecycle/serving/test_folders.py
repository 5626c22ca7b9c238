"""A pipeline folder served over HTTP: diffusers' meanings, run's PNG bytes, batches by size."""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

import httpx
import pytest
from httpx_sse import connect_sse

from components.recipes import Recipe
from lifecycle.admission.folder import default_steps
from lifecycle.serving.bodies import ImagesBody
from lifecycle.serving.folder_jobs import folder_image_job
from lifecycle.serving.jobs import OUTPUT_TOLERANCE, Job
from lifecycle.serving.limits import check_images
from lifecycle.spec.structs import ServingConfig
from tests.components.folder_runs import Request, recipe_of, run_diffusers
from tests.conftest import Lifecycle, PipelineFolders, decode_png
from tests.lifecycle.folder_specs import REQUESTS, assert_same_pixels, pixels, run_arguments
from tests.lifecycle.serving.conftest import WATCHDOG_S, Gate, SharedFolder, run_alone
from tests.lifecycle.serving.test_batching import occupied

pytestmark = pytest.mark.usefixtures("one_thread")


def folder_job(
    recipe: Recipe, body: ImagesBody, request_id: str, seed: int, *, mixes_sizes: bool
) -> Job:
    """Return the job the images route makes of ``body``: its size read once and checked,
    its steps the pipeline class's where it names none."""
    size = check_images(body, ServingConfig())
    steps = body.steps or default_steps(recipe)
    return folder_image_job(recipe, body, size, steps, request_id, seed, mixes_sizes=mixes_sizes)


def generate(client: httpx.Client, **body: Any) -> httpx.Response:
    """POST an image generation request."""
    return client.post("/v1/images/generations", json=body)


def body_of(request: Request) -> dict[str, Any]:
    """Return the HTTP body asking for ``request``."""
    height, width = request.size
    body = {
        "prompt": request.prompt,
        "size": f"{width}x{height}",
        "steps": request.steps,
        "seed": request.seed,
        "guidance_scale": request.guidance_scale,
        "n": request.count,
    }
    if request.negative_prompt is not None:
        body["negative_prompt"] = request.negative_prompt
    return body


def pngs(response: httpx.Response) -> list[bytes]:
    """Return the PNG files of an images response."""
    assert response.status_code == 200, response.text
    return [base64.b64decode(item["b64_json"]) for item in response.json()["data"]]


class TestImages:
    """``/v1/images/generations`` on a folder answers as diffusers' pipeline would."""

    def test_png_bytes_equal_run_out(
        self,
        pipeline_folder: PipelineFolders,
        shared_folder: SharedFolder,
        lifecycle: Lifecycle,
        tmp_path: Path,
    ) -> None:
        """The worker's PNG is byte for byte the one ``lifecycle run --out`` writes."""
        folder = pipeline_folder("sd3")
        request = Request(negative_prompt="a grey dog", size=(32, 64), steps=3, seed=9)
        served = shared_folder("sd3")
        with served.client() as client:
            (served_png,) = pngs(generate(client, **body_of(request)))
        result = lifecycle(
            "run", folder, *run_arguments(request), "--requests", "1", "--out", tmp_path
        )
        assert result.returncode == 0, result.stderr
        assert served_png == (tmp_path / "r1-0.png").read_bytes()

    def test_seed_and_n_draw_as_diffusers(
        self, pipeline_folder: PipelineFolders, shared_folder: SharedFolder
    ) -> None:
        """``seed`` and ``n`` draw as ``manual_seed(seed)`` with ``num_images_per_prompt=n``."""
        folder = pipeline_folder("pixart-sigma")
        request = Request(size=(48, 48), steps=3, seed=11, count=2)
        served = shared_folder("pixart-sigma")
        with served.client() as client:
            images = [decode_png(png) for png in pngs(generate(client, **body_of(request)))]
        theirs = pixels(run_diffusers(folder, request))
        assert len(images) == 2
        for ours, expected in zip(images, theirs, strict=True):
            assert_same_pixels(ours, expected)

    @pytest.mark.parametrize("family", ["qwen-image", "z-image", "flux2-klein"])
    def test_language_model_encoders_serve_diffusers_pixels(
        self, family: str, pipeline_folder: PipelineFolders, shared_folder: SharedFolder
    ) -> None:
        """Qwen-Image (true CFG), Z-Image and Flux.2 klein answer with diffusers' image."""
        folder = pipeline_folder(family)
        request = REQUESTS[family]
        served = shared_folder(family)
        with served.client() as client:
            (png,) = pngs(generate(client, **body_of(request)))
        assert_same_pixels(decode_png(png), pixels(run_diffusers(folder, request))[0])

    def test_what_the_class_cannot_honour_is_a_400(self, shared_folder: SharedFolder) -> None:
        """An off-grid size names the multiple (invalid_size, as every size error; 0x0 too);
        Flux's negative prompt and previews are refused."""
        served = shared_folder("flux")
        with served.client() as client:
            off_grid = generate(client, prompt="a fox", size="40x40").json()["error"]
            empty = generate(client, prompt="a fox", size="0x0").json()["error"]
            negative = generate(client, prompt="a fox", negative_prompt="blur").json()["error"]
            unreadable = generate(client, prompt="a fox", size="large")
            previews = generate(client, prompt="a fox", stream=True, partial_images=1)
        assert (off_grid["param"], off_grid["code"]) == ("size", "invalid_size")
        assert (empty["param"], empty["code"]) == ("size", "invalid_size")
        assert off_grid["message"] == (
            "FluxPipeline cannot make 40x40 images: height and width must be multiples of 16"
        )
        assert negative["param"] == "negative_prompt"
        assert "a negative prompt would be ignored" in negative["message"]
        assert unreadable.status_code == 400
        assert unreadable.json()["error"]["param"] == "size"
        assert previews.json()["error"]["param"] == "partial_images"

    def test_a_stream_reports_every_step_then_the_same_png(
        self, shared_folder: SharedFolder
    ) -> None:
        """``stream: true`` sends one event per scheduler step, then the non-streamed PNG."""
        served = shared_folder("pixart-sigma")
        body = {"prompt": "a fox", "size": "48x32", "steps": 3, "seed": 2}
        with served.client() as client:
            with connect_sse(
                client, "POST", "/v1/images/generations", json={**body, "stream": True}
            ) as source:
                events = [(sse.event, sse.json()) for sse in source.iter_sse()]
            plain = generate(client, **body)
        assert [(kind, data.get("step")) for kind, data in events] == [
            ("image_generation.partial_image", 1),
            ("image_generation.partial_image", 2),
            ("image_generation.partial_image", 3),
            ("image_generation.completed", None),
        ]
        assert events[-1][1]["size"] == "48x32"
        assert events[-1][1]["b64_json"] == plain.json()["data"][0]["b64_json"]

    def test_defaults_are_the_pipeline_class_defaults(
        self, pipeline_folder: PipelineFolders
    ) -> None:
        """No steps, guidance or size: the pipeline class's own, as diffusers' call has them."""
        recipe = recipe_of(pipeline_folder("sd3"))
        job = folder_job(recipe, ImagesBody(prompt="a fox"), "r1", 0, mixes_sizes=False)
        assert (job.key.steps, job.key.guidance_scale) == (28, 7.0)
        assert job.key.image_size == job.size == recipe.default_size()


class TestBatches:
    """Requests batch by size, or across sizes where the DiT packs them; each equals alone."""

    def test_same_size_requests_share_a_batch(
        self, shared_folder: SharedFolder, gated: Gate
    ) -> None:
        """Keyed by size (a DiT that cannot pack sizes), three of one size run as one batch,
        one of another size apart; all as if alone."""
        # the three start once queued (max_batch); the other waits out its window alone
        served = shared_folder("flux", batch_window_ms=500, max_batch=3)
        batcher = served.worker.batcher
        recipe = served.worker.orchestrator.recipe
        assert batcher is not None
        assert recipe is not None
        bodies = [
            ImagesBody(prompt=prompt, size=size, steps=2, seed=seed, n=1 + seed % 2)
            for seed, (prompt, size) in enumerate(
                [("a red fox", "32x32"), ("a cat", "32x32"), ("a dog", "48x32"), ("a fox", "32x32")]
            )
        ]
        jobs = [
            folder_job(recipe, body, f"j{i}", i, mixes_sizes=False) for i, body in enumerate(bodies)
        ]
        slow = ImagesBody(prompt="slow", size="32x32", steps=1, attention_backend="gated")
        slow_job = folder_job(recipe, slow, "slow", 0, mixes_sizes=False)
        with occupied(batcher, gated, slow_job) as blocker:
            futures = [batcher.submit(job) for job in jobs]
        done = [f.result(timeout=WATCHDOG_S) for f in futures]
        assert blocker.result(timeout=WATCHDOG_S).batch_size == 1
        assert [job.batch_size for job in done] == [3, 3, 1, 3]
        for index, job in enumerate(done):
            alone = folder_job(recipe, bodies[index], f"alone{index}", index, mixes_sizes=False)
            assert job.output is not None
            assert (job.output - run_alone(served.worker, alone)).abs().max() <= OUTPUT_TOLERANCE

    def test_sizes_share_a_batch_on_the_custom_dit(
        self, shared_folder: SharedFolder, gated: Gate
    ) -> None:
        """Flux's custom DiT packs sizes: jobs of three sizes run as one batch, each image as
        its request alone."""
        served = shared_folder("flux", batch_window_ms=500, max_batch=3)
        batcher = served.worker.batcher
        recipe = served.worker.orchestrator.recipe
        assert batcher is not None
        assert recipe is not None
        mixes = served.worker.shapes.mixes_sizes
        assert mixes  # the folder's transformer is on its custom path
        bodies = [
            ImagesBody(prompt=f"a fox {seed}", size=size, steps=2, seed=seed, n=1 + seed % 2)
            for seed, size in enumerate(["32x32", "48x32", "32x64"])
        ]
        jobs = [
            folder_job(recipe, body, f"j{i}", i, mixes_sizes=mixes) for i, body in enumerate(bodies)
        ]
        slow = ImagesBody(prompt="slow", size="32x32", steps=1, attention_backend="gated")
        slow_job = folder_job(recipe, slow, "slow", 0, mixes_sizes=mixes)
        with occupied(batcher, gated, slow_job) as blocker:
            futures = [batcher.submit(job) for job in jobs]
        done = [f.result(timeout=WATCHDOG_S) for f in futures]
        assert blocker.result(timeout=WATCHDOG_S).batch_size == 1
        assert [job.batch_size for job in done] == [3, 3, 3]
        for index, job in enumerate(done):
            height, width = job.size or (0, 0)
            assert job.output is not None
            assert job.output.shape == (1 + index % 2, 3, height, width)
            alone = folder_job(recipe, bodies[index], f"alone{index}", index, mixes_sizes=mixes)
            assert (job.output - run_alone(served.worker, alone)).abs().max() <= OUTPUT_TOLERANCE
