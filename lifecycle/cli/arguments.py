"""Value types of the command-line options, shared by every subcommand."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import NamedTuple

__all__ = [
    "SPEC_HELP",
    "add_download_option",
    "add_specs_argument",
    "byte_size",
    "image_size",
    "non_negative",
    "port_number",
    "positive",
]

_SPEC = (
    "spec file (.toml, .json, .yaml), a diffusers-format pipeline folder, or a model id "
    "ORG/NAME[@REVISION] in the Hugging Face cache"
)
"""What a spec argument may name."""

SPEC_HELP = f"the {_SPEC} (an existing path of that name wins)"
"""The help of the one spec a command takes (``run``, ``spec``)."""


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
    """Parse a TCP port, 0 to 65535 (0: one the system picks), or tell argparse what is
    wrong with ``text``."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port number, got {text!r}") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"expected a port from 0 to 65535, got {value}")
    return value


def byte_size(text: str) -> int:
    """Parse a size like ``2GiB`` or a byte count, or tell argparse what is wrong with ``text``."""
    # imported when a size is parsed: the spec package imports torch, which --help never needs
    from lifecycle.spec.sizes import ByteSize

    try:
        return ByteSize.parse(text if not text.isdigit() else int(text))
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def non_negative(text: str) -> int:
    """Parse a whole number of at least 0 (a seed), or tell argparse what is wrong."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {value}")
    return value


class ImageSize(NamedTuple):
    """An image's size in pixels, written ``WIDTHxHEIGHT`` as OpenAI's ``size`` is."""

    width: int
    height: int

    def __str__(self) -> str:
        return f"{self.width}x{self.height}"


def image_size(text: str) -> ImageSize:
    """Parse ``WIDTHxHEIGHT`` (``512x768``), or tell argparse what is wrong with ``text``."""
    width, _, height = text.lower().partition("x")
    if not (width.isdigit() and height.isdigit() and int(width) and int(height)):
        raise argparse.ArgumentTypeError(
            f"expected WIDTHxHEIGHT in pixels, such as 512x768, got {text!r}"
        )
    return ImageSize(int(width), int(height))


def add_specs_argument(parser: argparse.ArgumentParser, several: str) -> None:
    """Add the specs a command takes, one or more; ``several`` says what more than one do."""
    parser.add_argument(
        "specs",
        metavar="spec",
        nargs="+",
        type=Path,
        help=f"a {_SPEC}; {several}",
    )


def add_download_option(parser: argparse.ArgumentParser) -> None:
    """Add ``--download``: a model id the Hugging Face cache lacks is fetched into it."""
    parser.add_argument(
        "--download",
        action="store_true",
        help="download a model id (ORG/NAME[@REVISION]) the Hugging Face cache lacks "
        "(default: read the cache only, never the network)",
    )
