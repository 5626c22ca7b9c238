"""``lifecycle serve`` in a process of its own, for the tests that signal it or read its log.

The process is forked from the suite's fork server (``tests.processes``), which has
imported torch already; what it writes to stderr (its log) stays readable from the
``Program`` until the block ends.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import httpx

from tests.lifecycle.serving.conftest import WATCHDOG_S, loopback_client
from tests.processes import Program, start_python


def free_port() -> int:
    """Return a loopback port nothing listens on now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


MAIN = "import sys\nfrom lifecycle.cli.main import main\nsys.exit(main(sys.argv[1:]))\n"
"""The ``lifecycle`` command as a program, for a process that runs other source first."""


@contextmanager
def serving(
    spec: Path,
    *options: str,
    more: tuple[Path, ...] = (),
    path: Sequence[Path] = (),
    prelude: str | None = None,
) -> Iterator[tuple[Program, str]]:
    """Run ``lifecycle serve spec *more --threads 1 *options`` on a free loopback port until
    it is ready; yield the program and its base URL; kill it after.

    ``path``: ``sys.path`` entries of the process, as ``start_python`` takes them.
    ``prelude``: source the process runs before the command (``tests.blocked_imports``).
    """
    specs = (str(spec), *map(str, more))
    program_source, module = ("lifecycle", True) if prelude is None else (prelude + MAIN, False)
    taken = []
    for _ in range(PORT_TRIES):
        port = free_port()
        command = ("serve", *specs, "--port", str(port), "--threads", "1", *options)
        with start_python(
            program_source, *command, cwd=spec.parent, module=module, path=path
        ) as program:
            url = f"http://127.0.0.1:{port}"
            if _ready(program, url):
                yield program, url
                return
            taken.append(program.stderr())
    raise AssertionError(f"no free port held for {PORT_TRIES} tries:\n{taken[-1]}")


PORT_TRIES = 3
"""How many free ports ``serving`` tries: between ``free_port`` and the worker's bind,
another process's connection may take the port the system just handed back."""


def _ready(program: Program, url: str) -> bool:
    """Wait until the worker at ``url`` is ready; False if it ended because the port was
    taken (exit 2, ``cannot listen on``); fail if it ended otherwise or never got ready."""
    with loopback_client(url, timeout=5) as client:
        for _ in range(int(WATCHDOG_S / 0.1)):
            if not program.process.is_alive():
                program.process.join()
                if program.process.exitcode == 2 and "cannot listen on" in program.stderr():
                    return False
                raise AssertionError(f"exit {program.process.exitcode}: {program.stderr()}")
            try:
                if client.get("/readyz").status_code == 200:
                    return True
            except httpx.TransportError:
                pass
            threading.Event().wait(0.1)
    raise AssertionError("the worker never became ready")


def metric(metrics: str, name: str) -> float:
    """Return the sample ``name`` (without labels) from a worker's Prometheus text, else 0."""
    for line in metrics.splitlines():
        if line.startswith(f"{name} "):
            return float(line.split()[1])
    return 0.0
