"""Wan folders through the lifecycle: the Python API and ``run`` make diffusers' videos, and
``run`` writes them as MP4, animated WebP or PNG frames."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from attention import Platform
from benchmarks.make_pipeline import Family
from lifecycle.events import Event, Move
from lifecycle.orchestrator import Orchestrator
from lifecycle.spec.reading import load_spec
from tests.blocked_imports import uninstalled
from tests.conftest import Lifecycle, PipelineFolders, decode_png
from tests.lifecycle.cli_calls import lifecycle_calls
from tests.lifecycle.folder_specs import MODES, Mode, assert_same_pixels, mode_spec
from tests.lifecycle.video_requests import (
    VIDEO_REQUESTS,
    diffusers_video,
    video_arguments,
    video_batch,
)

pytestmark = pytest.mark.usefixtures("one_thread")

TOLERANCE = 1e-5
"""Largest absolute difference of a frame's value (videos in [0, 1], float32, CPU) the
issue allows."""
MP4_TOLERANCE = 0.05
"""Largest mean absolute difference (in [0, 1]) of an MP4's decoded luma, and of each
frame's mean colour, from the lossless frames'. x264 at imageio's default quality keeps
luma at full resolution but halves colour each way: on a 32 x 48 clip of seeded noise
that alone moves single pixels' colours by about 0.08 on average (measured 0.031 luma,
0.027 mean colour)."""
LUMA = torch.tensor([0.299, 0.587, 0.114])
"""BT.601 luma weights of R, G and B."""


@pytest.fixture(scope="module")
def diffusers_videos(pipeline_folder: PipelineFolders) -> dict[str, torch.Tensor]:
    """What diffusers' own pipeline makes of each Wan folder's request, in [0, 1], run once."""
    torch.set_num_threads(1)  # the module's first test is under one_thread too
    return {
        family: diffusers_video(pipeline_folder(family), request)
        for family, request in VIDEO_REQUESTS.items()
    }


def frames_of(folder: Path) -> torch.Tensor:
    """Read a folder of PNG frames, in the order of their names, as ``(F, H, W, 3)``."""
    paths = sorted(folder.iterdir())
    assert [path.name for path in paths] == [f"{i:05d}.png" for i in range(len(paths))]
    return torch.stack([decode_png(path.read_bytes()) for path in paths])


def pixels(video: torch.Tensor) -> torch.Tensor:
    """Return a video in [0, 1] ``(3, F, H, W)`` as 8-bit frames ``(F, H, W, 3)``, as
    diffusers' processor quantises them."""
    return (video * 255).round().to(torch.uint8).permute(1, 2, 3, 0)


class TestEqualToDiffusers:
    """Every Wan folder, in every residency mode, makes diffusers' video."""

    @pytest.mark.parametrize("mode", MODES)
    @pytest.mark.parametrize("family", list(VIDEO_REQUESTS))
    def test_python_api(
        self,
        family: Family,
        mode: Mode,
        pipeline_folder: PipelineFolders,
        diffusers_videos: dict[str, torch.Tensor],
        tmp_path: Path,
        cpu: Platform,
    ) -> None:
        """A request through the orchestrator equals diffusers' frames within 1e-5."""
        spec = load_spec(mode_spec(pipeline_folder(family), mode, tmp_path, cpu))
        moves: list[Move] = []

        def observe(event: Event) -> None:
            if isinstance(event, Move):
                moves.append(event)

        batch = video_batch(VIDEO_REQUESTS[family])
        with Orchestrator(spec, platform=cpu, observer=observe) as orchestrator:
            orchestrator.load()
            with orchestrator.request() as request:
                request.run_all(batch)
        assert batch.videos is not None
        ours = (batch.videos[0] / 2 + 0.5).clamp(0, 1)
        assert ours.shape == diffusers_videos[family].shape
        assert (ours - diffusers_videos[family]).abs().max() <= TOLERANCE
        if mode == "budget":
            assert any(m.direction == "offload" and m.request_id for m in moves)

    @pytest.mark.parametrize("family", list(VIDEO_REQUESTS))
    def test_run_writes_diffusers_frames(
        self,
        family: Family,
        pipeline_folder: PipelineFolders,
        diffusers_videos: dict[str, torch.Tensor],
        lifecycle: Lifecycle,
        tmp_path: Path,
    ) -> None:
        """``run --video-format png`` writes diffusers' frames, pixel for pixel, in order."""
        out = tmp_path / "out"
        arguments = video_arguments(VIDEO_REQUESTS[family], tmp_path)
        result = lifecycle(
            "run", pipeline_folder(family), *arguments, "--requests", "1", "--out", out,
            "--video-format", "png",
        )  # fmt: skip
        assert result.returncode == 0, result.stderr
        assert "videos: 1 folder of PNG frames written to" in result.stdout
        assert [path.name for path in out.iterdir()] == ["r1-0"]
        assert_same_pixels(frames_of(out / "r1-0"), pixels(diffusers_videos[family]))

    def test_two_experts_share_the_steps_at_the_boundary(
        self, pipeline_folder: PipelineFolders, tmp_path: Path, cpu: Platform
    ) -> None:
        """Wan 2.2 A14B: ``transformer`` predicts the steps at or above 875, ``transformer_2``
        the rest (both guidance branches each)."""
        spec = load_spec(pipeline_folder("wan-a14b"))
        calls = {"transformer": 0, "transformer_2": 0}
        with Orchestrator(spec, platform=cpu) as orchestrator:
            orchestrator.load()
            for name in calls:
                module = orchestrator.module(name)

                def count(*_: object, name: str = name) -> None:
                    calls[name] += 1

                module.register_forward_hook(count)
            with orchestrator.request() as request:
                request.run_all(video_batch(VIDEO_REQUESTS["wan-a14b"]))
        assert calls == {
            "transformer": 2 * 2,
            "transformer_2": 2 * 2,
        }  # timesteps 999, 900 | 750, 500


