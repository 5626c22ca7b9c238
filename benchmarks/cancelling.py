"""Measure how soon a cancelled embeddings request stops (issue 30, 13).

A request of 2048 short inputs (4 to 12 words of the kind's prompts, as the probe
sent) runs on a worker of ``examples/minilm_embed.toml`` in this process and is
cancelled 1 s after it starts running, by ``Worker.cancel``, where ``DELETE
/v1/requests/{id}``, a client that leaves and a ``timeout`` all lead. The time is from
the cancel to ``request.cancelled``. The encoder runs its rows in micro-batches
(``components.kinds.micro_batches``) against one forward (micro-batches of more slots
than the request holds), the two alternating in rounds, order reversed every round.
The same request run to its end, both ways, says what the micro-batches cost when
nothing is cancelled. Goal: stopped within 0.5 s.

Run: ``python -m benchmarks cancelling``.
"""

from __future__ import annotations

import statistics
import threading
import time
from pathlib import Path

from benchmarks._environment import announce
from components.kinds import micro_batches
from components.kinds.minilm_text_encoder import PROMPTS
from lifecycle.events import Event, RequestCancelled
from lifecycle.orchestrator import Orchestrator
from lifecycle.serving.jobs import BatchKey, Job, RequestState, estimate_tokens
from lifecycle.serving.metrics import ServingMetrics
from lifecycle.serving.worker import Worker

SPEC = Path(__file__).resolve().parents[1] / "examples" / "minilm_embed.toml"
INPUTS = [" ".join(PROMPTS[i % len(PROMPTS)].split()[: 4 + i % 9]) for i in range(2048)]
"""Sentences of 4 to 12 words."""
CANCEL_AFTER_S = 1.0
ROUNDS = 3
WAYS = {"one forward": 10**9, "micro-batches": micro_batches.MICRO_BATCH_SLOTS}
"""Each way's micro-batch size in padded token slots."""


class Stops:
    """When each request's ``request.cancelled`` arrived (``time.perf_counter``)."""

    def __init__(self) -> None:
        self.at: dict[str, float] = {}
        self.arrived = threading.Condition()

    def __call__(self, event: Event) -> None:
        """Note the arrival of a ``request.cancelled``."""
        if isinstance(event, RequestCancelled):
            with self.arrived:
                self.at[event.request_id] = time.perf_counter()
                self.arrived.notify_all()

    def wait(self, request_id: str) -> float:
        """Return when ``request.cancelled`` of ``request_id`` arrived, waiting for it."""
        with self.arrived:
            self.arrived.wait_for(lambda: request_id in self.at)
            return self.at[request_id]


def run(worker: Worker, stops: Stops, job_id: str, cancel: bool) -> float:
    """Run the request to its end (its seconds), or cancel it once it has run 1 s (the
    seconds from the cancel to ``request.cancelled``)."""
    job = Job(
        id=job_id,
        key=BatchKey(endpoint="embeddings"),
        prompts=INPUTS,
        tokens=estimate_tokens(INPUTS),
    )
    started = time.perf_counter()
    future = worker.submit(job)
    if not cancel:
        future.result()
        return time.perf_counter() - started
    while (status := worker.status(job_id)) is None or status.state is not RequestState.RUNNING:
        time.sleep(0.001)
    time.sleep(CANCEL_AFTER_S)
    cancelled = time.perf_counter()
    worker.cancel(job_id, "deleted")
    return stops.wait(job_id) - cancelled


def main() -> None:
    """Print the cancel-to-stop time and the whole request's time, each way."""
    worker = Worker([Orchestrator.from_file(SPEC)], ServingMetrics(lambda: 0, lambda: 0))
    worker.start()
    stops = Stops()
    worker.orchestrator.observe(stops)
    whole: dict[str, list[float]] = {way: [] for way in WAYS}
    stop: dict[str, list[float]] = {way: [] for way in WAYS}
    for round_ in range(ROUNDS):
        for way in list(WAYS) if round_ % 2 == 0 else list(WAYS)[::-1]:
            micro_batches.MICRO_BATCH_SLOTS = WAYS[way]
            whole[way].append(run(worker, stops, f"whole-{way}-{round_}", cancel=False))
            stop[way].append(run(worker, stops, f"cancel-{way}-{round_}", cancel=True))
    micro_batches.MICRO_BATCH_SLOTS = WAYS["micro-batches"]
    worker.drain()
    print(
        f"| {len(INPUTS)} short inputs, MiniLM, medians of {ROUNDS} | whole request s "
        "| cancel to request.cancelled s (max) |"
    )
    print("|---|---:|---:|")
    for way, slots in WAYS.items():
        label = way if way == "one forward" else f"{way} of {slots} slots"
        print(
            f"| {label} | {statistics.median(whole[way]):.2f} "
            f"| {statistics.median(stop[way]):.3f} ({max(stop[way]):.3f}) |"
        )
    ratio = statistics.median(whole["micro-batches"]) / statistics.median(whole["one forward"])
    print(f"\nwhole request, micro-batches / one forward: {ratio:.2f}x")


if __name__ == "__main__":
    announce("cancelling")
    main()
