"""OpenAI's videos API over a served Wan 2.1 folder, with the real ``openai`` client: create,
poll, download and delete; the MP4 is ``run``'s frames; stores expire; bounds are 400s."""

from __future__ import annotations

import base64
import io
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import Any

import httpx
import pytest
import torch
from torch.utils.hooks import RemovableHandle

from attention import Platform
from lifecycle.orchestrator import Orchestrator
from lifecycle.refusals import AdmissionRefused
from lifecycle.serving.server import open_worker
from lifecycle.spec.errors import ConfigError
from lifecycle.spec.reading import decode_spec, load_spec
from lifecycle.testing import capture_events, events_named
from tests.conftest import Lifecycle, PipelineFolders
from tests.lifecycle.folder_specs import largest_stage
from tests.lifecycle.serving.conftest import (
    WATCHDOG_S,
    Served,
    Servers,
    SharedFolder,
    SharedT2i,
    folder_spec,
    openai_client,
)
from tests.lifecycle.test_videos import LUMA, MP4_TOLERANCE, frames_of
from tests.lifecycle.video_requests import (
    PROMPT,
    VIDEO_REQUESTS,
    VideoRequest,
    input_image,
    video_arguments,
)

# the openai client marks its videos API deprecated (OpenAI's own service is to close)
pytestmark = [
    pytest.mark.usefixtures("one_thread"),
    pytest.mark.filterwarnings("ignore:The Sora API:DeprecationWarning"),
]

REQUEST = VIDEO_REQUESTS["wan"]  # 5 frames of 48 x 32, 2 steps, a negative prompt
EXTRA = {
    "num_frames": REQUEST.frames,
    "seed": REQUEST.seed,
    "steps": REQUEST.steps,
    "guidance_scale": REQUEST.guidance_scale,
    "negative_prompt": REQUEST.negative_prompt,
}
"""Our fields of ``REQUEST`` beside OpenAI's, as the openai client sends them (extra_body)."""
SIZE = f"{REQUEST.size[1]}x{REQUEST.size[0]}"
VIDEO_BOUNDS = {"max_frames": 5, "max_video_pixels": 5 * 48 * 32 - 1}
"""One worker's bounds for two tests: frames are checked first, then pixels."""
POLL_MS = 100
"""How often a test asks after a video: each ask is a request the worker answers, a few
milliseconds of CPU on both sides; a video here takes a few tenths of a second."""
LONG_STEPS = 200
"""Steps of a video that is still running when the test deletes it (``serving.max_steps``)."""


@pytest.fixture
def wan(shared_folder: SharedFolder) -> Callable[..., Served]:
    """Serve the tiny Wan 2.1 T2V folder once per module for each ``[serving]`` table."""

    def serve(**serving: Any) -> Served:
        return shared_folder("wan", **serving)

    return serve


@pytest.fixture
def client(openai: ModuleType, wan: Callable[..., Served]) -> Iterator[Any]:
    """An openai client of the module's Wan worker with default ``[serving]``."""
    with openai_client(openai, wan().url, "unused") as made:
        yield made


def create(client: Any, **extra: Any) -> Any:
    """``videos.create`` of ``REQUEST`` (the client marks the videos API deprecated)."""
    return client.videos.create(
        model="wan", prompt=PROMPT, size=SIZE, extra_body={**EXTRA, **extra}
    )


def finished(client: Any, video_id: str) -> Any:
    """Poll the video until it is completed or failed (the client's ``poll``)."""
    return client.videos.poll(video_id, poll_interval_ms=POLL_MS)


def png_bytes() -> bytes:
    """Return a small PNG file (Pillow)."""
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (8, 8), (200, 30, 30)).save(buffer, format="PNG")
    return buffer.getvalue()


def decoded(mp4: bytes) -> torch.Tensor:
    """Decode an MP4 with imageio's ffmpeg into 8-bit frames ``(F, H, W, 3)``."""
    import imageio.v3 as iio

    return torch.from_numpy(iio.imread(io.BytesIO(mp4), extension=".mp4", plugin="FFMPEG"))


