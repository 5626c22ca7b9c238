"""The worker's queue: bounded, by priority, batching compatible jobs, cancellable,
draining on shutdown.

Jobs wait in one queue ordered by priority, FIFO within a priority, with ageing
(``lifecycle.device.priorities``: a turn is a batch starting; it states the bound). A
dispatcher thread takes the first job as soon as a runner is free, gives it
``serving.batch_window_ms`` to gather company while another batch runs (an idle
worker starts it at once), and adds every queued job with the same ``BatchKey`` (in
queue order) up to ``serving.max_batch`` jobs and ``serving.max_batch_tokens``
tokens; a job larger than the token limit runs alone. The batch runs on a runner
thread as one orchestrator request (of its jobs' highest priority), so batches with
different keys (say, two backend overrides) run concurrently, and wait for memory in
turn when the budget is tight.

A job is cancelled by ``cancel``: queued, it leaves the queue at once; running, its
rows leave its batch before the next denoising step (``Batch.stepped``) while the
other jobs of the batch go on, and its client is answered at once.
"""

from __future__ import annotations

import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

from components.batch import Batch, Cancelled, StepDone, StepHook
from components.cache import count_steps
from lifecycle.device.priorities import PriorityQueue
from lifecycle.logs import get_logger
from lifecycle.orchestrator import Orchestrator
from lifecycle.serving.jobs import (
    Job,
    JobCancelled,
    JobSteps,
    RequestState,
    RequestStatus,
    Shapes,
    job_rows,
    merged_batch,
    split_outputs,
)
from lifecycle.spec.structs import ServingConfig

__all__ = ["Batcher", "Draining", "DuplicateRequest", "QueueFull"]

log = get_logger("lifecycle")

RUNNERS = 2
"""Batches that run at once: one computes while the next onloads or waits its turn."""

FINISHED_KEPT = 1024
"""Finished jobs whose status ``GET /v1/requests/{id}`` still answers (the latest)."""

BatchObserver = Callable[[int], None]
"""Called with the size of every batch that starts."""

QueueObserver = Callable[[], None]
"""Called whenever the queue or the running batches changed (read them with ``view``)."""


class QueueFull(Exception):
    """``serving.max_queue`` jobs of this priority are already queued or running."""


class Draining(Exception):
    """The worker is shutting down and takes no new jobs."""


class DuplicateRequest(Exception):
    """A queued or running job already has this request id."""


@dataclass(frozen=True)
class QueueView:
    """What the batcher holds at one moment (the status page shows it).

    Attributes:
        queued: each waiting job with when it arrived (``time.monotonic``), first in line first.
        running: each running batch's id with its jobs, the denoising steps it has done,
            and the image steps its step cache skipped so far (design §17).
    """

    queued: tuple[tuple[Job, float], ...]
    running: tuple[tuple[str, tuple[Job, ...], int, int], ...]


@dataclass
class _Entry:
    job: Job
    future: Future[Job]
    arrived: float = field(default_factory=time.monotonic)
    rows: range = range(0)  # its rows of the batch it runs in
    batch: Batch | None = None  # set once its batch is built
    running: bool = False
    cancelled: RequestStatus | None = None  # where it stood when cancelled

    def status(self, queue: PriorityQueue[_Entry], state: RequestState) -> RequestStatus:
        """Return its status in ``state``: its place while queued, else its batch's stage."""
        job = self.job
        if not self.running:
            position = queue.position(self) if state is RequestState.QUEUED else None
            return RequestStatus(
                id=job.id, state=state, steps=job.key.steps, queue_position=position
            )
        batch = self.batch
        return RequestStatus(
            id=job.id,
            state=state,
            stage=None if batch is None else batch.stage,
            step=0 if batch is None else batch.step,
            steps=job.key.steps,
        )


