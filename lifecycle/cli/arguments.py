"""Value types of the command-line options, shared by every subcommand."""

from __future__ import annotations

import argparse


def positive(text: str) -> int:
    """Parse a count of at least 1, or tell argparse what is wrong with ``text``."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a count >= 1, got {value}")
    return value


def port_number(text: str) -> int:
    """Parse a TCP port, 1 to 65535, or tell argparse what is wrong with ``text``."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port number, got {text!r}") from None
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"expected a port from 1 to 65535, got {value}")
    return value
