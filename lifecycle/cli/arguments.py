"""Value types of the command-line options, shared by every subcommand."""

from __future__ import annotations

import argparse

from lifecycle.sizes import ByteSize


def positive(text: str) -> int:
    """Parse a count of at least 1, or tell argparse what is wrong with ``text``."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a count >= 1, got {value}")
    return value


def byte_size(text: str) -> int:
    """Parse a size like ``2GiB`` or a byte count, or tell argparse what is wrong with ``text``."""
    try:
        return ByteSize.parse(text if not text.isdigit() else int(text))
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
