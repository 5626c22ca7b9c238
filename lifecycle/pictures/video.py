"""Videos as files: MP4 through imageio-ffmpeg, animated WebP through Pillow, or PNG frames.

MP4 needs the ``[video]`` extra (imageio and imageio-ffmpeg, whose wheel ships ffmpeg: no
system package); without it a video is written as an animated WebP by Pillow (which
diffusers brings), and the command says so. PNG frames are lossless: a folder of
``00000.png``, ``00001.png``, ... in order, written by ``lifecycle.pictures.png``.
Pixels are quantised as diffusers' processor does (see ``encode_png``).
"""

from __future__ import annotations

import subprocess
import tempfile
from pathlib import Path

import torch

from components.libraries import is_importable
from lifecycle.pictures.formats import VideoFormat
from lifecycle.pictures.png import write_png

__all__ = [
    "FPS",
    "VIDEO_EXTRA",
    "default_format",
    "mp4_bytes",
    "mp4_missing",
    "write_video",
]

FPS = 16
"""Frames a second: Wan's (diffusers' examples export its videos at 16)."""
MP4_PACKAGES = ("imageio", "imageio_ffmpeg")
VIDEO_EXTRA = "pip install 'pipeline-lifecycle[video]'"


def mp4_missing() -> str | None:
    """Say which package MP4 needs that is not installed, or None when both are."""
    absent = [name.replace("_", "-") for name in MP4_PACKAGES if not is_importable(name)]
    if not absent:
        return None
    return f"{' and '.join(absent)} {'is' if len(absent) == 1 else 'are'} not installed"


def default_format() -> tuple[VideoFormat, str | None]:
    """Return the format a video is written in when none is asked, and why if not MP4."""
    missing = mp4_missing()
    if missing is None:
        return "mp4", None
    return "webp", f"{missing}: videos are written as animated WebP ({VIDEO_EXTRA} for MP4)"


def video_pixels(video: torch.Tensor) -> torch.Tensor:
    """Return a video ``(3, F, H, W)`` in [-1, 1] as 8-bit frames ``(F, H, W, 3)``."""
    channels = video.shape[0]
    if video.dim() != 4 or channels != 3:
        raise ValueError(f"expected an RGB video (3, F, H, W), got shape {tuple(video.shape)}")
    scaled = (video.detach().float().cpu() / 2 + 0.5).clamp(0, 1) * 255
    return scaled.round().to(torch.uint8).permute(1, 2, 3, 0).contiguous()


def write_video(video: torch.Tensor, stem: Path, video_format: VideoFormat) -> Path:
    """Write ``video`` ``(3, F, H, W)`` in [-1, 1] at ``stem`` (no suffix) as ``video_format``;
    return what was written: ``stem.mp4``, ``stem.webp``, or the folder ``stem``.

    Raises:
        ModuleNotFoundError: MP4 was asked without the ``[video]`` extra.
        OSError: the file or folder cannot be written.
    """
    if video_format == "png":
        stem.mkdir()
        frames = video.unbind(1)
        width = max(5, len(str(len(frames) - 1)))
        for index, frame in enumerate(frames):
            write_png(frame, stem / f"{index:0{width}d}.png")
        return stem
    pixels = video_pixels(video).numpy()
    path = stem.with_suffix(f".{video_format}")
    if video_format == "webp":
        from PIL import Image

        images = [Image.fromarray(frame) for frame in pixels]
        images[0].save(path, save_all=True, append_images=images[1:], duration=1000 // FPS, loop=0)
        return path
    missing = mp4_missing()
    if missing is not None:
        raise ModuleNotFoundError(f"{missing}: MP4 needs them ({VIDEO_EXTRA})")
    _, height, width, _ = pixels.shape
    _encode_mp4(pixels.tobytes(), height, width, path)
    return path


def _encode_mp4(frames: bytes, height: int, width: int, path: Path) -> None:
    """Encode 8-bit RGB frames (``height`` x ``width``, one after the other) as H.264 at
    ``path`` with the ffmpeg that imageio-ffmpeg ships, fed through a pipe.

    ffmpeg runs in a process group of its own, so a Ctrl-C meant for a server does not
    cut a video short. The group is set by ``subprocess`` itself (``process_group``), not
    by a Python function run between fork and exec as imageio-ffmpeg's writer does
    (``preexec_fn``): that runs every handler registered with ``os.register_at_fork`` in
    the child of a process whose other threads (a server's) may hold what they touch,
    and crashed children there with a segmentation fault. CRF 25 is imageio's default
    quality (5 of 10).
    """
    from imageio_ffmpeg import get_ffmpeg_exe  # type: ignore[import-untyped]

    executable: str = get_ffmpeg_exe()
    command = [executable, "-y", "-loglevel", "error"]
    command += ["-f", "rawvideo", "-pix_fmt", "rgb24", "-s", f"{width}x{height}", "-r", str(FPS)]
    command += ["-i", "-", "-an", "-vcodec", "libx264", "-pix_fmt", "yuv420p", "-crf", "25"]
    done = subprocess.run(
        [*command, str(path)],
        input=frames,
        capture_output=True,
        process_group=0,
        check=False,
    )
    if done.returncode != 0:
        raise OSError(f"ffmpeg could not write {path}: {done.stderr.decode(errors='replace')}")


def mp4_bytes(video: torch.Tensor) -> bytes:
    """Return ``video`` ``(3, F, H, W)`` in [-1, 1] as the MP4 file ``write_video`` writes
    (ffmpeg writes to a file: one in a temporary folder, removed after).

    Raises:
        ModuleNotFoundError: the ``[video]`` extra is not installed.
    """
    with tempfile.TemporaryDirectory(prefix="lifecycle-video-") as folder:
        return write_video(video, Path(folder) / "video", "mp4").read_bytes()
