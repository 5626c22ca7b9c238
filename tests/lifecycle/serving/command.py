"""``lifecycle serve`` in a process of its own, for the tests that signal it or read its log.

The process is forked from the suite's fork server (``tests.processes``), which has
imported torch already; what it writes to stderr (its log) stays readable from the
``Program`` until the block ends.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import httpx

from lifecycle.serving.announce import base_url
from tests.lifecycle.serving.conftest import WATCHDOG_S, loopback_client
from tests.processes import Program, start_python

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
    """Run ``lifecycle serve spec *more --port 0 --threads 1 *options`` until it is ready;
    yield the program and its base URL, on the port the system picked; kill it after.

    JSON logs (``--log-format json``) have no ready line: give them ``--log-level info``,
    whose ``serving.listening`` event names the address.
    ``path``: ``sys.path`` entries of the process, as ``start_python`` takes them.
    ``prelude``: source the process runs before the command (``tests.blocked_imports``).
    """
    specs = (str(spec), *map(str, more))
    program_source, module = ("lifecycle", True) if prelude is None else (prelude + MAIN, False)
    command = ("serve", *specs, "--port", "0", "--threads", "1", *options)
    with start_python(program_source, *command, cwd=spec.parent, module=module, path=path) as (
        program
    ):
        url = _address(program)
        _wait_ready(program, url)
        yield program, url


def _address(program: Program) -> str:
    """Return the base URL the worker says it listens on: its ready line, or in JSON logs
    its ``serving.listening`` event; fail if it ends first or says neither in time."""
    for _ in range(int(WATCHDOG_S / 0.05)):
        for line in program.stderr().splitlines(keepends=True):
            if line.startswith("lifecycle serve: ready on ") and line.endswith("\n"):
                return line.removeprefix("lifecycle serve: ready on ").partition(",")[0]
            if '"event":"serving.listening"' in line and line.endswith("\n"):
                event = json.loads(line)
                return base_url(event["host"], event["port"])
        _assert_running(program)
        threading.Event().wait(0.05)
    raise AssertionError(f"the worker never said where it listens:\n{program.stderr()}")


def _wait_ready(program: Program, url: str) -> None:
    """Wait until the worker at ``url`` is ready; fail if it ends or never gets ready."""
    with loopback_client(url, timeout=5) as client:
        for _ in range(int(WATCHDOG_S / 0.1)):
            try:
                if client.get("/readyz").status_code == 200:
                    return
            except httpx.TransportError:
                pass
            _assert_running(program)
            threading.Event().wait(0.1)
    raise AssertionError("the worker never became ready")


def _assert_running(program: Program) -> None:
    """Fail with the worker's exit status and stderr if it has ended."""
    if not program.process.is_alive():
        program.process.join()
        raise AssertionError(f"exit {program.process.exitcode}: {program.stderr()}")


def metric(metrics: str, name: str) -> float:
    """Return the sample ``name`` (without labels) from a worker's Prometheus text, else 0."""
    for line in metrics.splitlines():
        if line.startswith(f"{name} "):
            return float(line.split()[1])
    return 0.0