def assert_run_frames(
    mp4: bytes,
    family: str,
    request: VideoRequest,
    lifecycle: Lifecycle,
    pipeline_folder: PipelineFolders,
    tmp_path: Path,
) -> None:
    """Assert that ``mp4`` decodes to the PNG frames ``run --video-format png`` writes for
    ``request`` on ``family``'s folder, within x264's error (``MP4_TOLERANCE``)."""
    out = tmp_path / "out"
    arguments = video_arguments(request, tmp_path)
    result = lifecycle(
        "run", pipeline_folder(family), *arguments, "--requests", "1", "--out", out,
        "--video-format", "png",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    lossless = frames_of(out / "r1-0").float() / 255
    frames = decoded(mp4).float() / 255
    assert frames.shape == lossless.shape == (request.frames, *request.size, 3)
    assert (frames @ LUMA - lossless @ LUMA).abs().mean() <= MP4_TOLERANCE
    assert (frames.mean((1, 2)) - lossless.mean((1, 2))).abs().max() <= MP4_TOLERANCE


def until(condition: Callable[[], bool]) -> None:
    """Wait for ``condition``, asking every ``POLL_MS``, for at most the watchdog's time."""
    deadline = time.monotonic() + WATCHDOG_S
    while not condition():
        assert time.monotonic() < deadline, "the condition never held"
        time.sleep(POLL_MS / 1e3)


@contextmanager
def opened(gate: threading.Event, hook: RemovableHandle) -> Iterator[None]:
    """Open ``gate`` and remove ``hook`` as the block ends, however it ends: no forward of
    the module that the next test shares waits on it."""
    try:
        yield
    finally:
        gate.set()
        hook.remove()


def request_state(served: Served, request_id: str) -> dict[str, Any]:
    """Return ``GET /v1/requests/{id}``."""
    response = served.get(f"/v1/requests/{request_id}")
    assert response.status_code == 200, response.text
    answer: dict[str, Any] = response.json()
    return answer


class TestVideos:
    """Create, poll, download and delete with the openai client."""

    def test_mp4_is_the_frames_run_writes(
        self, client: Any, lifecycle: Lifecycle, pipeline_folder: PipelineFolders, tmp_path: Path
    ) -> None:
        """``create_and_poll`` completes the video; its MP4 decodes to the PNG frames
        ``run --video-format png`` writes for the same seed, within x264's error."""
        video = client.videos.create_and_poll(
            model="wan", prompt=PROMPT, size=SIZE, extra_body=EXTRA, poll_interval_ms=POLL_MS
        )
        mp4 = client.videos.download_content(video.id).read()
        again = client.videos.retrieve(video.id)
        assert (video.object, video.status, video.progress) == ("video", "completed", 100)
        assert (video.model, video.size, video.seconds, video.prompt) == (
            "wan",
            SIZE,
            "0.25",
            PROMPT,
        )
        assert video.error is None
        assert video.completed_at >= video.created_at
        assert again == video
        assert_run_frames(mp4, "wan", REQUEST, lifecycle, pipeline_folder, tmp_path)

    def test_image_to_video_from_a_file(
        self,
        openai: ModuleType,
        module_servers: Servers,
        lifecycle: Lifecycle,
        pipeline_folder: PipelineFolders,
        tmp_path: Path,
    ) -> None:
        """A Wan 2.1 I2V folder serves; its ``input_reference`` file starts the video, whose
        MP4 decodes to the frames ``run --image`` writes from the same file."""
        request = VIDEO_REQUESTS["wan-i2v"]
        assert request.image is not None
        served = module_servers([folder_spec(pipeline_folder("wan-i2v"))])
        buffer = io.BytesIO()
        input_image(request.image).save(buffer, format="PNG")
        extra = {"num_frames": request.frames, "seed": request.seed, "steps": request.steps}
        extra |= {"guidance_scale": request.guidance_scale}
        extra |= {"negative_prompt": request.negative_prompt}
        height, width = request.size
        with openai_client(openai, served.url, "-") as client:
            video = client.videos.create_and_poll(
                model="wan-i2v",
                prompt=PROMPT,
                size=f"{width}x{height}",
                input_reference=("fox.png", buffer.getvalue(), "image/png"),
                extra_body=extra,
                poll_interval_ms=POLL_MS,
            )
            assert video.status == "completed", video.error
            mp4 = client.videos.download_content(video.id).read()
        assert_run_frames(mp4, "wan-i2v", request, lifecycle, pipeline_folder, tmp_path)

    def test_create_answers_at_once_and_the_request_is_the_video(
        self, client: Any, wan: Callable[..., Served]
    ) -> None:
        """``create`` answers queued or in progress; the video's id is its request's id,
        which ``GET /v1/requests/{id}`` follows to ``done``."""
        video = create(client, seconds=None)
        assert video.status in ("queued", "in_progress")
        assert video.progress < 100
        done = finished(client, video.id)
        assert done.status == "completed"
        assert request_state(wan(), video.id)["state"] == "done"

    def test_delete_removes_a_finished_video(self, openai: ModuleType, client: Any) -> None:
        """``delete`` answers ``video.deleted``; the video and its content are 404 after."""
        video = finished(client, create(client).id)
        deleted = client.videos.delete(video.id)
        assert (deleted.id, deleted.object, deleted.deleted) == (video.id, "video.deleted", True)
        with pytest.raises(openai.NotFoundError):
            client.videos.retrieve(video.id)
        with pytest.raises(openai.NotFoundError):
            client.videos.download_content(video.id)

    def test_delete_cancels_unfinished_videos(
        self, openai: ModuleType, client: Any, wan: Callable[..., Served]
    ) -> None:
        """Deleting an unfinished video cancels its request as ``DELETE /v1/requests/{id}``
        does: a running one stops before its last step, a later one (queued, or in a
        stage before the other's) never finishes either."""
        served = wan()
        running = create(client, steps=LONG_STEPS)
        later = create(client, steps=LONG_STEPS)
        deadline = time.monotonic() + WATCHDOG_S
        while request_state(served, running.id)["state"] != "running":
            assert time.monotonic() < deadline
            time.sleep(0.01)
        for video in (later, running):
            assert client.videos.delete(video.id).deleted
        stopped = request_state(served, running.id)
        while stopped["state"] == "running":  # it stops before its next step
            stopped = request_state(served, running.id)
        assert stopped["state"] == "cancelled"
        assert stopped["step"] < LONG_STEPS
        never = request_state(served, later.id)
        while never["state"] == "running":
            never = request_state(served, later.id)
        assert never["state"] == "cancelled"
        assert never["step"] < LONG_STEPS
        with pytest.raises(openai.NotFoundError):
            client.videos.retrieve(running.id)

    def test_json_body(self, wan: Callable[..., Served]) -> None:
        """A JSON body makes the same video; ``seconds`` is frames at 16 a second, plus one."""
        body = {"model": "wan", "prompt": PROMPT, "size": SIZE, **EXTRA}
        del body["num_frames"]
        with wan().client() as http:
            made = http.post("/v1/videos", json={**body, "seconds": "0.25"})
            assert made.status_code == 200, made.text
            assert made.json()["num_frames"] == REQUEST.frames


class TestStore:
    """Finished videos are kept for ``serving.video_ttl`` within ``video_store_bytes``."""

    def test_ttl_removes_a_finished_video(self, wan: Callable[..., Served]) -> None:
        """Past ``video_ttl`` seconds after it finished, the video is 404."""
        served = wan(video_ttl=0.5)
        with served.client() as http:
            video_id = http.post("/v1/videos", json={"prompt": PROMPT, "size": SIZE, **EXTRA})
            video_id = video_id.json()["id"]
            deadline = time.monotonic() + WATCHDOG_S
            while (answer := http.get(f"/v1/videos/{video_id}")).status_code == 200:
                if answer.json()["status"] == "completed":
                    time.sleep(0.5)
                assert time.monotonic() < deadline
                time.sleep(POLL_MS / 1e3)
            assert answer.status_code == 404
            assert answer.json()["error"]["code"] == "video_not_found"

    def test_store_bytes_remove_the_oldest_first(
        self, openai: ModuleType, client: Any, wan: Callable[..., Served]
    ) -> None:
        """Three equal videos in a store that holds two and a half: the oldest is removed,
        the two newest are kept; one video over the store alone fails naming the key."""
        first = finished(client, create(client).id)
        size = len(client.videos.download_content(first.id).read())
        served = wan(video_store_bytes=size * 5 // 2)
        with openai_client(openai, served.url, "-") as small:
            made = [finished(small, create(small).id) for _ in range(3)]
            assert [video.status for video in made] == ["completed"] * 3
            with pytest.raises(openai.NotFoundError):
                small.videos.retrieve(made[0].id)
            for video in made[1:]:
                assert len(small.videos.download_content(video.id).read()) == size
        tiny = wan(video_store_bytes=size - 1)
        with openai_client(openai, tiny.url, "-") as small:
            failed = finished(small, create(small).id)
        assert failed.status == "failed"
        assert failed.error.code == "limit_exceeded"
        assert "serving.video_store_bytes" in failed.error.message


class TestBounds:
    """What a video request may ask: 400s naming the key or the rule, before any work."""

    def post(self, served: Served, **body: Any) -> httpx.Response:
        with served.client() as http:
            return http.post("/v1/videos", json={"prompt": PROMPT, "size": SIZE, **body})

    def test_frames_must_be_4k_plus_1(self, wan: Callable[..., Served]) -> None:
        """Six frames are refused naming the rule."""
        answer = self.post(wan(), num_frames=6)
        assert answer.status_code == 400
        assert "makes videos of 4k + 1 frames (1, 5, 9, ..., 81), not 6" in answer.text
        assert answer.json()["error"]["param"] == "num_frames"

    @pytest.mark.parametrize(
        ("serving", "body", "key"),
        [
            (VIDEO_BOUNDS, {"num_frames": 9}, "max_frames"),
            (VIDEO_BOUNDS, {"num_frames": 5}, "max_video_pixels"),  # at max_frames: taken
            ({}, {"steps": 201}, "max_steps"),
        ],
    )
    def test_limits_name_their_key(
        self, serving: dict[str, Any], body: dict[str, Any], key: str, wan: Callable[..., Served]
    ) -> None:
        """A video over a ``[serving]`` bound is a 400 naming the key; at it, it is taken."""
        answer = self.post(wan(**serving), **body)
        assert answer.status_code == 400, answer.text
        error = answer.json()["error"]
        assert (error["code"], error["limit"]) == ("limit_exceeded", f"serving.{key}")

    def test_bad_spec_values_name_the_key(self, pipeline_folder: PipelineFolders) -> None:
        """A bad ``[serving]`` video key is a ConfigError naming it, at decode."""
        folder = pipeline_folder("wan")
        for key, value in (("max_frames", "0"), ("video_ttl", "0"), ("max_video_pixels", "-1")):
            with pytest.raises(ConfigError, match=rf"serving\.{key}"):
                decode_spec(f'source = "{folder}"\n[serving]\n{key} = {value}\n')
        with pytest.raises(ConfigError, match=r"serving\.video_store_bytes"):
            decode_spec(f'source = "{folder}"\n[serving]\nvideo_store_bytes = "lots"\n')

    def test_the_video_store_counts_in_the_host_check(
        self, pipeline_folder: PipelineFolders, tmp_path: Path, cpu: Platform
    ) -> None:
        """A worker is refused a video pipeline whose ``serving.video_store_bytes`` the host
        cannot hold beside its weights (``residency.host_memory`` naming the key); the same
        spec outside a worker keeps no videos and is admitted."""
        path = tmp_path / "wan.toml"
        path.write_text(
            f'source = "{pipeline_folder("wan")}"\ndevice = "cpu"\n'
            '[serving]\nvideo_store_bytes = "1000 TiB"\n'
        )
        spec = load_spec(path)
        with pytest.raises(AdmissionRefused) as refused:
            open_worker([spec], [path], threads=1)
        (refusal,) = refused.value.refusals
        assert refusal.code == "residency.host_memory"
        assert f"finished videos {1000 * 2**40} B" in refusal.message
        assert "lower serving.video_store_bytes" in refusal.hint
        Orchestrator(spec, platform=cpu).admit()

    def test_a_pipeline_that_makes_no_videos_is_named(self, shared_t2i: SharedT2i) -> None:
        """``POST /v1/videos`` to an image pipeline is a 400 naming the model."""
        served = shared_t2i()
        answer = self.post(served)
        assert answer.status_code == 400
        error = answer.json()["error"]
        assert (error["param"], error["code"]) == ("model", "model_makes_no_videos")
        assert "makes no videos" in error["message"]

    def test_input_reference_on_text_to_video(self, wan: Callable[..., Served]) -> None:
        """An input image for a text-to-video folder is refused naming ``input_reference``;
        a URL the worker would fetch too."""
        png = "data:image/png;base64," + base64.b64encode(png_bytes()).decode()
        for url, said in ((png, "makes videos from text alone"), ("https://x/a.png", "fetches")):
            answer = self.post(wan(), input_reference={"image_url": url})
            assert answer.status_code == 400
            assert answer.json()["error"]["param"] == "input_reference"
            assert said in answer.text

    def test_without_the_video_extra_501_names_it(
        self, wan: Callable[..., Served], monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """A worker where imageio and imageio-ffmpeg are not installed answers a video it
        would make with 501 naming the extra, before queueing it.

        The module's worker asks at each request whether they are installed: here they
        are not, as a failed import leaves them (``None`` in ``sys.modules``). Running Wan
        in a process that never had them is test_videos' WebP test.
        """
        served = wan()
        for name in ("imageio", "imageio_ffmpeg"):
            monkeypatch.setitem(sys.modules, name, None)
        answer = self.post(served, **EXTRA)
        assert answer.status_code == 501, answer.text
        error = answer.json()["error"]
        assert (error["type"], error["code"]) == ("server_error", "video_extra_missing")
        assert error["message"] == (
            "imageio and imageio-ffmpeg are not installed: the worker writes no MP4 (pip "
            "install 'pipeline-lifecycle[video]' where it runs)"
        )

    def test_a_browser_form_is_refused(self, wan: Callable[..., Served]) -> None:
        """A multipart form with an ``Origin`` (a browser's, sent without a preflight) is
        415; without one it is read."""
        form = {"prompt": PROMPT, "size": SIZE, "num_frames": "5"}
        files = {"input_reference": ("fox.png", png_bytes(), "image/png")}
        with wan().client() as http:
            browser = http.post(
                "/v1/videos", data=form, files=files, headers={"origin": "http://x"}
            )
            assert browser.status_code == 415
            plain = http.post("/v1/videos", data=form, files=files)
            assert plain.status_code == 400  # read: the image is refused by a T2V folder
            assert "makes videos from text alone" in plain.text


class TestBatching:
    """Videos of one length, size, steps and guidance share a batch, which crosses Wan 2.2
    A14B's boundary with one hand-over; each makes the frames it makes alone."""

    def test_two_videos_hand_over_once(
        self, module_servers: Servers, pipeline_folder: PipelineFolders, cpu: Platform
    ) -> None:
        """Under a one-expert budget, two videos queued while a third runs become one batch
        whose request onloads ``transformer_2`` once; the first one's MP4 is the one it
        makes alone."""
        folder = pipeline_folder("wan-a14b")
        request = VIDEO_REQUESTS["wan-a14b"]
        spec = folder_spec(folder, max_batch=2, batch_window_ms=60_000)
        served = module_servers([spec], device_budget=largest_stage(spec, cpu))
        body = {
            "prompt": PROMPT,
            "size": f"{request.size[1]}x{request.size[0]}",
            "num_frames": request.frames,
            "steps": request.steps,
            "guidance_scale": request.guidance_scale,
            "guidance_scale_2": request.guidance_scale_2,
        }
        # The runner holds at its next step once it denoises, its first expert resident,
        # until it is deleted: running on, it could reach the boundary and hand over itself
        # before the pair begins.
        holding, deleted = threading.Event(), threading.Event()

        def hold(*_: Any) -> None:
            if holding.is_set():
                assert deleted.wait(WATCHDOG_S)

        handle = served.worker.orchestrator.module("transformer").register_forward_pre_hook(hold)
        with capture_events() as events, served.client() as http, opened(deleted, handle):

            def post(**extra: Any) -> str:
                answer = http.post("/v1/videos", json={**body, **extra})
                assert answer.status_code == 200, answer.text
                video_id: str = answer.json()["id"]
                return video_id

            def done(video_id: str) -> bytes:
                until(lambda: http.get(f"/v1/videos/{video_id}").json()["status"] == "completed")
                return http.get(f"/v1/videos/{video_id}/content").content

            def pairs() -> list[str]:
                batched = events_named(events, "serving.batched")
                return [e["batch_id"] for e in batched if e["size"] == 2]

            running = post(steps=LONG_STEPS, seed=9)  # a runner busy: the next ones gather
            until(lambda: request_state(served, running)["step"] > 0)  # it denoises
            holding.set()
            first, second = post(seed=1), post(seed=2, prompt="a grey cat sleeps")
            until(lambda: bool(pairs()))
            assert http.delete(f"/v1/videos/{running}").status_code == 200
            deleted.set()
            batched = done(first)
            done(second)
            alone = done(post(seed=1))
        (pair,) = pairs()
        handed = [(m.component, m.direction) for m in served.moves if m.request_id == pair]
        # The runner denoised when the pair began: the pair offloads its expert to encode,
        # onloads it again and hands over once, never switching back.
        assert handed == [
            ("transformer", "offload"),
            ("text_encoder", "onload"),
            ("text_encoder", "offload"),
            ("transformer", "onload"),
            ("transformer", "offload"),
            ("transformer_2", "onload"),
            ("vae", "onload"),
        ]
        assert batched == alone
