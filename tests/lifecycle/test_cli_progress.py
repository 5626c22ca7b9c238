"""What ``lifecycle run`` shows while it runs (DESIGN §15): a live ``rich`` display on a
terminal, plain lines on a pipe, nothing but the JSON under ``--json``. Real processes:
whether stderr is a terminal is a property of the process."""

from __future__ import annotations

import json
import os
import pty
import subprocess
import sys

from tests.lifecycle.test_cli import EXAMPLE, ROOT

RUN = (sys.executable, "-m", "lifecycle", "run", str(EXAMPLE), "--requests", "2", "--steps", "2")
ENV = {**os.environ, "TERM": "xterm-256color", "COLUMNS": "120"}


def run_on_a_terminal() -> tuple[int, str, str]:
    """Run ``lifecycle run`` with stderr on a pseudo-terminal; return its exit code,
    stdout and what the terminal received."""
    primary, secondary = pty.openpty()
    process = subprocess.Popen(
        RUN, cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=secondary, stdin=subprocess.DEVNULL
    )
    os.close(secondary)
    received = bytearray()
    while True:
        try:
            chunk = os.read(primary, 4096)
        except OSError:  # the terminal closed: the process is gone (Linux says EIO)
            break
        if not chunk:
            break
        received += chunk
    os.close(primary)
    assert process.stdout is not None
    stdout = process.stdout.read().decode()
    return process.wait(timeout=120), stdout, received.decode(errors="replace")


def run_on_pipes(*extra: str) -> subprocess.CompletedProcess[str]:
    """Run ``lifecycle run`` with stdout and stderr on pipes."""
    return subprocess.run(
        [*RUN, *extra], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=120, check=False
    )


class TestRunProgress:
    def test_a_terminal_gets_the_live_display(self) -> None:
        """On a terminal the run draws rich bars: the requests with moves, the stage's steps."""
        code, stdout, terminal = run_on_a_terminal()
        assert code == 0
        assert "\x1b[" in terminal  # drawn with terminal control sequences
        assert "━" in terminal  # rich's bars
        assert "requests" in terminal
        assert "2/2" in terminal
        assert "r2 denoise" in terminal
        assert "moves (" in terminal
        assert stdout.startswith("pipeline 'tiny-t2i': 2 requests")

    def test_a_pipe_gets_plain_lines(self) -> None:
        """With stderr on a pipe the run writes one plain line per stage and per request."""
        result = run_on_pipes()
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
        result = run_on_pipes("--json")
        assert result.returncode == 0
        assert result.stderr == ""
        (line,) = result.stdout.splitlines()
        assert json.loads(line)["summary"]["requests"] == 2
