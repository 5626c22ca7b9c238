"""The ``lifecycle`` command: check a spec, run it, draw the diagrams, print the schema.

Results go to stdout, logs and errors to stderr; bad input is one line, never
a traceback. The exit codes are ``lifecycle.cli.exits.ExitCode``.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import sys
from collections.abc import Sequence
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import msgspec
from msgspec import UnsetType

from components.batch import DEFAULT_STEPS
from lifecycle.cli import exits
from lifecycle.cli.arguments import add_download_option, image_size, non_negative, positive
from lifecycle.cli.console import (
    ACCELERATION_HEADINGS,
    fallback_legend,
    format_refusals,
    is_accelerated,
    table,
)
from lifecycle.cli.diagram import add_diagram_command
from lifecycle.cli.exits import ExitCode
from lifecycle.cli.launch import CRASHED
from lifecycle.cli.output import print_json
from lifecycle.cli.run import run_command
from lifecycle.cli.serve import add_budget_options, add_serve_command
from lifecycle.device.shared import SharedDevice, worker_budget
from lifecycle.logs import LogFormat, configure_logging
from lifecycle.orchestrator import Orchestrator
from lifecycle.pictures.video import VIDEO_FORMATS
from lifecycle.plan import PipelineSnapshot, SitePlan
from lifecycle.refusals import AdmissionRefused
from lifecycle.spec.errors import ConfigError
from lifecycle.spec.model_ids import parse_model_id, snapshot_folder
from lifecycle.spec.reading import load_spec, load_worker_file, spec_schema
from lifecycle.spec.sizes import format_bytes
from lifecycle.spec.structs import PipelineSpec

__all__ = ["main"]

LOG_LEVELS = ("debug", "info", "warning", "error")
SPEC_HELP = (
    "the spec file (.toml, .json, .yaml), a diffusers-format pipeline folder, or a model id "
    "ORG/NAME[@REVISION] in the Hugging Face cache (an existing path of that name wins)"
)
DEFAULT_LOG_LEVEL = "warning"
DEFAULT_LOG_FORMAT = "auto"


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; return the exit code."""
    try:
        args = _parser().parse_args(argv)
    except SystemExit as done:  # --help, --version, or a bad argument argparse reported
        return done.code if isinstance(done.code, int) else ExitCode.BAD_INPUT
    json_logs = getattr(args, "json_logs", False)
    fmt: LogFormat = "json" if json_logs else args.log_format
    level: str = "info" if json_logs else args.log_level
    quiet = level == DEFAULT_LOG_LEVEL
    # check, run and diagram print every refusal with its fix: at the default level the
    # event would say it again on a console, or in the file that captures stderr with
    # stdout (2>&1); JSON logs asked for by name, and more verbose levels, keep it
    prints = getattr(args, "prints_refusals", False)
    said = ("lifecycle.refused",) if quiet and prints and fmt != "json" else ()
    # on a console a refusal (serve's too) and a crash are one line each: their events,
    # the crash's traceback with it, are for JSON lines and verbose levels
    hidden = ("lifecycle.refused", CRASHED) if quiet else ()
    configure_logging(fmt, level, omit=said, omit_on_console=hidden)
    code: int = args.handler(args)
    return code


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Keep the epilog's exit-code table as written; end an option's help with its default.

    An option whose help already speaks of its default (one that depends on the spec or
    the machine) keeps its own words; flags and options without a value by default show
    none.
    """

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = action.default
        if "default" in text or default is None or default is argparse.SUPPRESS:
            return text
        if isinstance(default, bool) or default == []:  # flags, repeatable options
            return text
        return f"{text} (default: %(default)s)"


@functools.cache  # built once: in-process callers (tests, embedders) run main() many times
def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lifecycle",
        description="Lifecycle orchestrator for diffusion serving pipelines.",
        epilog=exits.HELP,
        formatter_class=_HelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    _logging_options(parser, default=True)
    # every subcommand takes the logging options too; its copy has no default of its
    # own, so that one not given after the subcommand never hides one given before it
    logging_options = argparse.ArgumentParser(add_help=False)
    _logging_options(logging_options, default=False)
    commands = parser.add_subparsers(required=True, metavar="COMMAND")

    def command(name: str, help_text: str) -> argparse.ArgumentParser:
        return commands.add_parser(
            name,
            help=help_text,
            description=help_text,
            epilog=exits.HELP,
            formatter_class=_HelpFormatter,
            parents=[logging_options],
        )

    check = command("check", "validate pipeline specs (admission dry run)")
    check.add_argument(
        "specs",
        metavar="spec",
        nargs="+",
        type=Path,
        help="a spec file (.toml, .json, .yaml), a diffusers-format pipeline folder, or a "
        "model id ORG/NAME[@REVISION] in the Hugging Face cache; several are checked as one "
        "worker serves them, under one device budget",
    )
    check.add_argument("--json", action="store_true", help="print one JSON object")
    add_download_option(check)
    add_budget_options(check)
    check.set_defaults(handler=_check, prints_refusals=True)

    run = command("run", "run requests of a pipeline (the main job)")
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

    add_diagram_command(command)

    schema = command("schema", "print the JSON Schema of the spec")
    schema.set_defaults(handler=_schema)

    effective = command(
        "spec", "print the effective spec of a pipeline folder (or spec file) as TOML to edit"
    )
    effective.add_argument("spec", type=Path, help=SPEC_HELP)
    add_download_option(effective)
    effective.set_defaults(handler=_spec)

    add_serve_command(command)
    return parser


def _logging_options(parser: argparse.ArgumentParser, *, default: bool) -> None:
    """Add the logging options, with their defaults or (a subcommand's copy) without."""
    parser.add_argument(
        "--log-format",
        choices=("json", "console", "auto"),
        default=DEFAULT_LOG_FORMAT if default else argparse.SUPPRESS,
        help="log rendering; auto: console on a terminal, else JSON lines "
        f"(default: {DEFAULT_LOG_FORMAT})",
    )
    parser.add_argument(
        "--log-level",
        type=str.lower,
        choices=LOG_LEVELS,
        default=DEFAULT_LOG_LEVEL if default else argparse.SUPPRESS,
        help=f"the least severe events logged (default: {DEFAULT_LOG_LEVEL})",
    )


def _version() -> str:
    try:
        return version("pipeline-lifecycle")
    except PackageNotFoundError:
        return "(not installed)"


def _check(args: argparse.Namespace) -> int:
    """Admit every spec; several (or a worker budget) as one worker serves them."""
    try:
        specs = [load_spec(path, download=args.download) for path in args.specs]
        settings = None if args.worker is None else load_worker_file(args.worker)
    except ConfigError as err:
        if args.json:
            print_json({"error": {"path": err.path, "message": err.message}})
        else:
            print(f"lifecycle check: {err.source}: {err}", file=sys.stderr)
        return ExitCode.BAD_INPUT
    shared = None
    if len(specs) > 1 or args.device_budget is not None or settings is not None:
        limit, key = worker_budget(specs, args.device_budget, settings)
        shared = SharedDevice(device_budget=limit, budget_key=key)
    try:
        orchestrators = [Orchestrator(spec, shared=shared) for spec in specs]
    except ValueError as err:  # specs on different devices
        print(f"lifecycle check: {err}", file=sys.stderr)
        return ExitCode.BAD_INPUT
    for orchestrator in orchestrators:
        with contextlib.suppress(AdmissionRefused):
            orchestrator.admit()
    snapshots = [orchestrator.snapshot() for orchestrator in orchestrators]
    admitted = all(snapshot.admitted for snapshot in snapshots)
    if args.json:
        if len(snapshots) == 1:
            print_json(snapshots[0])
        else:
            budget = None if shared is None else shared.budget.limit
            print_json({"admitted": admitted, "device_budget": budget, "pipelines": snapshots})
    else:
        for spec, snapshot, orchestrator in zip(specs, snapshots, orchestrators, strict=True):
            if snapshot.refusals:
                print(format_refusals("check", spec.name, snapshot.refusals, spec.components))
            else:
                print(_summary(spec, snapshot, orchestrator.platform.kind))
    return ExitCode.OK if admitted else ExitCode.REFUSED


def _summary(spec: PipelineSpec, snapshot: PipelineSnapshot, platform: str) -> str:
    head = (
        f"pipeline {spec.name!r}: admitted ({len(spec.components)} components, "
        f"{len(spec.stages)} stages, platform {platform})"
    )
    rows: list[tuple[str, ...]] = [
        ("component", "kind", "loader", "size", "residency", "attention")
    ]
    caches = any(component.cache is not None for component in snapshot.components.values())
    if caches:
        rows[0] += ("cache",)
    accelerated = is_accelerated(snapshot.components.values())
    if accelerated:
        rows[0] += ACCELERATION_HEADINGS
    for name, component in snapshot.components.items():
        explicit = not isinstance(spec.components[name].residency, UnsetType)
        rows.append(
            (
                name,
                component.kind,
                component.loader or "-",
                "-" if component.bytes is None else format_bytes(component.bytes),
                component.residency.value + (" (explicit)" if explicit else ""),
                ", ".join(_site_text(site) for site in component.attention) or "-",
            )
        )
        if caches:
            rows[-1] += ("-" if component.cache is None else component.cache.describe(),)
        if accelerated:
            rows[-1] += (component.compile, component.quantization)
    adapters: list[tuple[str, ...]] = [("adapter", "component", "mode", "scale", "path")]
    adapters += [(a.name, a.component, a.mode, f"{a.scale:g}", a.path) for a in snapshot.adapters]
    timeline = " -> ".join(stage.describe() for stage in spec.stages)
    source = [] if snapshot.source is None else [f"  source: {_source_text(snapshot)}"]
    reasons = {site.reason for c in snapshot.components.values() for site in c.attention}
    return "\n".join(
        [
            head,
            *table(rows),
            *(table(adapters) if snapshot.adapters else ()),
            f"  stages: {timeline or '(none)'}",
            *source,
            *fallback_legend(reasons),
        ]
    )


def _source_text(snapshot: PipelineSnapshot) -> str:
    """Say where the pipeline's folder is: its path, or its model id's revision and folder."""
    model_id = None if snapshot.source is None else parse_model_id(snapshot.source)
    if model_id is None:
        return str(snapshot.source)
    return f"{model_id.repo} at revision {snapshot.revision} ({snapshot_folder(model_id)})"


def _site_text(site: SitePlan) -> str:
    text = f"{site.site}={site.backend} ({site.provenance.value}"
    return text + (f", {site.reason})" if site.reason else ")")


def _schema(args: argparse.Namespace) -> int:
    print_json(spec_schema())
    return ExitCode.OK


def _spec(args: argparse.Namespace) -> int:
    try:
        spec = load_spec(args.spec, download=args.download)
    except ConfigError as err:
        print(f"lifecycle spec: {args.spec}: {err}", file=sys.stderr)
        return ExitCode.BAD_INPUT
    print(msgspec.toml.encode(spec).decode(), end="")
    return ExitCode.OK