class TestVideoFiles:
    """``run`` writes MP4 with the [video] extra, WebP without it, and says so."""

    def test_mp4_decodes_to_the_frames(
        self, pipeline_folder: PipelineFolders, lifecycle: Lifecycle, tmp_path: Path
    ) -> None:
        """The default format is MP4 (``rI-J.mp4``); it decodes to the lossless frames within
        the codec's error."""
        import imageio.v3 as iio

        arguments = video_arguments(VIDEO_REQUESTS["wan"], tmp_path)
        folder = pipeline_folder("wan")
        for fmt in ("mp4", "png"):
            out = tmp_path / fmt
            chosen = () if fmt == "mp4" else ("--video-format", "png")
            result = lifecycle("run", folder, *arguments, "--requests", "1", "--out", out, *chosen)
            assert result.returncode == 0, result.stderr
            written = "MP4 file" if fmt == "mp4" else "folder of PNG frames"
            assert f"videos: 1 {written} written to {out}" in result.stdout
        assert sorted(path.name for path in (tmp_path / "mp4").iterdir()) == ["r1-0.mp4"]
        decoded = torch.from_numpy(iio.imread(tmp_path / "mp4" / "r1-0.mp4", plugin="FFMPEG"))
        lossless = frames_of(tmp_path / "png" / "r1-0")
        assert decoded.shape == lossless.shape
        decoded, lossless = decoded.float() / 255, lossless.float() / 255
        assert (decoded @ LUMA - lossless @ LUMA).abs().mean() <= MP4_TOLERANCE
        colours = decoded.mean((1, 2)) - lossless.mean((1, 2))  # (F, 3)
        assert colours.abs().max() <= MP4_TOLERANCE

    def test_without_the_extra_webp_is_written_and_said(
        self, pipeline_folder: PipelineFolders, root: Path, tmp_path: Path
    ) -> None:
        """Without imageio and imageio-ffmpeg: an animated WebP of every frame, a note naming
        the extra; ``--video-format mp4`` is bad input there (exit 2), before any work.

        Both calls run in one process without the two packages (``mp4`` first, so that no
        earlier work is in it), each one's output kept apart."""
        from PIL import Image

        request = VIDEO_REQUESTS["wan"]
        run = ["run", str(pipeline_folder("wan")), *video_arguments(request, tmp_path)]
        out = tmp_path / "out"
        asked, done = lifecycle_calls(
            [
                (root, [*run, "--out", str(tmp_path / "mp4"), "--video-format", "mp4"]),
                (root, [*run, "--requests", "1", "--out", str(out)]),
            ],
            before=uninstalled("imageio", "imageio_ffmpeg"),
        )
        assert done.returncode == 0, done.stderr
        assert (
            "lifecycle run: imageio and imageio-ffmpeg are not installed: videos are written "
            "as animated WebP (pip install 'pipeline-lifecycle[video]' for MP4)"
        ) in done.stderr
        with Image.open(out / "r1-0.webp") as video:
            assert (video.format, video.n_frames, video.size) == ("WEBP", request.frames, (48, 32))
        assert asked.returncode == 2
        assert "--video-format mp4 needs imageio and imageio-ffmpeg" in asked.stderr
        assert "request r1" not in asked.stderr


