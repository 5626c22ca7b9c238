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
    port = free_port()
    specs = (str(spec), *map(str, more))
    command = ("serve", *specs, "--port", str(port), "--threads", "1", *options)
    program_source, module = ("lifecycle", True) if prelude is None else (prelude + MAIN, False)
    with start_python(
        program_source, *command, cwd=spec.parent, module=module, path=path
    ) as program:
        url = f"http://127.0.0.1:{port}"
        with loopback_client(url, timeout=5) as client:
            for _ in range(int(WATCHDOG_S / 0.1)):
                assert program.process.is_alive(), program.stderr()
                try:
                    if client.get("/readyz").status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                threading.Event().wait(0.1)
            else:
                raise AssertionError("the worker never became ready")
        yield program, url


def metric(metrics: str, name: str) -> float:
    """Return the sample ``name`` (without labels) from a worker's Prometheus text, else 0."""
    for line in metrics.splitlines():
        if line.startswith(f"{name} "):
            return float(line.split()[1])
    return 0.0
