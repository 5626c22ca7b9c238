"""``lifecycle diagram [--out DIR] [--format F] [--spec SPEC]... [--check]``: the docs pictures.

Every file is drawn from the transition table (and a spec's admitted plan), never by
hand: ``--check`` fails when a committed copy differs from what would be written.
A plan is admitted for the CPU whatever the spec's ``device``, so that the same spec
draws the same bytes on every machine.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from attention import Platform
from lifecycle.cli.console import format_refusals
from lifecycle.cli.exits import ExitCode
from lifecycle.cli.paths import OutputPathError, prepare_folder
from lifecycle.orchestrator import Orchestrator
from lifecycle.pictures import diagrams
from lifecycle.refusals import AdmissionRefused
from lifecycle.spec.errors import ConfigError
from lifecycle.spec.reading import load_spec

__all__ = ["diagram_command"]


def diagram_command(args: argparse.Namespace) -> int:
    """Write (or ``--check``) the diagrams; return the exit code."""
    if args.spec and args.format not in ("svg", "all"):
        print(
            f"lifecycle diagram: a plan is drawn as SVG only, not {args.format}; "
            "give --format svg (or all) with --spec",
            file=sys.stderr,
        )
        return ExitCode.BAD_INPUT
    files = diagrams.render_all(args.format)
    for spec_path in args.spec:
        drawn = _plan_file(spec_path)
        if isinstance(drawn, int):
            return drawn
        files.update([drawn])
    try:
        if args.check:
            return _check(args.out, files)
        prepare_folder(args.out, "the diagram folder")
        written = diagrams.write_diagrams(args.out, files)
    except (OutputPathError, OSError) as err:
        print(f"lifecycle diagram: {_os_error_text(err)}", file=sys.stderr)
        return ExitCode.BAD_INPUT
    for path in written:
        print(path)
    return ExitCode.OK


def _plan_file(spec_path: Path) -> tuple[str, str] | int:
    """Return the plan diagram's file name and text, or the exit code of what went wrong."""
    try:
        spec = load_spec(spec_path)
    except ConfigError as err:
        print(f"lifecycle diagram: {spec_path}: {err}", file=sys.stderr)
        return ExitCode.BAD_INPUT
    orchestrator = Orchestrator(spec, platform=Platform("cpu"))
    try:
        plan = orchestrator.admit()
    except AdmissionRefused:
        refusals = orchestrator.snapshot().refusals
        print(format_refusals("diagram", spec.name, refusals, spec.components), file=sys.stderr)
        return ExitCode.REFUSED
    return diagrams.plan_name(spec), diagrams.plan(spec, plan)


def _check(folder: Path, files: dict[str, str]) -> int:
    stale = diagrams.stale_diagrams(folder, files)
    for path in stale:
        if path.is_file():
            print(
                f"lifecycle diagram: {path} is stale; run `lifecycle diagram` with the same "
                "options",
                file=sys.stderr,
            )
        else:
            print(
                f"lifecycle diagram: {path} is missing; run `lifecycle diagram --check` from "
                "the repository's root, or give --out the folder that holds the diagrams",
                file=sys.stderr,
            )
    return ExitCode.REFUSED if stale else ExitCode.OK


def _os_error_text(err: Exception) -> str:
    if isinstance(err, OSError) and err.strerror:
        return f"{err.filename}: {err.strerror}" if err.filename else err.strerror
    return str(err)
