"""A long ``lifecycle run`` keeps running totals: its memory stays flat."""

from __future__ import annotations

import gc
import io
from pathlib import Path

import pytest
import torch

from lifecycle.cli.runner import MoveTally, RequestArgs, RunOutputs, run_requests
from lifecycle.logs import configure_logging
from lifecycle.orchestrator import Orchestrator
from lifecycle.spec.reading import load_spec

ROOT = Path(__file__).resolve().parents[2]


def resident_set_bytes() -> int:
    """Return this process's resident set size, from ``/proc/self/statm``."""
    pages = int(Path("/proc/self/statm").read_text().split()[1])
    return pages * 4096


@pytest.fixture
def quiet() -> None:
    """Log at warning level to a throwaway stream, on one thread (``process_state`` restores)."""
    configure_logging("json", "warning", stream=io.StringIO())
    torch.set_num_threads(1)


@pytest.mark.slow
@pytest.mark.usefixtures("quiet")
def test_memory_stays_flat_over_2000_requests() -> None:
    """2,000 requests of the reference pipeline grow the resident set by less than 1 MiB."""
    spec = load_spec(ROOT / "examples" / "tiny_t2i.toml")
    tally = MoveTally(spec.components, keep_moves=False)
    outputs = RunOutputs()
    with Orchestrator(spec, observer=tally) as orchestrator:
        orchestrator.load()
        run_requests(
            orchestrator, outputs, requests=200, args=RequestArgs(steps=1)
        )  # allocator and caches settle
        gc.collect()
        before = resident_set_bytes()
        run_requests(orchestrator, outputs, requests=2000, args=RequestArgs(steps=1))
        gc.collect()
        grown = resident_set_bytes() - before
    assert len(outputs.request_ms) == 2200
    assert grown < 2**20, f"the resident set grew by {grown / 2**10:.0f} KiB"
