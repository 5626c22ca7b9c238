"""The worker behind the HTTP endpoints: load, warm up, queue jobs, drain."""

from __future__ import annotations

import itertools
import secrets
import threading
from concurrent.futures import Future
from enum import StrEnum

from lifecycle.logs import get_logger
from lifecycle.orchestrator import Orchestrator
from lifecycle.refusals import TransitionRefused
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


class Worker:
    """Own one orchestrator for the HTTP layer: its start, its queue and its end.

    Args:
        orchestrator: the pipeline to serve (its observer feeds ``metrics``).
        metrics: the worker's metrics.

    Attributes:
        board: what the status page's event stream reads (every event, the queue).
    """

    def __init__(self, orchestrator: Orchestrator, metrics: ServingMetrics) -> None:
        self.orchestrator = orchestrator
        self.metrics = metrics
        self.board = StatusBoard()
        orchestrator.observe(self.board.observer(orchestrator.spec.name))
        self.phase = Phase.STARTING
        self.error: str | None = None
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
        """Load the pipeline and warm it up; the worker is ready after (or failed).

        A worker already draining (a signal came first) loads nothing.
        """
        with self._starting:
            if self.phase is not Phase.STARTING:
                return
            try:
                self.orchestrator.load()
                self.shapes = warm_up(self.orchestrator)
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
            log.info("serving.ready", pipeline=self.name, shapes=self.shapes)
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

    def drain(self) -> bool:
        """Stop taking jobs, finish the queued ones and release everything.

        Returns whether every job finished within ``serving.drain_timeout`` and every
        component was released (its offload files removed).
        """
        with self._starting:  # a load in progress finishes first; none starts after
            self.phase = Phase.DRAINING
        self.board.changed()
        finished = True
        if self.batcher is not None:
            finished = self.batcher.drain(self.orchestrator.spec.serving.drain_timeout)
        try:
            self.orchestrator.close()
        except TransitionRefused as err:  # a job outlived the drain timeout
            log.error("serving.unreleased", error=str(err))
            return False
        finally:
            self.board.close()  # the event streams end, so that the server can stop
        return finished