class Batcher:
    """Queue jobs by priority, run compatible ones together, cancel them, drain on shutdown.

    Args:
        orchestrator: the loaded pipeline.
        settings: the spec's ``[serving]`` table.
        shapes: what the pipeline produces (from its warm-up).
        on_batch: called with each batch's size.
        on_change: called whenever a job is queued, a batch starts or a batch ends.
    """

    def __init__(
        self,
        orchestrator: Orchestrator,
        settings: ServingConfig,
        shapes: Shapes,
        on_batch: BatchObserver | None = None,
        on_change: QueueObserver | None = None,
    ) -> None:
        self.orchestrator = orchestrator
        self.settings = settings
        self.shapes = shapes
        self.on_batch = on_batch
        self.on_change = on_change
        self._changed = threading.Condition()
        self._queue: PriorityQueue[_Entry] = PriorityQueue()
        self._live: dict[str, _Entry] = {}  # queued or running, by request id
        self._finished: OrderedDict[str, RequestStatus] = OrderedDict()
        self._running: dict[str, list[_Entry]] = {}
        self._in_flight = 0
        self._by_priority: Counter[int] = Counter()
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

    def view(self) -> QueueView:
        """Return the queued jobs and the running batches now."""
        with self._changed:
            return QueueView(
                queued=tuple((entry.job, entry.arrived) for entry in self._queue),
                running=tuple(
                    (
                        batch_id,
                        tuple(entry.job for entry in group),
                        _steps_done(group),
                        _skipped(group),
                    )
                    for batch_id, group in self._running.items()
                ),
            )

    def submit(self, job: Job) -> Future[Job]:
        """Queue ``job``; the future completes with it, output set, or with its error.

        Raises:
            Draining: the worker is shutting down.
            DuplicateRequest: a queued or running job has the same id.
            QueueFull: ``serving.max_queue`` jobs of the job's priority are queued or
                running.
        """
        future: Future[Job] = Future()
        with self._changed:
            if self._draining:
                raise Draining()
            if job.id in self._live:
                raise DuplicateRequest(job.id)
            if self._by_priority[job.priority] >= self.settings.max_queue:
                raise QueueFull()
            self._in_flight += 1
            self._by_priority[job.priority] += 1
            entry = _Entry(job, future)
            job.queued_turn = self._queue.turns
            self._queue.push(entry, job.priority)
            self._live[job.id] = entry
            self._changed.notify_all()
        self._tell_change()
        return future

    def wait_idle(self, timeout: float) -> bool:
        """Wait up to ``timeout`` s until no job is queued or running; tell whether none is.

        Jobs still come in meanwhile (a sleep stops them at the pipeline's gate first).
        """
        with self._changed:
            return self._wait_done(time.monotonic() + timeout)

    def status(self, job_id: str) -> RequestStatus | None:
        """Return where job ``job_id`` stands, or None when no recent job has that id."""
        with self._changed:
            entry = self._live.get(job_id)
            if entry is None:
                return self._finished.get(job_id)
            if entry.cancelled is not None:
                return entry.cancelled
            state = RequestState.RUNNING if entry.running else RequestState.QUEUED
            return entry.status(self._queue, state)

    def cancel(self, job_id: str, reason: str) -> RequestStatus | None:
        """Cancel job ``job_id``: answer its client now, free its place as soon as it can.

        A queued job leaves the queue at once; a running one is answered at once and
        its rows leave its batch before the next denoising step. A finished job stays
        as it is. Returns its status, or None when no recent job has that id.
        """
        with self._changed:
            entry = self._live.get(job_id)
            if entry is None:
                return self._finished.get(job_id)
            if entry.cancelled is not None:
                return entry.cancelled
            status = entry.cancelled = entry.status(self._queue, RequestState.CANCELLED)
            if entry.running:
                if entry.batch is not None:
                    entry.batch.cancellation.cancel(job_id, entry.rows)
            else:
                self._queue.remove(entry)
                self._forget([entry], status)
                self._changed.notify_all()
            entry.future.set_exception(JobCancelled(job_id, reason, status))
        if entry.running:
            self.orchestrator.waiter.wake()  # its batch may be waiting for memory
        else:
            self.orchestrator.report_cancelled(job_id)
            self._tell_change()  # it left the queue
        return status

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

    def _forget(self, entries: list[_Entry], *statuses: RequestStatus) -> None:
        """Count ``entries`` out of flight and keep their final statuses (the lock is held)."""
        for entry, status in zip(entries, statuses, strict=True):
            self._in_flight -= 1
            self._by_priority[entry.job.priority] -= 1
            del self._live[entry.job.id]
            self._finished[entry.job.id] = status
            self._finished.move_to_end(entry.job.id)
        while len(self._finished) > FINISHED_KEPT:
            self._finished.popitem(last=False)

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
                if not group:  # every queued job was cancelled while the first gathered
                    continue
                self._free_runners -= 1
            self._runners.submit(self._run, group)

    def _gather(self) -> None:
        """Give the first job its window to gather company (the lock is held).

        An idle worker (no batch running) starts at once: waiting would only add
        latency, and under load jobs gather on their own while batches run.
        """
        if self._free_runners == RUNNERS:
            return
        deadline = self._queue.head().arrived + self.settings.batch_window_ms / 1e3
        while not self._stopped and (remaining := deadline - time.monotonic()) > 0:
            if len(self._compatible()) >= self.settings.max_batch:
                return
            self._changed.wait(remaining)
            if not self._queue:  # every queued job was cancelled meanwhile
                return

    def _compatible(self) -> list[_Entry]:
        key = self._queue.head().job.key
        return [entry for entry in self._queue if entry.job.key == key]

    def _take(self) -> list[_Entry]:
        """Remove and return the first job and the compatible ones that fit with it.

        Returns an empty list when the queue emptied while the first gathered (cancelled).
        """
        if not self._queue:
            return []
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
            entry.running = True
            entry.job.started_turn = self._queue.turns
        self._queue.served()  # every job left in the queue was passed over
        return group

    # -- a runner thread -----------------------------------------------------

    def _run(self, group: list[_Entry]) -> None:
        jobs = [entry.job for entry in group]
        batch_id = "+".join(job.id for job in jobs)
        with self._changed:
            self._running[batch_id] = group
        self._tell_change()  # the jobs left the queue and run
        try:
            # inside the try that frees the runner: an event that cannot be written must
            # not keep it, nor leave the clients waiting
            if self.on_batch is not None:
                self.on_batch(len(jobs))
            log.info("serving.batched", batch_id=batch_id, size=len(jobs))
            batch = merged_batch(jobs, self.shapes, self.orchestrator.recipe)
            batch.on_step = _steps_hook(group, self.on_change)
            with self._changed:  # cancellations from now on reach the batch itself
                for entry, rows in zip(group, job_rows(jobs), strict=True):
                    entry.rows, entry.batch = rows, batch
                    if entry.cancelled is not None:
                        batch.cancellation.cancel(entry.job.id, rows)
            override = jobs[0].key.attention_backend
            priority = max(job.priority for job in jobs)
            with self.orchestrator.request(
                batch_id, attention_backend=override, priority=priority
            ) as request:
                request.run_all(batch)
            split_outputs(jobs, batch)
        except Cancelled:
            pass  # every job of the batch was cancelled, and answered then
        except BaseException as err:  # handed to every waiting client
            with self._changed:
                for entry in group:
                    if not entry.future.done():
                        entry.future.set_exception(err)
        else:
            with self._changed:
                for entry in group:
                    entry.job.batch_id = batch_id
                    entry.job.batch_size = len(jobs)
                    if not entry.future.done():
                        entry.future.set_result(entry.job)
        finally:
            with self._changed:
                self._forget(group, *(self._final(entry) for entry in group))
                self._free_runners += 1
                del self._running[batch_id]
                self._changed.notify_all()
            self._tell_change()

    def _tell_change(self) -> None:
        if self.on_change is not None:
            self.on_change()

    def _final(self, entry: _Entry) -> RequestStatus:
        """Return the status a job of a finished batch keeps: done, or where it was cancelled.

        A job that failed is done too: its client was answered with the error.
        """
        if entry.cancelled is not None:
            return entry.cancelled
        return entry.status(self._queue, RequestState.DONE)


def _steps_done(group: list[_Entry]) -> int:
    """Return the denoising steps a running batch has done (0 until its batch is made)."""
    batch = group[0].batch
    return 0 if batch is None else batch.step


def _skipped(group: list[_Entry]) -> int:
    """Return the image steps a running batch's step cache has skipped so far."""
    batch = group[0].batch
    rows = None if batch is None else batch.cache_rows
    return 0 if rows is None else count_steps(rows).skipped


def _steps_hook(group: list[_Entry], on_change: QueueObserver | None) -> StepHook | None:
    """Return the batch's step hook: each listening job hears of its own rows' latents.

    ``on_change`` hears of every step too (the status page shows the step reached).
    """
    listeners: list[tuple[JobSteps, _Entry]] = [
        (entry.job.on_step, entry) for entry in group if entry.job.on_step is not None
    ]
    if not listeners and on_change is None:
        return None

    def hook(done: StepDone) -> None:
        for listener, entry in listeners:
            mine = [x for row, x in zip(done.rows, done.latents, strict=True) if row in entry.rows]
            if mine:
                listener(done.step, done.steps, mine)
        if on_change is not None:
            on_change()

    return hook
