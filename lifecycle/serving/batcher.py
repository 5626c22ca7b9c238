"""The worker's queue: bounded, batching compatible jobs, draining on shutdown.

Jobs wait in one FIFO queue. A dispatcher thread takes the oldest job as soon as a
runner is free, gives it ``serving.batch_window_ms`` to gather company while
another batch runs (an idle worker starts it at once), and adds
every queued job with the same ``BatchKey`` (in arrival order) up to
``serving.max_batch`` jobs and ``serving.max_batch_tokens`` tokens; a job larger
than the token limit runs alone. The batch runs on a runner thread as one
orchestrator request, so batches with different keys (say, two backend overrides)
run concurrently, and wait for memory in turn when the budget is tight.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

from lifecycle.config import ServingConfig
from lifecycle.logs import get_logger
from lifecycle.orchestrator import Orchestrator
from lifecycle.serving.jobs import Job, Shapes, merged_batch, split_outputs

log = get_logger("lifecycle")

RUNNERS = 2
"""Batches that run at once: one computes while the next onloads or waits its turn."""

BatchObserver = Callable[[int], None]
"""Called with the size of every batch that starts."""


class QueueFull(Exception):
    """``serving.max_queue`` jobs are already queued or running."""


class Draining(Exception):
    """The worker is shutting down and takes no new jobs."""


@dataclass
class _Entry:
    job: Job
    future: Future[Job]
    arrived: float = field(default_factory=time.monotonic)


class Batcher:
    """Queue jobs, run compatible ones together, and drain on shutdown.

    Args:
        orchestrator: the loaded pipeline.
        settings: the spec's ``[serving]`` table.
        shapes: what the pipeline produces (from its warm-up).
        on_batch: called with each batch's size.
    """

    def __init__(
        self,
        orchestrator: Orchestrator,
        settings: ServingConfig,
        shapes: Shapes,
        on_batch: BatchObserver | None = None,
    ) -> None:
        self.orchestrator = orchestrator
        self.settings = settings
        self.shapes = shapes
        self.on_batch = on_batch
        self._changed = threading.Condition()
        self._queue: deque[_Entry] = deque()
        self._in_flight = 0
        self._free_runners = RUNNERS
        self._draining = False
        self._stopped = False
        # long-lived runner threads: torch keeps one intra-op thread pool per calling
        # thread, so a fresh thread per batch would build (and spin) a new one each time
        self._runners = ThreadPoolExecutor(RUNNERS, thread_name_prefix="runner")
        self._dispatcher = threading.Thread(target=self._dispatch, name="batcher", daemon=True)
        self._dispatcher.start()

    @property
    def depth(self) -> int:
        """Return how many jobs wait for a batch."""
        return len(self._queue)

    @property
    def in_flight(self) -> int:
        """Return how many jobs are queued or running."""
        return self._in_flight

    def submit(self, job: Job) -> Future[Job]:
        """Queue ``job``; the future completes with it, output set, or with its error.

        Raises:
            Draining: the worker is shutting down.
            QueueFull: ``serving.max_queue`` jobs are queued or running.
        """
        future: Future[Job] = Future()
        with self._changed:
            if self._draining:
                raise Draining()
            if self._in_flight >= self.settings.max_queue:
                raise QueueFull()
            self._in_flight += 1
            self._queue.append(_Entry(job, future))
            self._changed.notify_all()
        return future

    def wait_idle(self, timeout: float) -> bool:
        """Wait up to ``timeout`` s until no job is queued or running; tell whether none is.

        Jobs still come in meanwhile (a sleep stops them at the pipeline's gate first).
        """
        with self._changed:
            return self._wait_done(time.monotonic() + timeout)

    def drain(self, timeout: float) -> bool:
        """Stop taking jobs and wait up to ``timeout`` s for the queued and running ones.

        Returns whether every job finished.
        """
        deadline = time.monotonic() + timeout
        with self._changed:
            self._draining = True
            self._changed.notify_all()
            finished = self._wait_done(deadline)
            self._stopped = True
            self._changed.notify_all()
        self._dispatcher.join(timeout=5)
        self._runners.shutdown(wait=finished)
        log.info("serving.drained", finished=finished, left=self._in_flight)
        return finished

    def _wait_done(self, deadline: float) -> bool:
        """Wait (the lock held) until no job is queued or running, or ``deadline``."""
        while self._in_flight and (remaining := deadline - time.monotonic()) > 0:
            self._changed.wait(remaining)
        return self._in_flight == 0

    # -- the dispatcher thread -------------------------------------------------

    def _dispatch(self) -> None:
        while True:
            with self._changed:
                while not self._stopped and not (self._queue and self._free_runners):
                    self._changed.wait()
                if self._stopped:
                    return
                self._gather()
                group = self._take()
                if not group:  # every taken job was cancelled by its client
                    continue
                self._free_runners -= 1
            self._runners.submit(self._run, group)

    def _gather(self) -> None:
        """Give the oldest job its window to gather company (the lock is held).

        An idle worker (no batch running) starts at once: waiting would only add
        latency, and under load jobs gather on their own while batches run.
        """
        if self._free_runners == RUNNERS:
            return
        deadline = self._queue[0].arrived + self.settings.batch_window_ms / 1e3
        while not self._stopped and (remaining := deadline - time.monotonic()) > 0:
            if len(self._compatible()) >= self.settings.max_batch:
                return
            self._changed.wait(remaining)

    def _compatible(self) -> list[_Entry]:
        key = self._queue[0].job.key
        return [entry for entry in self._queue if entry.job.key == key]

    def _take(self) -> list[_Entry]:
        """Remove and return the oldest job and the compatible ones that fit with it."""
        group: list[_Entry] = []
        tokens = 0
        for entry in self._compatible():
            if len(group) == self.settings.max_batch:
                break
            if group and tokens + entry.job.tokens > self.settings.max_batch_tokens:
                continue
            group.append(entry)
            tokens += entry.job.tokens
        for entry in group:
            self._queue.remove(entry)
        # a client that went away cancelled its future: drop its job before it runs
        running = [entry for entry in group if entry.future.set_running_or_notify_cancel()]
        if len(running) < len(group):
            self._in_flight -= len(group) - len(running)
            self._changed.notify_all()  # a drain may be waiting for the count
        return running

    # -- a runner thread -----------------------------------------------------

    def _run(self, group: list[_Entry]) -> None:
        jobs = [entry.job for entry in group]
        batch_id = "+".join(job.id for job in jobs)
        try:
            # inside the try that frees the runner: an event that cannot be written must
            # not keep it, nor leave the clients waiting
            if self.on_batch is not None:
                self.on_batch(len(jobs))
            log.info("serving.batched", batch_id=batch_id, size=len(jobs))
            batch = merged_batch(jobs, self.shapes)
            override = jobs[0].key.attention_backend
            with self.orchestrator.request(batch_id, attention_backend=override) as request:
                request.run_all(batch)
            split_outputs(jobs, batch)
        except BaseException as err:  # handed to every waiting client
            for entry in group:
                entry.future.set_exception(err)
        else:
            for entry in group:
                entry.job.batch_id = batch_id
                entry.job.batch_size = len(jobs)
                entry.future.set_result(entry.job)
        finally:
            with self._changed:
                self._in_flight -= len(group)
                self._free_runners += 1
                self._changed.notify_all()
