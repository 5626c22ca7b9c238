"""``lifecycle run``'s default thread count against ``--threads 1``, beside busy processes.

A machine shared with other work is where a default of one thread a core collapses: an
OpenMP team whose threads spin at every barrier while a busy process holds one of their
cores (issue 30, item 4). Each cell runs ``lifecycle run TARGET --json`` as a process of
its own, since the default is chosen, and OpenMP's wait policy set, when the command
starts:

- **default**: the command as shipped (its count and the reason it prints);
- **--threads 1**;
- **default, spinning**: the default count under OpenMP's own wait policy, as before the
  command set ``OMP_WAIT_POLICY=PASSIVE`` (torch imported before the command starts, so
  the runtime never sees it): what the wait policy is worth;

with 0, 1 and 2 processes beside it that each spin on a core (a Python loop). The
cells of one row run interleaved, in an order rotated every round; the table gives the
median request time (median over rounds) and each default over ``--threads 1`` (median
and range of the rounds' ratios). The load average at the row's start says how busy the
machine was before this benchmark's own spinners (on a shared machine, "0 busy" is not
idle). Targets are ``examples/tiny_t2i.toml`` (8 steps) and a tiny Flux folder at
256x256 (``benchmarks.make_pipeline flux``, 2 steps). Goal: default <= 1.2x of
``--threads 1`` in every row.

Run: ``python -m benchmarks threads``.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import NamedTuple

from benchmarks._environment import announce
from benchmarks.make_pipeline import write_pipeline

ROOT = Path(__file__).resolve().parents[1]
TINY_T2I = ROOT / "examples" / "tiny_t2i.toml"
BUSY = (0, 1, 2)
ROUNDS = 3
POLICY = "OMP_WAIT_POLICY"
"""Left out of every cell's environment: the command's own choice is what is measured."""
SPIN = "import os\nparent = os.getppid()\nwhile os.getppid() == parent:\n    pass"
"""A busy process: it spins until this one ends, however this one ends."""


class Target(NamedTuple):
    """A pipeline to run and the arguments of its requests."""

    name: str
    path: Path
    argv: tuple[str, ...]


COMMAND = ("-m", "lifecycle")
SPINNING = (
    "-c",
    "import sys, torch; from lifecycle.cli.entry import main; sys.exit(main(sys.argv[1:]))",
)
"""The command with torch imported first: OpenMP starts before it could set a policy."""


class Cell(NamedTuple):
    """One way of running a target: the interpreter's arguments, then the command's extra ones."""

    name: str
    program: tuple[str, ...]
    argv: tuple[str, ...]


CELLS = (
    Cell("default", COMMAND, ()),
    Cell("--threads 1", COMMAND, ("--threads", "1")),
    Cell("default, spinning", SPINNING, ()),
)


class Measured(NamedTuple):
    """One run's median request time, its thread count and the reason it gave."""

    ms: float
    threads: int
    reason: str


def measure(target: Target, cell: Cell) -> Measured:
    """Run ``lifecycle run`` on ``target`` as ``cell`` says, in a fresh process."""
    env = {name: value for name, value in os.environ.items() if name != POLICY}
    command = [sys.executable, *cell.program, "run", str(target.path), "--json"]
    done = subprocess.run(
        [*command, *target.argv, *cell.argv],
        capture_output=True,
        text=True,
        check=True,
        env=env,
        cwd=ROOT,
    )
    summary = json.loads(done.stdout)["summary"]
    return Measured(
        statistics.median(summary["request_ms"]), summary["threads"], summary["threads_reason"]
    )


@contextmanager
def spinners(count: int) -> Iterator[None]:
    """Keep ``count`` processes spinning on a core each while the block runs."""
    processes = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]
    try:
        yield
    finally:
        for process in processes:
            process.kill()
            process.wait()


def row(target: Target, busy: int) -> str:
    """Measure every cell of ``target`` beside ``busy`` spinners; return the table row."""
    load = os.getloadavg()[0]
    runs: dict[Cell, list[Measured]] = {cell: [] for cell in CELLS}
    with spinners(busy):
        for round_ in range(ROUNDS):
            shift = round_ % len(CELLS)
            for cell in CELLS[shift:] + CELLS[:shift]:
                runs[cell].append(measure(target, cell))
    one = runs[CELLS[1]]
    default = runs[CELLS[0]][0]
    return (
        f"| {target.name} | {busy} | {load:.1f} | {default.threads}: {default.reason} "
        f"| {_ms(runs[CELLS[0]])} | {_ms(one)} | {_ratio(runs[CELLS[0]], one)} "
        f"| {_ms(runs[CELLS[2]])} | {_ratio(runs[CELLS[2]], one)} |"
    )


def _ms(runs: Sequence[Measured]) -> str:
    return f"{statistics.median(run.ms for run in runs):.1f}"


def _ratio(runs: Sequence[Measured], base: Sequence[Measured]) -> str:
    ratios = [run.ms / one.ms for run, one in zip(runs, base, strict=True)]
    return f"{statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f})"


def main() -> None:
    """Print the table: each target beside 0, 1 and 2 busy processes."""
    with tempfile.TemporaryDirectory() as folder:
        flux = write_pipeline("flux", Path(folder) / "flux")
        targets = (
            Target("tiny-t2i, 8 steps", TINY_T2I, ("--requests", "6", "--steps", "8")),
            Target(
                "flux folder 256x256, 2 steps",
                flux,
                ("--requests", "2", "--steps", "2", "--size", "256x256", "--prompt", "a red cat"),
            ),
        )
        print(
            f"### Median ms per request, {ROUNDS} interleaved rounds; {os.cpu_count()} CPUs; "
            f"default/1: ratio of the default to --threads 1 (median, range)"
        )
        print()
        print(
            "| target | busy beside | load avg | default threads: why | default ms "
            "| --threads 1 ms | default/1 | spinning ms | spinning/1 |"
        )
        print("|---|---:|---:|---|---:|---:|---:|---:|---:|")
        for target in targets:
            for busy in BUSY:
                print(row(target, busy), flush=True)
        print()


if __name__ == "__main__":
    announce("threads")
    main()
