"""What ``lifecycle run`` shows while it runs (design §15): a live display with ``rich``
on a terminal, plain lines when stderr is not one, nothing under ``--json`` (nor with
JSON logs, whose stderr is JSON lines only).

Every display hears the same facts from the runner: a request began, a stage began,
a denoising step ended, a component moved (the orchestrator's observer), a stage or
request ended. Everything goes to stderr: stdout carries only the result.
"""

from __future__ import annotations

import sys
import time
from typing import Protocol, TextIO

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from components.batch import StepDone
from lifecycle.events import Event, Move
from lifecycle.spec.sizes import format_bytes

__all__ = ["RunProgress", "Silent", "run_progress"]


class RunProgress(Protocol):
    """Who hears how a run goes (see the module)."""

    def request_began(self, request_id: str, index: int) -> None:
        """Request ``request_id``, the ``index``-th of the run (from 1), began."""

    def stage_began(self, stage: str) -> None:
        """The current request entered ``stage``."""

    def stepped(self, done: StepDone) -> None:
        """The current stage finished a denoising step."""

    def observe(self, event: Event) -> None:
        """The orchestrator reported ``event`` (moves are counted)."""

    def stage_ended(self) -> None:
        """The current stage ended."""

    def request_ended(self, milliseconds: float) -> None:
        """The current request ended after ``milliseconds``."""

    def close(self) -> None:
        """The run is over: leave the display as it ends."""


class _Moves:
    """Running totals of the moves a run made."""

    def __init__(self) -> None:
        self.count = 0
        self.bytes = 0

    def observe(self, event: Event) -> None:
        if isinstance(event, Move):
            self.count += 1
            self.bytes += event.bytes

    def __str__(self) -> str:
        return f"{self.count} move{'s' * (self.count != 1)} ({format_bytes(self.bytes)})"


class Silent:
    """Show nothing (``--json``, JSON logs, and ranks other than the first)."""

    def request_began(self, request_id: str, index: int) -> None:
        """Show nothing."""

    def stage_began(self, stage: str) -> None:
        """Show nothing."""

    def stepped(self, done: StepDone) -> None:
        """Show nothing."""

    def observe(self, event: Event) -> None:
        """Show nothing."""

    def stage_ended(self) -> None:
        """Show nothing."""

    def request_ended(self, milliseconds: float) -> None:
        """Show nothing."""

    def close(self) -> None:
        """Show nothing."""


class Lines:
    """One plain line per stage and per request, for logs and pipes.

    Args:
        total: the requests the run will make.
        stream: where the lines go.
    """

    def __init__(self, total: int, stream: TextIO) -> None:
        self.total = total
        self.stream = stream
        self.moves = _Moves()
        self._request = ""
        self._stage = ""
        self._steps = ""
        self._stage_began = 0.0

    def request_began(self, request_id: str, index: int) -> None:
        """Remember the request, for the lines of its stages."""
        self._request = f"request {request_id} ({index}/{self.total})"

    def stage_began(self, stage: str) -> None:
        """Remember the stage and when it began."""
        self._stage, self._steps, self._stage_began = stage, "", time.perf_counter()

    def stepped(self, done: StepDone) -> None:
        """Remember the steps done, for the stage's line."""
        self._steps = f", step {done.step}/{done.steps}"

    def observe(self, event: Event) -> None:
        """Count moves."""
        self.moves.observe(event)

    def stage_ended(self) -> None:
        """Write the stage's line: its steps and how long it took."""
        ms = (time.perf_counter() - self._stage_began) * 1e3
        self._write(f"{self._request}: stage {self._stage}{self._steps}, {ms:.1f} ms")

    def request_ended(self, milliseconds: float) -> None:
        """Write the request's line, with the moves so far."""
        self._write(f"{self._request}: done in {milliseconds:.1f} ms; {self.moves} so far")

    def close(self) -> None:
        """Nothing is left to write."""

    def _write(self, line: str) -> None:
        print(f"lifecycle run: {line}", file=self.stream, flush=True)


class Live:
    """A live display: a bar of the requests (with the moves) and one of the current
    stage's steps.

    Args:
        total: the requests the run will make.
        stream: the terminal.
    """

    def __init__(self, total: int, stream: TextIO) -> None:
        self.moves = _Moves()
        self._bars = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[detail]}"),
            TimeElapsedColumn(),
            console=Console(file=stream),
        )
        self._requests = self._bars.add_task("requests", total=total, detail=str(self.moves))
        self._stage = self._bars.add_task("stage", total=None, detail="")
        self._request = ""
        self._bars.start()

    def request_began(self, request_id: str, index: int) -> None:
        """Name the request on the stage bar."""
        self._request = request_id

    def stage_began(self, stage: str) -> None:
        """Show the stage, its steps still unknown."""
        self._bars.reset(self._stage, total=None, description=f"{self._request} {stage}", detail="")

    def stepped(self, done: StepDone) -> None:
        """Advance the stage bar to the step done."""
        self._bars.update(self._stage, total=done.steps, completed=done.step, detail="steps")

    def observe(self, event: Event) -> None:
        """Count moves on the requests bar."""
        self.moves.observe(event)
        if isinstance(event, Move):
            self._bars.update(self._requests, detail=str(self.moves))

    def stage_ended(self) -> None:
        """Leave the stage bar as it is until the next stage."""

    def request_ended(self, milliseconds: float) -> None:
        """Advance the requests bar."""
        self._bars.advance(self._requests)

    def close(self) -> None:
        """Stop refreshing; the last frame stays on the terminal."""
        self._bars.stop()


def run_progress(total: int, *, is_quiet: bool, is_main_rank: bool) -> RunProgress:
    """Return the display for a run of ``total`` requests: live on a terminal, lines
    otherwise; nothing when ``is_quiet`` (``--json``, JSON logs) or on ranks other than
    the first."""
    if is_quiet or not is_main_rank:
        return Silent()
    if sys.stderr.isatty():
        return Live(total, sys.stderr)
    return Lines(total, sys.stderr)
