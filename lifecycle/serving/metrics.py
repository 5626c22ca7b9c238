"""The worker's Prometheus metrics, on a registry of its own.

Counts come from three places: the HTTP layer (requests, latency), the batcher
(queue depth, batch sizes) and the orchestrator's own events (transitions,
refusals, waits), read by a structlog processor, plus its move observer (bytes).
"""

from __future__ import annotations

from collections.abc import Callable, MutableMapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from lifecycle.residency import Move

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)


class ServingMetrics:
    """Every metric ``GET /metrics`` exposes.

    Args:
        queue_depth: reads how many jobs wait for a batch.
        resident_bytes: reads the bytes resident on the device now.
    """

    def __init__(self, queue_depth: Callable[[], int], resident_bytes: Callable[[], int]) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "lifecycle_http_requests", "HTTP requests answered", ["endpoint", "status"], registry=r
        )
        self.latency = Histogram(
            "lifecycle_http_request_seconds",
            "HTTP request latency",
            ["endpoint", "status"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self._by_route: dict[tuple[str, int], tuple[Counter, Histogram]] = {}
        self.batch_size = Histogram(
            "lifecycle_batch_size", "jobs per batch run", buckets=BATCH_BUCKETS, registry=r
        )
        self.transitions = Counter(
            "lifecycle_transitions", "lifecycle transitions done", ["trigger"], registry=r
        )
        self.refusals = Counter("lifecycle_refusals", "refusals by code", ["code"], registry=r)
        self.moved = Counter(
            "lifecycle_moved_bytes", "weight bytes moved", ["direction"], registry=r
        )
        self.waited = Histogram(
            "lifecycle_memory_wait_seconds",
            "time a stage waited for other requests to release memory",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        Gauge("lifecycle_queue_depth", "jobs waiting for a batch", registry=r).set_function(
            queue_depth
        )
        Gauge("lifecycle_resident_bytes", "bytes resident on the device", registry=r).set_function(
            resident_bytes
        )

    def observe_request(self, endpoint: str, status: int, seconds: float) -> None:
        """Count one answered HTTP request and its latency."""
        children = self._by_route.get((endpoint, status))
        if children is None:  # labels() hashes and locks on every call: look each pair up once
            labels = {"endpoint": endpoint, "status": str(status)}
            children = (self.requests.labels(**labels), self.latency.labels(**labels))
            self._by_route[endpoint, status] = children
        count, latency = children
        count.inc()
        latency.observe(seconds)

    def observe_move(self, move: Move) -> None:
        """Count the bytes of one move (the orchestrator's move observer)."""
        self.moved.labels(direction=move.direction).inc(move.bytes)

    def observe_event(
        self, logger: Any, method: str, event: MutableMapping[str, Any]
    ) -> MutableMapping[str, Any]:
        """Count transitions, refusals and waits as their events pass (a structlog processor)."""
        name = event.get("event")
        if name == "lifecycle.transition":
            self.transitions.labels(trigger=str(event.get("trigger"))).inc()
        elif name == "lifecycle.refused" and not event.get("may_wait"):
            # a stage's onload refused while it may still wait is counted only if the
            # request is finally refused (``refused``), not on every try
            for code in event.get("codes") or ():
                self.refusals.labels(code=str(code)).inc()
        elif name == "residency.waited":
            self.waited.observe(float(event.get("seconds", 0.0)))
        return event

    def refused(self, codes: tuple[str, ...]) -> None:
        """Count the codes of a refused request (an override, or the memory budget)."""
        for code in codes:
            self.refusals.labels(code=code).inc()

    def render(self) -> bytes:
        """Return the Prometheus text exposition of every metric."""
        return generate_latest(self.registry)
