"""The options of ``lifecycle run``; ``lifecycle.cli.run`` runs it."""

from __future__ import annotations

import argparse
from pathlib import Path

from components.batch import DEFAULT_STEPS
from lifecycle.cli.arguments import (
    SPEC_HELP,
    add_download_option,
    image_size,
    non_negative,
    positive,
)
from lifecycle.cli.run import run_command
from lifecycle.pictures.video import VIDEO_FORMATS

__all__ = ["add_run_options"]


def add_run_options(run: argparse.ArgumentParser) -> None:
    """Add ``run``'s argument and options to its parser."""
    run.add_argument("spec", type=Path, help=SPEC_HELP)
    run.add_argument("--requests", type=positive, default=4, help="requests to run")
    run.add_argument(
        "--steps",
        type=positive,
        help="denoising steps per request (default: a folder's pipeline class's, else "
        f"{DEFAULT_STEPS})",
    )
    run.add_argument(
        "--seed",
        type=non_negative,
        default=0,
        help="request i draws its inputs from seed N + i; a pipeline from a folder as "
        'diffusers\' generator=torch.Generator("cpu").manual_seed(N + i)',
    )
    run.add_argument(
        "--size",
        type=image_size,
        metavar="WxH",
        help="the images' width and height in pixels, for a pipeline from a folder "
        "(default: its pipeline class's)",
    )
    run.add_argument(
        "--threads",
        type=positive,
        help="torch intra-op threads (default: the physical cores this process may use, or "
        "fewer under its cgroup's CPU quota; the summary says which)",
    )
    run.add_argument(
        "--prompt",
        action="append",
        default=[],
        metavar="TEXT",
        help="a sentence every request carries (repeatable); a sentence encoder shows each "
        "one's nearest neighbour (default: seeded sentences, one a request)",
    )
    run.add_argument(
        "--negative-prompt",
        metavar="TEXT",
        help="the text every image is guided away from (with --guidance-scale above 1)",
    )
    run.add_argument(
        "--out",
        type=Path,
        help="write each request's images there as PNG (rI-J.png), its videos as "
        "--video-format says (rI-J.mp4)",
    )
    run.add_argument(
        "--json", action="store_true", help="print one JSON object: summary and snapshot"
    )
    run.add_argument("--json-logs", action="store_true", help="log JSON lines at info level")
    run.add_argument("--timeline", type=Path, help="write the residency timeline (Mermaid)")
    run.add_argument("--nproc", type=positive, help="fork N workers through torchrun's launcher")
    run.add_argument(
        "--guidance-scale", type=float, help="CFG scale (default: the denoiser's option)"
    )
    add_download_option(run)
    run.add_argument(
        "--guidance-scale-2",
        type=float,
        help="CFG scale of a second expert's steps (Wan 2.2 A14B; default: --guidance-scale)",
    )
    run.add_argument(
        "--frames",
        type=positive,
        help="frames of each video, 4k + 1, for a pipeline that makes videos (default: its "
        "pipeline class's, 81 for Wan)",
    )
    run.add_argument(
        "--image",
        type=Path,
        help="the image every video starts from, for an image-to-video pipeline",
    )
    run.add_argument(
        "--last-image",
        type=Path,
        help="the image every video ends on, for an image-to-video pipeline",
    )
    run.add_argument(
        "--video-format",
        choices=VIDEO_FORMATS,
        help="how --out writes videos: mp4 (needs the [video] extra), webp (animated, "
        "Pillow) or png (a folder rI-J/ of lossless frames); default: mp4 where imageio "
        "and imageio-ffmpeg are installed, else webp",
    )
    run.set_defaults(handler=run_command, prints_refusals=True)
