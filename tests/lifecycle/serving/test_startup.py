"""Start-up you can see: serving.ready's times, warm-up requests before readiness."""

from __future__ import annotations

import json
import signal
from collections.abc import Callable
from pathlib import Path

from attention import Platform
from lifecycle.events import Event, RequestEnded
from lifecycle.orchestrator import Orchestrator
from lifecycle.serving.metrics import ServingMetrics
from lifecycle.serving.worker import Phase, Worker
from lifecycle.spec.structs import PipelineSpec
from lifecycle.testing import capture_events, events_named
from tests.lifecycle.serving.command import serving
from tests.lifecycle.serving.conftest import WATCHDOG_S, ServeSpec, loopback_client

SpecMaker = Callable[..., PipelineSpec]
NAMES = {"text_encoder", "transformer", "vae"}


def started_worker(spec: PipelineSpec, cpu: Platform, seen: list[tuple[str, Phase]]) -> Worker:
    """Start a worker for ``spec``; record each request's id and the worker's phase as it ends."""
    holder: list[Worker] = []

    def record(event: Event) -> None:
        if isinstance(event, RequestEnded):
            seen.append((event.request_id, holder[0].phase))

    metrics = ServingMetrics(queue_depth=lambda: 0, resident_bytes=lambda: 0)
    orchestrator = Orchestrator(spec, platform=cpu, observer=record)
    holder.append(Worker([orchestrator], metrics, admit_ms={spec.name: 1.5}))
    holder[0].start()
    return holder[0]


class TestReady:
    def test_ready_event_times_admission_load_components_and_warmup(
        self, t2i_spec: SpecMaker, cpu: Platform
    ) -> None:
        """serving.ready carries admit, load, per-component and warm-up milliseconds, and
        which components were built in parallel."""
        seen: list[tuple[str, Phase]] = []
        with capture_events() as events:
            worker = started_worker(t2i_spec(), cpu, seen)
        try:
            (ready,) = events_named(events, "serving.ready")
        finally:
            worker.drain()
        assert ready["admit_ms"] == 1.5
        assert ready["load_ms"] > 0
        assert set(ready["components_ms"]) == NAMES
        assert all(ms > 0 for ms in ready["components_ms"].values())
        assert set(ready["parallel"]) == NAMES
        assert ready["warmup"] == 1
        assert ready["warmup_ms"] > 0

    def test_warmup_runs_n_requests_before_the_worker_is_ready(
        self, t2i_spec: SpecMaker, cpu: Platform
    ) -> None:
        """serving.warmup = 3 runs three requests through every stage, all while starting."""
        seen: list[tuple[str, Phase]] = []
        worker = started_worker(t2i_spec(warmup=3), cpu, seen)
        try:
            phase = worker.phase
            startup = worker.startup["tiny-t2i"]
        finally:
            worker.drain()
        assert seen == [(f"warm-up-{n}", Phase.STARTING) for n in (1, 2, 3)]
        assert phase is Phase.READY
        assert startup.warmup == 3

    def test_readyz_shows_the_start(self, serve_spec: ServeSpec, t2i_spec: SpecMaker) -> None:
        """/readyz answers each pipeline's start-up times beside its status."""
        served = serve_spec(t2i_spec())
        with served.client() as client:
            body = client.get("/readyz").json()
        assert body["status"] == "ready"
        assert set(body["startup"]["tiny-t2i"]["components_ms"]) == NAMES

    def test_serve_logs_ready_with_its_admission_time(self, root: Path) -> None:
        """`lifecycle serve --log-level info` logs serving.ready with the measured admit_ms."""
        spec = root / "examples" / "tiny_t2i.toml"
        with serving(spec, "--log-level", "info") as (program, url), loopback_client(url) as client:
            assert client.get("/readyz").status_code == 200
            program.send_signal(signal.SIGTERM)
            code, _, log = program.wait(timeout=WATCHDOG_S)
        assert code == 0, log
        (ready,) = [json.loads(line) for line in log.splitlines() if "serving.ready" in line]
        assert ready["admit_ms"] > 0
        assert set(ready["components_ms"]) == NAMES
        assert ready["load_ms"] > 0
