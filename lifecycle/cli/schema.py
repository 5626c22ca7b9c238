"""``lifecycle schema`` and ``lifecycle spec SPEC``: the spec's JSON Schema, and the
effective spec of a pipeline folder (or spec file) as TOML to edit."""

from __future__ import annotations

import argparse
import sys

import msgspec

from lifecycle.cli.exits import ExitCode
from lifecycle.cli.output import print_json
from lifecycle.spec.errors import ConfigError
from lifecycle.spec.reading import load_spec, spec_schema

__all__ = ["schema_command", "spec_command"]


def schema_command(args: argparse.Namespace) -> int:
    """Print the spec's JSON Schema."""
    print_json(spec_schema())
    return ExitCode.OK


def spec_command(args: argparse.Namespace) -> int:
    """Print the effective spec of ``args.spec`` as TOML; 2 when it cannot be read."""
    try:
        spec = load_spec(args.spec, download=args.download)
    except ConfigError as err:
        print(f"lifecycle spec: {args.spec}: {err}", file=sys.stderr)
        return ExitCode.BAD_INPUT
    print(msgspec.toml.encode(spec).decode(), end="")
    return ExitCode.OK
