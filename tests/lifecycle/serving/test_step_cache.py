"""A step cache served: per-request ``cache``, what a response says, streams, metrics, status.

The folders are the tiny PixArt and Flux ones written with ``smooth_time=True`` (their
adjacent steps differ as a trained model's do, so the cache skips some: every test
asserts it does).
"""

from __future__ import annotations

import base64
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from httpx_sse import connect_sse

from lifecycle.serving.bodies import ImagesBody
from lifecycle.serving.status import RunningBatch, worker_status
from lifecycle.spec.reading import decode_spec
from tests.conftest import Lifecycle, PipelineFolders
from tests.lifecycle.serving.conftest import WATCHDOG_S, Served, Servers, ServeSpec
from tests.lifecycle.serving.test_folders import folder_job

pytestmark = pytest.mark.usefixtures("one_thread")

BODY: dict[str, Any] = {"prompt": "a red fox", "size": "64x64", "seed": 3}
"""A request of the pipeline's default steps (Flux 28, PixArt 20)."""
DEFAULT_STEPS = {"pixart": 20, "flux": 28}


@pytest.fixture(scope="module")
def taylor_seer(module_servers: Servers, pipeline_folder: PipelineFolders) -> Callable[[], Served]:
    """Serve the tiny Flux folder whose steps differ as a trained model's do, under
    TaylorSeer, once for the module: its tests send requests and read answers."""
    served: list[Served] = []

    def serve() -> Served:
        if not served:
            folder = pipeline_folder("flux", smooth_time=True)
            spec = decode_spec(
                f'source = "{folder}"\ndevice = "cpu"\n'
                '[components.transformer.cache]\nmethod = "taylor_seer"\n'
            )
            served.append(module_servers([spec]))
        return served[0]

    return serve


@pytest.fixture(scope="module")
def uncached_pngs() -> dict[Path, bytes]:
    """The PNG ``lifecycle run`` writes for ``BODY`` without a cache, by folder, once run:
    the ``"cache": false`` answers of both methods are compared with the same run."""
    return {}


def uncached_png(
    folder: Path, lifecycle: Lifecycle, tmp_path: Path, made: dict[Path, bytes]
) -> bytes:
    """Return the PNG ``run`` writes for ``BODY`` from ``folder`` (no cache), running it
    where ``made`` lacks it."""
    if folder not in made:
        result = lifecycle(
            "run", folder, "--requests", "1", "--threads", "1", "--prompt", BODY["prompt"],
            "--size", BODY["size"], "--seed", str(BODY["seed"]), "--out", tmp_path,
        )  # fmt: skip
        assert result.returncode == 0, result.stderr
        made[folder] = (tmp_path / "r1-0.png").read_bytes()
    return made[folder]


@pytest.mark.parametrize("method", ["first_block", "taylor_seer"])
@pytest.mark.parametrize("family", list(DEFAULT_STEPS))
def test_cache_false_equals_the_uncached_run_and_responses_say_what_ran(
    family: str,
    method: str,
    pipeline_folder: PipelineFolders,
    serve_spec: ServeSpec,
    lifecycle: Lifecycle,
    tmp_path: Path,
    uncached_pngs: dict[Path, bytes],
) -> None:
    """For each method on each family, ``"cache": false`` makes the PNG ``run`` makes
    without a cache, byte for byte; the cached request says what it skipped, a 3-step one
    that it ran uncached, and the metrics count the steps by outcome."""
    folder = pipeline_folder(family, smooth_time=True)
    spec = decode_spec(
        f'source = "{folder}"\nname = "fox"\ndevice = "cpu"\n'
        f'[components.transformer.cache]\nmethod = "{method}"\n'
    )
    served = serve_spec(spec)
    with served.client() as client:
        off = client.post("/v1/images/generations", json={**BODY, "cache": False})
        on = client.post("/v1/images/generations", json=BODY)
        short = client.post("/v1/images/generations", json={**BODY, "steps": 3})
        metrics = client.get("/metrics").text
    assert off.status_code == on.status_code == short.status_code == 200
    assert off.json()["cache"] is None
    cached = on.json()["cache"]
    assert cached["computed"] + cached["skipped"] == DEFAULT_STEPS[family]
    assert cached["skipped"] > 0
    assert short.json()["cache"] == {
        "computed": 3,
        "skipped": 0,
        "uncached": "3 steps leave nothing to skip: warmup_steps (2) + final_steps (1) are "
        "always computed",
    }
    labels = 'component="transformer",outcome="skipped",pipeline="fox"'
    assert f"lifecycle_cache_steps_total{{{labels}}} {float(cached['skipped'])}" in metrics
    plain = uncached_png(folder, lifecycle, tmp_path, uncached_pngs)
    assert base64.b64decode(off.json()["data"][0]["b64_json"]) == plain
    assert base64.b64decode(on.json()["data"][0]["b64_json"]) != plain


def test_a_skipped_step_still_streams_its_progress(taylor_seer: Callable[[], Served]) -> None:
    """A streamed request under a cache gets one event per step, skipped steps too, then
    the image, which says what the cache skipped."""
    served = taylor_seer()
    with (
        served.client() as client,
        connect_sse(
            client, "POST", "/v1/images/generations", json={**BODY, "stream": True}
        ) as source,
    ):
        events = [(sse.event, sse.json()) for sse in source.iter_sse()]
    steps = [data["step"] for kind, data in events if kind == "image_generation.partial_image"]
    assert steps == list(range(1, 29))
    kind, completed = events[-1]
    assert kind == "image_generation.completed"
    assert completed["cache"]["skipped"] > 0


def test_the_status_shows_the_steps_a_running_batch_skipped(
    taylor_seer: Callable[[], Served],
) -> None:
    """Read on the runner thread at step 20, the status page's running batch says how many
    image steps its cache skipped so far: what the finished job then reports."""
    served = taylor_seer()
    worker = served.worker
    batcher, recipe = worker.batcher, worker.orchestrator.recipe
    assert batcher is not None
    assert recipe is not None
    job = folder_job(recipe, ImagesBody(**BODY), "watched", 3, mixes_sizes=True)
    seen: list[RunningBatch] = []

    def at_step(step: int, steps: int, latents: list[torch.Tensor]) -> None:
        if step in (2, 20):
            (pipeline,) = worker_status(worker).pipelines
            seen.extend(pipeline.running)

    job.on_step = at_step
    done = batcher.submit(job).result(timeout=WATCHDOG_S)
    early, late = seen
    assert (early.id, early.step, early.skipped) == ("watched", 2, 0)  # the warm-up
    assert (late.step, late.steps) == (20, 28)
    assert done.cache_steps is not None
    assert 0 < late.skipped <= done.cache_steps.skipped
