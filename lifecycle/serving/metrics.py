"""The worker's Prometheus metrics, on a registry of its own.

Counts come from three places: the HTTP layer (requests, latency, refused
requests), the batcher (queue depth, batch sizes) and the orchestrator, whose
observer hands over every move, transition, refusal, wait and request as a typed
value. None of them reads the log, so the counts do not depend on the log level.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import get_args

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from lifecycle.events import (
    Direction,
    Event,
    MemoryWait,
    Move,
    Observer,
    RequestCancelled,
    RequestEnded,
    Transitioned,
    TriggerRefused,
)
from lifecycle.machines.tables import TRIGGERS

__all__ = ["ServingMetrics"]

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)


class ServingMetrics:
    """Every metric ``GET /metrics`` exposes.

    Args:
        queue_depth: reads how many jobs wait for a batch.
        resident_bytes: reads the bytes resident on the device now.
        recompiles: reads each compiled component's recompiles by (pipeline, component)
            (design §17), read at every scrape.
    """

    def __init__(
        self,
        queue_depth: Callable[[], int],
        resident_bytes: Callable[[], int],
        recompiles: Callable[[], Mapping[tuple[str, str], int]] = dict,
    ) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        r.register(_Recompiles(recompiles))
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
        # every move and transition counts: look their label children up once, not per event
        self._moved = {d: self.moved.labels(direction=d) for d in get_args(Direction)}
        self._transitions = {t: self.transitions.labels(trigger=t) for t in TRIGGERS}
        self.waited = Histogram(
            "lifecycle_memory_wait_seconds",
            "time a stage waited for other requests to release memory, by how it ended",
            ["outcome"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.request_seconds = Histogram(
            "lifecycle_pipeline_request_seconds",
            "time an orchestrator request (one batch) spent through its stages",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.cache_steps = Counter(
            "lifecycle_cache_steps",
            "image steps a component's step cache computed or skipped (design §17)",
            ["pipeline", "component", "outcome"],
            registry=r,
        )
        self.prompt_cache = Counter(
            "lifecycle_prompt_cache_rows",
            "prompts whose text the prompt cache gave (hit) or the encoders made (miss)",
            ["pipeline", "outcome"],
            registry=r,
        )
        self.cancelled = Counter(
            "lifecycle_cancelled_requests",
            "requests cancelled, by the stage they stopped in (queued: before any)",
            ["stage"],
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

    def observe(self, event: Event) -> None:
        """Count one event of the orchestrator (its observer)."""
        if isinstance(event, Move):
            self._moved[event.direction].inc(event.bytes)
        elif isinstance(event, Transitioned):
            self._transitions[event.trigger].inc()
        elif isinstance(event, TriggerRefused):
            # a stage's onload refused while it may still wait is counted only if the
            # request is finally refused (``refused``), not on every try
            if not event.may_wait:
                self.refused(event.codes)
        elif isinstance(event, MemoryWait):
            self.waited.labels(outcome=event.outcome).observe(event.seconds)
        elif isinstance(event, RequestEnded):
            self.request_seconds.observe(event.duration_ms / 1e3)
        elif isinstance(event, RequestCancelled):
            self.cancelled.labels(stage=event.stage or "queued").inc()

    def pipeline_observer(self, pipeline: str) -> Observer:
        """Return an observer counting what ``pipeline``'s own metrics need: its step caches'
        steps and its prompt cache's rows, as each request ends."""

        def observe(event: Event) -> None:
            if isinstance(event, RequestEnded):
                for component, steps in event.cache.items():
                    labels = {"pipeline": pipeline, "component": component}
                    self.cache_steps.labels(**labels, outcome="computed").inc(steps.computed)
                    self.cache_steps.labels(**labels, outcome="skipped").inc(steps.skipped)
                if event.prompts is not None:
                    prompts = event.prompts
                    self.prompt_cache.labels(pipeline=pipeline, outcome="hit").inc(prompts.hits)
                    self.prompt_cache.labels(pipeline=pipeline, outcome="miss").inc(prompts.misses)

        return observe

    def refused(self, codes: tuple[str, ...]) -> None:
        """Count each code of a refusal: a transition's, or a request's the HTTP layer answers."""
        for code in codes:
            self.refusals.labels(code=code).inc()

    def render(self) -> bytes:
        """Return the Prometheus text exposition of every metric."""
        return generate_latest(self.registry)


class _Recompiles(Collector):
    """``lifecycle_recompiles_total{pipeline, component}``: the graphs inductor compiled
    after a compiled component's first forward, read from the orchestrators at a scrape."""

    def __init__(self, read: Callable[[], Mapping[tuple[str, str], int]]) -> None:
        self._read = read

    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily(
            "lifecycle_recompiles",
            "graphs inductor compiled after a compiled component's first forward (design §17)",
            labels=["pipeline", "component"],
        )
        for (pipeline, component), count in sorted(self._read().items()):
            family.add_metric([pipeline, component], count)
        yield family
