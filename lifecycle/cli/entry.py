"""The ``lifecycle`` process's entry point: what must happen before torch is imported.

A command imports torch and the house once the command line names it (about a second
and a half of CPU; ``--help`` and ``--version`` import neither). Two things come
first: OpenMP's wait policy, which its runtime reads once when torch loads it
(``cores.wait_passively``), and SIGINT: an interrupt while the command is still
importing, or before a command installs its own handler (``run``'s ``StopOnSignal``,
``serve``'s drain), ends the process with 130 and one line, never a traceback.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Sequence

from lifecycle.cli.cores import wait_passively

__all__ = ["main"]

INTERRUPTED = 128 + signal.SIGINT
"""The shell's code for a process that SIGINT stopped."""
READER_LEFT = 128 + signal.SIGPIPE
"""The shell's code for a process whose output's reader left (SIGPIPE)."""


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``lifecycle`` command in this process; return its exit code."""
    wait_passively()
    try:
        from lifecycle.cli.main import main as command  # the command's own imports follow

        code = command(argv)
        sys.stdout.flush()  # a reader that left shows here, not in the interpreter's exit
        return code
    except KeyboardInterrupt:
        # os.write: the interrupt may have come inside a buffered write to stderr
        os.write(2, b"lifecycle: stopped by SIGINT\n")
        return INTERRUPTED
    except BrokenPipeError:
        # stdout's reader left (`lifecycle run ... | head -1`): nobody wants the rest, so
        # stop quietly as the shell's own commands do, and let the interpreter's last
        # flush of stdout go nowhere instead of failing again
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return READER_LEFT
