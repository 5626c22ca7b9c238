"""The ``lifecycle`` command: check a spec, draw the diagrams, print the schema.

Exit codes: 0 ok, 1 refused (or diagrams stale), 2 bad input. Results go to
stdout, logs and errors to stderr; bad input is one line, never a traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Sequence
from pathlib import Path

import msgspec
from msgspec import UnsetType

from lifecycle import diagrams
from lifecycle.config import ConfigError, PipelineSpec, load_spec, spec_schema
from lifecycle.gantt import residency_gantt
from lifecycle.logs import configure_logging
from lifecycle.orchestrator import Orchestrator
from lifecycle.plan import PipelineSnapshot, RefusalReport, SitePlan
from lifecycle.refusals import AdmissionRefused, Refusal, TransitionFailed, TransitionRefused
from lifecycle.residency import Move
from lifecycle.runner import RunReport, run_requests
from lifecycle.serving.command import add_serve_command
from lifecycle.sizes import format_bytes

EXIT_OK, EXIT_REFUSED, EXIT_BAD_INPUT = 0, 1, 2


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; return the exit code."""
    args = _parser().parse_args(argv)
    if getattr(args, "json_logs", False):
        configure_logging("json", "info")
    else:
        configure_logging(args.log_format, args.log_level)
    code: int = args.handler(args)
    return code


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lifecycle", description="Lifecycle orchestrator for diffusion serving pipelines."
    )
    parser.add_argument(
        "--log-format", choices=("json", "console", "auto"), default="auto", help="log rendering"
    )
    parser.add_argument("--log-level", default="warning", help="debug, info, warning or error")
    commands = parser.add_subparsers(required=True, metavar="COMMAND")

    check = commands.add_parser("check", help="validate a pipeline spec (admission dry run)")
    check.add_argument("spec", type=Path, help="the spec file (.toml, .json, .yaml)")
    check.add_argument("--json", action="store_true", help="print one JSON object")
    check.set_defaults(handler=_check)

    run = commands.add_parser("run", help="run requests of a pipeline (the main job)")
    run.add_argument("spec", type=Path, help="the spec file (.toml, .json, .yaml)")
    run.add_argument("--requests", type=_positive, default=4, help="requests to run")
    run.add_argument("--steps", type=_positive, default=8, help="denoising steps per request")
    run.add_argument("--json-logs", action="store_true", help="log JSON lines at info level")
    run.add_argument("--timeline", type=Path, help="write the residency timeline (Mermaid)")
    run.set_defaults(handler=_run)

    diagram = commands.add_parser("diagram", help="write the lifecycle diagrams")
    diagram.add_argument("--out", type=Path, default=Path("diagrams"), help="output folder")
    diagram.add_argument(
        "--check", action="store_true", help="exit 1 when the files differ from the machine"
    )
    diagram.set_defaults(handler=_diagram)

    schema = commands.add_parser("schema", help="print the JSON Schema of the spec")
    schema.set_defaults(handler=_schema)

    add_serve_command(commands)
    return parser


