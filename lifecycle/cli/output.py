"""What a command prints for a program: one JSON object on one line of stdout."""

from __future__ import annotations

import sys

import msgspec

__all__ = ["print_json"]


def print_json(value: object) -> None:
    """Write ``value`` to stdout as one line of JSON (Structs and Enums by their values)."""
    sys.stdout.write(msgspec.json.encode(value).decode() + "\n")
