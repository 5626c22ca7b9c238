"""Fixtures of the serving tests: a worker served over loopback HTTP in this process."""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeAlias

import httpx
import msgspec
import pytest
import torch

from attention import Platform
from lifecycle.config import PipelineSpec, decode_spec
from lifecycle.events import Event, Move
from lifecycle.orchestrator import Orchestrator
from lifecycle.serving.jobs import Job, merged_batch, split_outputs
from lifecycle.serving.metrics import ServingMetrics
from lifecycle.serving.worker import Phase, Worker
from lifecycle.shared_device import SharedDevice, worker_budget
from tests.lifecycle.conftest import ReferenceSpec

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

import uvicorn

from lifecycle.serving.app import create_app

WATCHDOG_S = 120.0
"""The longest any serving test waits for anything."""


@dataclass
class Served:
    """A worker answering on loopback, and what its orchestrator did.

    Attributes:
        url: the base URL.
        worker: the worker.
        moves: every weight move, in order.
        resident_at_moves: resident bytes right after each move.
    """

    url: str
    worker: Worker
    moves: list[Move] = field(default_factory=list)
    resident_at_moves: list[int] = field(default_factory=list)

    def client(self, **kwargs: Any) -> httpx.Client:
        """Return an HTTP client for this worker."""
        return httpx.Client(base_url=self.url, timeout=WATCHDOG_S, **kwargs)


ServeSpec: TypeAlias = Callable[[PipelineSpec], Served]

ServeSpecs: TypeAlias = Callable[..., Served]
"""``serve_specs(specs, device_budget=None, paths=None)``: one worker serving them all."""


@pytest.fixture
def serve_specs(cpu: Platform) -> Iterator[ServeSpecs]:
    """Serve workers on loopback in this process; every server is drained after the test.

    A worker serves every spec given, on one device under ``device_budget``; ``paths``
    name the files they were read from (for reload). The moves recorded are the first
    pipeline's.
    """
    running: list[tuple[uvicorn.Server, threading.Thread, Served]] = []

    def serve(
        specs: list[PipelineSpec],
        device_budget: int | None = None,
        paths: dict[str, Path] | None = None,
    ) -> Served:
        holder: list[Served] = []

        def observe_moves(event: Event) -> None:
            if isinstance(event, Move):
                served = holder[0]
                served.moves.append(event)
                served.resident_at_moves.append(orchestrators[0].resident_bytes())

        metrics = ServingMetrics(queue_depth=lambda: 0, resident_bytes=lambda: 0)
        limit, key = worker_budget(specs, device_budget, None)  # as `lifecycle serve` does
        device = SharedDevice(device_budget=limit, budget_key=key)
        orchestrators = [
            Orchestrator(spec, platform=cpu, observer=metrics.observe, shared=device)
            for spec in specs
        ]
        orchestrators[0].observe(observe_moves)  # a second observer beside the metrics
        worker = Worker(orchestrators, metrics, paths)
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        host, port = sock.getsockname()
        served = Served(url=f"http://{host}:{port}", worker=worker)
        holder.append(served)
        worker.start()
        assert worker.phase is Phase.READY, worker.error
        config = uvicorn.Config(create_app(worker), log_config=None, access_log=False)
        server = uvicorn.Server(config)
        thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
        thread.start()
        with served.client() as client:
            for _ in range(int(WATCHDOG_S / 0.01)):
                if server.started and client.get("/healthz").status_code == 200:
                    break
                threading.Event().wait(0.01)
        running.append((server, thread, served))
        return served

    yield serve
    for server, thread, served in running:
        served.worker.drain()
        server.should_exit = True
        thread.join(timeout=WATCHDOG_S)


@pytest.fixture
def serve_spec(serve_specs: ServeSpecs) -> ServeSpec:
    """Serve one spec on loopback in this process (a worker of its own device)."""
    return lambda spec: serve_specs([spec])


@pytest.fixture
def t2i_spec(reference_spec: ReferenceSpec) -> Callable[..., PipelineSpec]:
    """Make the reference text-to-image spec with ``[serving]`` and ``[memory]`` changes."""

    def make(memory: dict[str, Any] | None = None, **serving: Any) -> PipelineSpec:
        raw = msgspec.to_builtins(reference_spec())
        raw["serving"] = serving
        raw["memory"].update(memory or {})
        return decode_spec(msgspec.json.encode(raw).decode(), "json")

    return make


def run_alone(worker: Worker, job: Job) -> torch.Tensor:
    """Run ``job`` by itself through the embedded API, the way a batch of one runs."""
    batch = merged_batch([job], worker.shapes, worker.orchestrator.recipe)
    override = job.key.attention_backend
    with worker.orchestrator.request(f"alone-{job.id}", attention_backend=override) as request:
        request.run_all(batch)
    split_outputs([job], batch)
    assert job.output is not None
    return job.output