def _check(args: argparse.Namespace) -> int:
    try:
        spec = load_spec(args.spec)
    except ConfigError as err:
        if args.json:
            _print_json({"error": {"path": err.path, "message": err.message}})
        else:
            print(f"lifecycle check: {args.spec}: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT
    orchestrator = Orchestrator(spec)
    with contextlib.suppress(AdmissionRefused):
        orchestrator.admit()
    snapshot = orchestrator.snapshot()
    if args.json:
        _print_json(snapshot)
    elif snapshot.refusals:
        print(format_refusals(spec.name, snapshot.refusals))
    else:
        print(_summary(spec, snapshot, orchestrator.platform.kind))
    return EXIT_OK if snapshot.admitted else EXIT_REFUSED


def _summary(spec: PipelineSpec, snapshot: PipelineSnapshot, platform: str) -> str:
    head = (
        f"pipeline {spec.name!r}: admitted ({len(spec.components)} components, "
        f"{len(spec.stages)} stages, platform {platform})"
    )
    rows: list[tuple[str, ...]] = [("component", "kind", "loader", "residency", "attention")]
    for name, component in snapshot.components.items():
        explicit = not isinstance(spec.components[name].residency, UnsetType)
        rows.append(
            (
                name,
                component.kind,
                component.loader or "-",
                component.residency.value + (" (explicit)" if explicit else ""),
                ", ".join(_site_text(site) for site in component.attention) or "-",
            )
        )
    timeline = " -> ".join(f"{s.name} [{', '.join(s.uses)}]" for s in spec.stages)
    return "\n".join([head, *_table(rows), f"  stages: {timeline or '(none)'}"])


def _site_text(site: SitePlan) -> str:
    text = f"{site.site}={site.backend} ({site.provenance.value}"
    return text + (f", {site.reason})" if site.reason else ")")


def _table(rows: Sequence[Sequence[str]]) -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return [
        "  " + "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()
        for row in rows
    ]


def format_refusals(pipeline: str, refusals: Sequence[Refusal | RefusalReport]) -> str:
    """Return refusals the way a person reads them: what, then how to fix it."""
    count = len(refusals)
    lines = [f"lifecycle check: pipeline {pipeline!r} refused ({count} reason{'s' * (count != 1)})"]
    name_width = max(len(r.component) for r in refusals)
    code_width = max(len(r.code) for r in refusals)
    for r in refusals:
        lines.append(f"  {r.component.ljust(name_width)}  {r.code.ljust(code_width)}  {r.message}")
        lines.append(f"  {' ' * name_width}  fix: {r.hint}")
    return "\n".join(lines)


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a count >= 1, got {value}")
    return value


def _run(args: argparse.Namespace) -> int:
    try:
        spec = load_spec(args.spec)
    except ConfigError as err:
        print(f"lifecycle run: {args.spec}: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT
    moves: list[Move] = []
    with Orchestrator(spec, observer=moves.append) as orchestrator:
        try:
            orchestrator.load()
            progress = _Progress(args.requests)
            report = run_requests(
                orchestrator, moves, requests=args.requests, steps=args.steps, on_request=progress
            )
        except TransitionRefused as refused:
            print(format_refusals(spec.name, refused.refusals), file=sys.stderr)
            return EXIT_REFUSED
        except TransitionFailed as failed:
            print(f"lifecycle run: {args.spec}: {failed}", file=sys.stderr)
            return EXIT_BAD_INPUT
        except NotImplementedError as err:
            print(f"lifecycle run: {args.spec}: {err}", file=sys.stderr)
            return EXIT_BAD_INPUT
        snapshot = orchestrator.snapshot()
        if args.timeline is not None:
            args.timeline.parent.mkdir(parents=True, exist_ok=True)
            args.timeline.write_text(
                residency_gantt(
                    f"Residency of {spec.name} over {args.requests} requests",
                    list(spec.components),
                    moves,
                    end=moves[-1].at if moves else 0.0,
                ),
                encoding="utf-8",
            )
    print(_run_summary(report))
    _print_json(snapshot)
    return EXIT_OK


class _Progress:
    """A progress bar on stderr when it is a terminal; silent otherwise."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.shown = sys.stderr.isatty()

    def __call__(self, done: int) -> None:
        if self.shown:
            filled = 30 * done // self.total
            bar = "#" * filled + "." * (30 - filled)
            end = "\n" if done == self.total else ""
            print(f"\r[{bar}] {done}/{self.total} requests", end=end, file=sys.stderr)


def _run_summary(report: RunReport) -> str:
    times = sorted(report.request_ms)
    head = (
        f"pipeline {report.pipeline!r}: {report.requests} requests x {report.steps} steps, "
        f"median {times[len(times) // 2]:.1f} ms per request (min {times[0]:.1f}, "
        f"max {times[-1]:.1f})"
    )
    rows: list[tuple[str, ...]] = [
        ("component", "state", "onloads", "offloads", "moved", "move time", "attention")
    ]
    rows += [
        (
            name,
            c.state,
            str(c.onloads),
            str(c.offloads),
            format_bytes(c.bytes_moved),
            f"{c.move_seconds * 1e3:.1f} ms",
            ", ".join(c.backends) or "-",
        )
        for name, c in report.components.items()
    ]
    return "\n".join([head, *_table(rows)])


def _diagram(args: argparse.Namespace) -> int:
    if args.check:
        stale = diagrams.stale_diagrams(args.out)
        for path in stale:
            print(f"lifecycle diagram: {path} is stale; run `lifecycle diagram`", file=sys.stderr)
        return EXIT_REFUSED if stale else EXIT_OK
    for path in diagrams.write_diagrams(args.out):
        print(path)
    return EXIT_OK


def _schema(args: argparse.Namespace) -> int:
    _print_json(spec_schema())
    return EXIT_OK


def _print_json(value: object) -> None:
    sys.stdout.write(msgspec.json.format(msgspec.json.encode(value), indent=2).decode() + "\n")
