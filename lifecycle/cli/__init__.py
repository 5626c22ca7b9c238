"""The ``lifecycle`` command: nothing else in the project imports this room."""

from lifecycle.cli.main import main

__all__ = ["main"]
