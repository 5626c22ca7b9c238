"""What ``lifecycle run`` shows while it runs (design §15): a live ``rich`` display on a
terminal, plain lines elsewhere, nothing but the JSON under ``--json``. Real processes:
whether stderr is a terminal is a property of the process."""

from __future__ import annotations

import json
import os
import pty
import select
import time

import pytest

from tests.lifecycle.test_cli import EXAMPLE, ROOT
from tests.processes import Finished, run_python, start_python

RUN = ("run", EXAMPLE, "--requests", "2", "--steps", "2")
DEADLINE_S = 120


@pytest.fixture(autouse=True)
def terminal_size(monkeypatch: pytest.MonkeyPatch) -> None:
    """Give the runs a known terminal type and width (``rich`` reads them from the environment)."""
    monkeypatch.setenv("TERM", "xterm-256color")
    monkeypatch.setenv("COLUMNS", "120")


def run_on_a_terminal() -> tuple[Finished, str]:
    """Run ``lifecycle run`` with stderr on a pseudo-terminal; return what it left and what
    the terminal received."""
    primary, secondary = pty.openpty()
    received = bytearray()
    try:
        with start_python(
            "lifecycle", *RUN, cwd=ROOT, module=True, terminal=os.ttyname(secondary)
        ) as program:
            deadline = time.monotonic() + DEADLINE_S
            ended = False
            while not ended:  # read as it writes: a full terminal would block the run
                waited = [primary, program.process.sentinel]
                ready, _, _ = select.select(waited, [], [], max(0, deadline - time.monotonic()))
                assert ready, f"the run went on past {DEADLINE_S} s"
                ended = program.process.sentinel in ready
                if primary in ready:
                    received += os.read(primary, 4096)
            finished = program.wait(timeout=DEADLINE_S)
        os.close(secondary)
        secondary = -1
        while True:  # the rest; EIO once nothing is left (the terminal's ends are closed)
            try:
                chunk = os.read(primary, 4096)
            except OSError:
                break
            if not chunk:
                break
            received += chunk
    finally:
        os.close(primary)
        if secondary != -1:
            os.close(secondary)
    return finished, received.decode(errors="replace")


def run_on_files(*extra: str) -> Finished:
    """Run ``lifecycle run`` with stdout and stderr on files, not terminals."""
    return run_python("lifecycle", *RUN, *extra, cwd=ROOT, module=True)


class TestRunProgress:
    def test_a_terminal_gets_the_live_display(self) -> None:
        """On a terminal the run draws rich bars: the requests with moves, the stage's steps."""
        (code, stdout, _), terminal = run_on_a_terminal()
        assert code == 0
        assert "\x1b[" in terminal  # drawn with terminal control sequences
        assert "━" in terminal  # rich's bars
        assert "requests" in terminal
        assert "2/2" in terminal
        assert "r2 denoise" in terminal
        assert "moves (" in terminal
        assert stdout.startswith("pipeline 'tiny-t2i': 2 requests")

    def test_a_file_gets_plain_lines(self) -> None:
        """With stderr on no terminal the run writes one plain line per stage and per request."""
        result = run_on_files()
        assert result.returncode == 0
        lines = result.stderr.splitlines()
        assert "\x1b[" not in result.stderr
        assert [line.split(",")[0] for line in lines[:3]] == [
            "lifecycle run: request r1 (1/2): stage encode",
            "lifecycle run: request r1 (1/2): stage denoise",
            "lifecycle run: request r1 (1/2): stage decode",
        ]
        assert ", step 2/2, " in lines[1]
        assert lines[3].startswith("lifecycle run: request r1 (1/2): done in ")
        assert lines[7].endswith(" so far")
        assert len(lines) == 8
        assert result.stdout.startswith("pipeline 'tiny-t2i': 2 requests")

    def test_json_prints_only_the_json(self) -> None:
        """Under --json stderr stays empty and stdout is one JSON object."""
        result = run_on_files("--json")
        assert result.returncode == 0
        assert result.stderr == ""
        (line,) = result.stdout.splitlines()
        assert json.loads(line)["summary"]["requests"] == 2