class TestBadInput:
    """What a video run cannot honour is exit 2 naming the option and the rule."""

    @pytest.mark.parametrize("frames", ["6", "80", "2"])
    def test_frames_must_be_4k_plus_1(
        self, frames: str, pipeline_folder: PipelineFolders, lifecycle: Lifecycle, tmp_path: Path
    ) -> None:
        """``--frames`` off ``4k + 1`` is refused before any work, naming the rule."""
        arguments = video_arguments(VIDEO_REQUESTS["wan"], tmp_path)
        result = lifecycle("run", pipeline_folder("wan"), *arguments, "--frames", frames)
        assert result.returncode == 2
        assert f"makes videos of 4k + 1 frames (1, 5, 9, ..., 81), not {frames}" in result.stderr
        assert "Traceback" not in result.stderr

    def test_video_options_of_an_image_pipeline(
        self, pipeline_folder: PipelineFolders, lifecycle: Lifecycle
    ) -> None:
        """``--frames`` on a pipeline that makes images is refused, naming the option."""
        folder = pipeline_folder("pixart-sigma")
        result = lifecycle("run", folder, "--prompt", "a fox", "--frames", "5")
        assert result.returncode == 2
        assert "--frames is an option of a pipeline that makes videos" in result.stderr

    def test_image_to_video_needs_an_image(
        self, pipeline_folder: PipelineFolders, lifecycle: Lifecycle, tmp_path: Path
    ) -> None:
        """An image-to-video folder without ``--image`` is refused, naming the option; an
        ``--image`` that is not one names its path."""
        folder = pipeline_folder("wan-i2v")
        result = lifecycle("run", folder, "--prompt", "a fox", "--frames", "5")
        assert result.returncode == 2
        assert "starts each video from an image: give one per video (--image" in result.stderr
        text = tmp_path / "not-an-image.png"
        text.write_text("hello")
        result = lifecycle("run", folder, "--prompt", "a fox", "--image", text)
        assert result.returncode == 2
        assert f"--image {text}: cannot read it as an image" in result.stderr

    def test_a_last_image_needs_a_first_last_frame_dit(
        self, pipeline_folder: PipelineFolders, lifecycle: Lifecycle, tmp_path: Path
    ) -> None:
        """Wan 2.1 I2V's DiT reads one image's CLIP states: ``--last-image`` is refused
        up front (diffusers' pipeline fails inside the DiT)."""
        arguments = video_arguments(VIDEO_REQUESTS["wan-i2v"], tmp_path)
        image = arguments[arguments.index("--image") + 1]
        result = lifecycle("run", pipeline_folder("wan-i2v"), *arguments, "--last-image", image)
        assert result.returncode == 2
        assert "reads one image's states (it has no pos_embed_seq_len" in result.stderr


class TestConfigEntries:
    """``model_index.json`` entries that are not ``[library, class]`` pairs are the
    pipeline's config, read by its recipe."""

    def test_a_bad_boundary_ratio_is_named(
        self, pipeline_folder: PipelineFolders, lifecycle: Lifecycle, tmp_path: Path
    ) -> None:
        """A ``boundary_ratio`` out of range is exit 2 naming the entry and its range."""
        folder = shutil.copytree(pipeline_folder("wan-a14b"), tmp_path / "wan")
        index = json.loads((folder / "model_index.json").read_text())
        assert (index["boundary_ratio"], index["expand_timesteps"]) == (0.875, False)
        index["boundary_ratio"] = 1.5
        (folder / "model_index.json").write_text(json.dumps(index))
        result = lifecycle("check", folder)
        assert result.returncode == 2
        assert "boundary_ratio is 1.5; expected a number from 0 to 1" in result.stderr


class TestVideoVae:
    """The causal video VAE has no blocks to stream: layerwise offload is refused, saying why."""

    def test_layerwise_offload_is_refused_naming_why(
        self, pipeline_folder: PipelineFolders, lifecycle: Lifecycle, tmp_path: Path
    ) -> None:
        """``check`` refuses ``layerwise_offload`` of ``autoencoder_kl_wan`` with
        ``residency.not_offloadable``: every temporal chunk runs every layer."""
        spec = tmp_path / "layerwise.toml"
        spec.write_text(
            f'source = "{pipeline_folder("wan")}"\n'
            '[components.vae]\nresidency = "layerwise_offload"\n'
        )
        result = lifecycle("check", spec)
        assert result.returncode == 1
        assert "residency.not_offloadable" in result.stdout
        assert "each temporal chunk of a decode runs every layer of the decoder" in result.stdout
