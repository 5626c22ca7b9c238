"""The ``lifecycle`` command: check a spec, run it, draw the diagrams, print the schema.

Results go to stdout, logs and errors to stderr; bad input is one line, never
a traceback. The exit codes are ``lifecycle.cli.exits.ExitCode``.

This module knows the commands by name and their options (``lifecycle.cli.options``);
what a command imports to run (torch and the house, about a second and a half of CPU)
loads once it runs. ``lifecycle --help``, ``--version`` and every command's ``--help``
import neither.
"""

from __future__ import annotations

import argparse
import functools
from collections.abc import Callable, Sequence
from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING

from lifecycle.cli import exits, options
from lifecycle.cli.exits import ExitCode

if TYPE_CHECKING:
    from lifecycle.logs import LogFormat

__all__ = ["main"]

LOG_LEVELS = ("debug", "info", "warning", "error")
DEFAULT_LOG_LEVEL = "warning"
DEFAULT_LOG_FORMAT = "auto"

Options = Callable[[argparse.ArgumentParser], None]
"""Adds a command's arguments, options and handler to its parser."""


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; return the exit code."""
    try:
        args = _parser().parse_args(argv)
    except SystemExit as done:  # --help, --version, or a bad argument argparse reported
        return done.code if isinstance(done.code, int) else ExitCode.BAD_INPUT
    # a command was named: its handler imports torch and the house, and these come along
    from lifecycle.cli.launch import CRASHED
    from lifecycle.logs import configure_logging

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
    for name, help_text, add_options in _COMMANDS:
        add_options(
            commands.add_parser(
                name,
                help=help_text,
                description=help_text,
                epilog=exits.HELP,
                formatter_class=_HelpFormatter,
                parents=[logging_options],
            )
        )
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


_COMMANDS: tuple[tuple[str, str, Options], ...] = (
    (
        "check",
        "validate pipeline specs (admission dry run)",
        options.add_check_options,
    ),
    (
        "run",
        "run requests of a pipeline (the main job)",
        options.add_run_options,
    ),
    (
        "diagram",
        "write the lifecycle diagrams (Mermaid, DOT, SVG)",
        options.add_diagram_options,
    ),
    (
        "schema",
        "print the JSON Schema of the spec",
        options.add_schema_options,
    ),
    (
        "spec",
        "print the effective spec of a pipeline folder (or spec file) as TOML to edit",
        options.add_spec_options,
    ),
    (
        "serve",
        "serve pipelines over HTTP (OpenAI-compatible, Prometheus metrics)",
        options.add_serve_options,
    ),
)
"""Every command: its name, its help, and what adds its options."""
