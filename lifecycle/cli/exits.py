"""The exit codes of the ``lifecycle`` command."""

from __future__ import annotations

from enum import IntEnum

__all__ = ["HELP", "ExitCode"]


class ExitCode(IntEnum):
    """What the ``lifecycle`` command's exit status means.

    A run stopped by a signal exits with the shell's code for it instead
    (130 for SIGINT, 143 for SIGTERM), after printing what completed; any command
    that SIGINT stops while it starts exits 130 too (``lifecycle.cli.entry``), and
    one whose stdout's reader left (``| head -1``) exits 141, quietly.
    """

    OK = 0
    """Done: the spec was admitted, the run completed, the files are current."""
    REFUSED = 1
    """Admission or a transition refused, with every reason (or diagrams are stale)."""
    BAD_INPUT = 2
    """The spec or an argument is wrong: nothing ran."""
    FAILED = 3
    """A failure while running: I/O, a transition that failed at run time, out of memory,
    or an error nothing caught (a bug; its traceback is in the logs)."""


HELP = """exit codes:
  0  ok
  1  refused: admission or a transition said no (or `diagram --check`: files stale)
  2  bad input: the spec or an argument is wrong, nothing ran
  3  failed while running: I/O, a transition that failed at run time, out of memory
  130, 143  `run` stopped by SIGINT, SIGTERM (the summary shows what completed);
            130 also any command SIGINT stopped while it started
  141  stdout's reader left before the output was written (`| head -1`)"""
