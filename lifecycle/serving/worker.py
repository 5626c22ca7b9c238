"""The worker behind the HTTP endpoints: load, warm up, queue jobs, drain."""

from __future__ import annotations

import itertools
import secrets
import threading
import time
from concurrent.futures import Future
from enum import StrEnum

import msgspec

from lifecycle.logs import get_logger
from lifecycle.orchestrator import Orchestrator
from lifecycle.serving.batcher import Batcher
from lifecycle.serving.board import StatusBoard
from lifecycle.serving.jobs import Job, RequestStatus, Shapes, warm_up
from lifecycle.serving.metrics import ServingMetrics

log = get_logger("lifecycle")


class Phase(StrEnum):
    """Where the worker stands: readiness follows it."""

    STARTING = "starting"
    READY = "ready"
    DRAINING = "draining"
    FAILED = "failed"


class Startup(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """How long the worker's start took, part by part (the ``serving.ready`` event).

    Attributes:
        admit_ms: admitting the pipeline.
        load_ms: loading it, wall time.
        components_ms: each component's build and initial placement (builds run in
            parallel overlap).
        parallel: the components built in parallel threads.
        warmup_ms: the warm-up requests together.
        warmup: how many warm-up requests ran (``serving.warmup``).
    """

    admit_ms: float
    load_ms: float
    components_ms: dict[str, float]
    parallel: tuple[str, ...]
    warmup_ms: float
    warmup: int


class Worker:
    """Own one orchestrator for the HTTP layer: its start, its queue and its end.

    Args:
        orchestrator: the pipeline to serve (its observer feeds ``metrics``).
        metrics: the worker's metrics.
        admit_ms: how long admitting it took, for ``serving.ready`` (0: not measured).

    Attributes:
        startup: how long each part of the start took, once ready.
        board: what the status page's event stream reads (every event, the queue).
    """

    def __init__(
        self, orchestrator: Orchestrator, metrics: ServingMetrics, admit_ms: float = 0.0
    ) -> None:
        self.orchestrator = orchestrator
        self.metrics = metrics
        self.admit_ms = admit_ms
        self.board = StatusBoard()
        orchestrator.observe(self.board.observer(orchestrator.spec.name))
        self.phase = Phase.STARTING
        self.error: str | None = None
        self.startup: Startup | None = None
        self.shapes = Shapes(embeddings=False, images=False)
        self.batcher: Batcher | None = None
        self._ids = itertools.count(1)
        self._ids_lock = threading.Lock()
        self._starting = threading.Lock()  # held while start() loads: drain() waits for it

    @property
    def name(self) -> str:
        """Return the pipeline's name (the OpenAI ``model``)."""
        return self.orchestrator.spec.name

    def start(self) -> None:
        """Load the pipeline and run ``serving.warmup`` requests; the worker is ready after.

        ``serving.ready`` says how long admission, the load (each component's too) and
        the warm-up took. A worker already draining (a signal came first) loads nothing.
        """
        with self._starting:
            if self.phase is not Phase.STARTING:
                return
            try:
                loaded = self.orchestrator.load()
                warming = time.perf_counter()
                warmup = self.orchestrator.spec.serving.warmup
                self.shapes = warm_up(self.orchestrator, warmup)
                self.startup = Startup(
                    admit_ms=round(self.admit_ms, 3),
                    load_ms=loaded.duration_ms,
                    components_ms=loaded.components,
                    parallel=loaded.parallel,
                    warmup_ms=round((time.perf_counter() - warming) * 1e3, 3),
                    warmup=warmup,
                )
            except Exception as err:  # reported by /readyz and the log; the process stays up
                self.phase = Phase.FAILED
                self.error = f"{type(err).__name__}: {err}"
                log.error("serving.failed", error=self.error)
                self.board.changed()
                return
            self.batcher = Batcher(
                self.orchestrator,
                self.orchestrator.spec.serving,
                self.shapes,
                on_batch=self.metrics.batch_size.observe,
                on_change=self.board.changed,
            )
            self.phase = Phase.READY
            log.info(
                "serving.ready",
                pipeline=self.name,
                shapes=self.shapes,
                **msgspec.structs.asdict(self.startup),
            )
        self.board.changed()

    def next_id(self) -> str:
        """Return a fresh request id: ``req-N-`` and 12 random hex digits.

        The count makes it unique in this process; the random part keeps a client
        from guessing (and taking first, as its own ``x-request-id``) an id the
        worker will assign, in this process or a restarted one.
        """
        with self._ids_lock:
            count = next(self._ids)
        return f"req-{count}-{secrets.token_hex(6)}"

    def status(self, request_id: str) -> RequestStatus | None:
        """Return where job ``request_id`` stands, or None when no recent job has that id."""
        return None if self.batcher is None else self.batcher.status(request_id)

    def cancel(self, request_id: str, reason: str) -> RequestStatus | None:
        """Cancel job ``request_id`` (see ``Batcher.cancel``); None when there is none."""
        return None if self.batcher is None else self.batcher.cancel(request_id, reason)

    def submit(self, job: Job) -> Future[Job]:
        """Queue ``job`` (see ``Batcher.submit``)."""
        assert self.batcher is not None  # the HTTP layer checks readiness first
        return self.batcher.submit(job)

    @property
    def abandoned(self) -> int:
        """Return how many jobs still run once a drain gave up waiting for them."""
        if self.phase is not Phase.DRAINING or self.batcher is None:
            return 0
        return self.batcher.in_flight

    def drain(self) -> str | None:
        """Stop taking jobs, finish the queued ones and release everything.

        Returns None when every job finished within ``serving.drain_timeout`` and every
        component was released (its offload files removed); else what was left behind,
        also logged as ``serving.drain_failed``. Components that jobs still running
        hold stay; every other one is released, and the offload folder is removed.
        """
        with self._starting:  # a load in progress finishes first; none starts after
            self.phase = Phase.DRAINING
        self.board.changed()
        timeout = self.orchestrator.spec.serving.drain_timeout
        problems = []
        if self.batcher is not None and not self.batcher.drain(timeout):
            problems.append(
                f"{self.batcher.in_flight} job(s) still running after serving.drain_timeout "
                f"= {timeout:g} s were abandoned"
            )
        try:
            self.orchestrator.close()
        except ExceptionGroup as err:  # a job outlived the drain: its components stay
            problems.append(str(err))
        finally:
            self.board.close()  # the event streams end, so that the server can stop
        if not problems:
            return None
        reason = "; ".join(problems)
        log.error("serving.drain_failed", reason=reason)
        return reason
