"""Every command's arguments and options; the command's module runs it.

Nothing here imports torch or the house: ``lifecycle COMMAND --help`` reads this module
alone, and a command's handler imports its module (``check``, ``run``, ``diagram``,
``schema``, ``serve``) only when it runs.
"""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Callable
from pathlib import Path

from components.defaults import DEFAULT_STEPS
from lifecycle.cli.arguments import (
    SPEC_HELP,
    add_download_option,
    add_specs_argument,
    byte_size,
    image_size,
    non_negative,
    port_number,
    positive,
)
from lifecycle.pictures.formats import DIAGRAM_FORMATS, VIDEO_FORMATS

__all__ = [
    "add_check_options",
    "add_diagram_options",
    "add_run_options",
    "add_schema_options",
    "add_serve_options",
    "add_spec_options",
]

Handler = Callable[[argparse.Namespace], int]
"""Runs a parsed command line; returns the exit code."""


def handler(module: str, name: str) -> Handler:
    """Return what runs a command: ``module``'s function ``name``, imported (with the
    command's room) only when the command runs, not when its help is asked for."""

    def run(args: argparse.Namespace) -> int:
        command: Handler = getattr(importlib.import_module(module), name)
        return command(args)

    return run


def add_check_options(check: argparse.ArgumentParser) -> None:
    """Add ``check``'s arguments and options to its parser."""
    add_specs_argument(
        check, "several are checked as one worker serves them, under one device budget"
    )
    check.add_argument("--json", action="store_true", help="print one JSON object")
    add_download_option(check)
    add_budget_options(check)
    check.set_defaults(
        handler=handler("lifecycle.cli.check", "check_command"), prints_refusals=True
    )


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
    run.set_defaults(handler=handler("lifecycle.cli.run", "run_command"), prints_refusals=True)


def add_diagram_options(diagram: argparse.ArgumentParser) -> None:
    """Add ``diagram``'s options to its parser."""
    diagram.add_argument("--out", type=Path, default=Path("diagrams"), help="output folder")
    diagram.add_argument(
        "--format",
        choices=tuple(DIAGRAM_FORMATS),
        default="all",
        help="which files: one drawing format, or all of them with the refusal-code table",
    )
    diagram.add_argument(
        "--spec",
        type=Path,
        action="append",
        default=[],
        metavar="SPEC",
        help="also draw this pipeline's admitted plan as NAME_plan.svg (repeatable; "
        "svg and all only)",
    )
    diagram.add_argument(
        "--check", action="store_true", help="exit 1 when the files differ from the machine"
    )
    diagram.set_defaults(
        handler=handler("lifecycle.cli.diagram", "diagram_command"), prints_refusals=True
    )


def add_schema_options(schema: argparse.ArgumentParser) -> None:
    """Set ``schema``'s handler: it takes no arguments of its own."""
    schema.set_defaults(handler=handler("lifecycle.cli.schema", "schema_command"))


def add_spec_options(effective: argparse.ArgumentParser) -> None:
    """Add ``spec``'s argument and options to its parser."""
    effective.add_argument("spec", type=Path, help=SPEC_HELP)
    add_download_option(effective)
    effective.set_defaults(handler=handler("lifecycle.cli.schema", "spec_command"))


def add_serve_options(serve: argparse.ArgumentParser) -> None:
    """Add ``serve``'s arguments and options to its parser."""
    add_specs_argument(
        serve, "several share one device budget, and a request's model names its pipeline"
    )
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on")
    serve.add_argument(
        "--port",
        type=port_number,
        default=8000,
        help="port to listen on; 0: a free one the system picks, named in the ready line",
    )
    serve.add_argument(
        "--threads",
        type=positive,
        help="torch intra-op threads (default: the physical cores this process may use, or "
        "fewer under its cgroup's CPU quota, less one for the HTTP event loop)",
    )
    serve.add_argument(
        "--api-key",
        help="require Authorization: Bearer KEY on every /v1 route (default: "
        "$LIFECYCLE_API_KEY, which keeps the key out of the process list)",
    )
    serve.add_argument(
        "--admin-key",
        help="enable the admin routes (those that change pipelines or adapters), with "
        "Authorization: Bearer KEY (default: $LIFECYCLE_ADMIN_KEY)",
    )
    add_budget_options(serve)
    add_download_option(serve)
    serve.set_defaults(handler=handler("lifecycle.cli.serve", "serve_command"))


def add_budget_options(parser: argparse.ArgumentParser) -> None:
    """Add ``--device-budget`` and ``--worker``: the budget several pipelines share."""
    parser.add_argument(
        "--device-budget",
        type=byte_size,
        metavar="SIZE",
        help="the most bytes resident on the device for every pipeline together, like 2GiB "
        "(default: the worker file's, else the smallest memory.device_budget of the specs)",
    )
    parser.add_argument(
        "--worker",
        type=Path,
        metavar="FILE",
        help="a worker file: [worker] device_budget = SIZE",
    )
