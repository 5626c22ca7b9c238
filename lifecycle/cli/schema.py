"""``lifecycle schema`` and ``lifecycle spec SPEC``: the spec's JSON Schema, and the
effective spec of a pipeline folder (or spec file) as TOML to edit."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import msgspec

from lifecycle.cli.arguments import SPEC_HELP, add_download_option
from lifecycle.cli.exits import ExitCode
from lifecycle.cli.output import print_json
from lifecycle.spec.errors import ConfigError
from lifecycle.spec.reading import load_spec, spec_schema

__all__ = ["add_schema_options", "add_spec_options"]


def add_schema_options(schema: argparse.ArgumentParser) -> None:
    """Set ``schema``'s handler: it takes no arguments of its own."""
    schema.set_defaults(handler=_schema)


def add_spec_options(effective: argparse.ArgumentParser) -> None:
    """Add ``spec``'s argument and options to its parser."""
    effective.add_argument("spec", type=Path, help=SPEC_HELP)
    add_download_option(effective)
    effective.set_defaults(handler=_spec)


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
