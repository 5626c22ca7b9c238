"""The worker behind the HTTP endpoints: the pipelines it serves, their start, queues and end.

A worker serves one or more pipelines on one ``SharedDevice`` (one budget, one line
of requests waiting for memory, equal components held once). A request names its
pipeline by ``model``; with one pipeline it may name none. Each pipeline has its own
queue, and a gate in front of it where requests wait while it sleeps (waking it when
``serving.auto_wake`` says so) or while it is being replaced. How pipelines are
added, removed, swapped and reloaded is ``lifecycle.serving.changes``.
"""

from __future__ import annotations

import asyncio
import itertools
import secrets
import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import msgspec

from lifecycle.logs import get_logger
from lifecycle.machines.tables import PipelineState, WorkerState
from lifecycle.machines.worker import WorkerMachine
from lifecycle.orchestrator import Orchestrator
from lifecycle.refusals import RefusalCode, TransitionRefused
from lifecycle.serving.batcher import Batcher, Draining
from lifecycle.serving.board import StatusBoard
from lifecycle.serving.jobs import Job, RequestStatus, Shapes, warm_up
from lifecycle.serving.metrics import ServingMetrics
from lifecycle.serving.served import ServedPipeline
from lifecycle.shown import shown
from lifecycle.spec.structs import PipelineSpec, ServingConfig

__all__ = ["REMOVED", "SWAPPING", "Asleep", "Phase", "UnknownModel", "Worker"]

log = get_logger("lifecycle")

SLEEPING = "sleeping"
SWAPPING = "swapping"
REMOVED = "removed"
"""Why a pipeline's gate is closed."""


Phase = WorkerState
"""Where the worker stands: readiness follows it (``lifecycle.WorkerState``, moved by the
worker's own machine, ``lifecycle.machines.worker``)."""


class Startup(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """How long a pipeline's start took, part by part (its ``serving.ready`` event).

    Attributes:
        admit_ms: admitting the pipeline (0: not measured, e.g. one added later).
        load_ms: loading it, wall time.
        components_ms: each component's build and initial placement (builds run in
            parallel overlap).
        parallel: the components built in parallel threads.
        warmup_ms: the warm-up requests together.
        warmup: how many warm-up requests ran (``serving.warmup``).
        compile_s: the seconds inductor spent compiling each compiled component during
            the warm-up (design §17; its first forward of each shape class compiles).
    """

    admit_ms: float
    load_ms: float
    components_ms: dict[str, float]
    parallel: tuple[str, ...]
    warmup_ms: float
    warmup: int
    compile_s: dict[str, float] = msgspec.field(default_factory=dict)


class UnknownModel(LookupError):
    """A request names a pipeline the worker does not serve, or none where it serves several.

    Attributes:
        code: ``model_not_found`` or ``model_required``.
    """

    def __init__(self, message: str, code: str) -> None:
        super().__init__(message)
        self.code = code


class Asleep(Exception):
    """A request's pipeline still slept after ``serving.wake_timeout``."""


class Worker:
    """Serve pipelines over HTTP: their start, their queues, their gates and their end.

    Args:
        orchestrators: the admitted pipelines to serve, all on one ``SharedDevice``;
            ``start`` loads them.
        metrics: the worker's metrics (every orchestrator's observer feeds them).
        paths: the spec each pipeline was read from, by name (re-read on reload).
        admit_ms: how long admitting each pipeline took, by name, for ``serving.ready``.

    Attributes:
        shared: the device every pipeline is on.
        bounds: the ``[serving]`` table whose body and connection bounds the worker's
            HTTP server keeps (the first pipeline's: one server serves them all).
        startup: how long each pipeline's start took, by name, once it is served.
        board: what the status page's event stream reads (every pipeline's events, the
            queues).
        pipelines: the pipelines served, by name, once started.
        error: why it failed to start, if it did.
    """

    def __init__(
        self,
        orchestrators: Sequence[Orchestrator],
        metrics: ServingMetrics,
        paths: Mapping[str, Path] | None = None,
        admit_ms: Mapping[str, float] | None = None,
    ) -> None:
        if not orchestrators:
            raise ValueError("a worker serves at least one pipeline")
        self.bounds: ServingConfig = orchestrators[0].spec.serving
        self.startup: dict[str, Startup] = {}
        self._admit_ms = dict(admit_ms or {})
        self.shared = orchestrators[0].shared
        self.platform = orchestrators[0].platform
        self.metrics = metrics
        self.board = StatusBoard()
        self.shared.waiter.on_change(self.board.changed)  # the line shows on the page
        for orchestrator in orchestrators:
            orchestrator.observe(self.board.observer(orchestrator.spec.name))
            orchestrator.observe(metrics.pipeline_observer(orchestrator.spec.name))
        self._lifecycle = WorkerMachine("worker").lifecycle("worker")
        self.error: str | None = None
        self.pipelines: dict[str, ServedPipeline] = {}
        self._pending = [(o, (paths or {}).get(o.spec.name)) for o in orchestrators]
        self._lock = threading.Lock()  # held while ``pipelines`` changes
        self.changing = threading.Lock()  # one change of the set of pipelines at a time
        self._waking: set[str] = set()
        self._ids = itertools.count(1)
        self._ids_lock = threading.Lock()
        self._starting = threading.Lock()  # held while start() loads: drain() waits for it

    @property
    def phase(self) -> WorkerState:
        """Return where the worker stands (its machine's state)."""
        return self._lifecycle.state

    # -- the one pipeline, for callers that serve one --------------------------

    @property
    def only(self) -> ServedPipeline:
        """Return the one pipeline served.

        Raises:
            UnknownModel: the worker serves several pipelines (or none).
        """
        return self.resolve(None)

    @property
    def names(self) -> tuple[str, ...]:
        """Return the names of the pipelines served (while starting: of those to serve)."""
        return tuple(orchestrator.spec.name for orchestrator in self.orchestrators)

    @property
    def orchestrators(self) -> list[Orchestrator]:
        """Return the pipelines served (while starting, or failed to: those to serve)."""
        if self.phase in (Phase.STARTING, Phase.FAILED):
            return [orchestrator for orchestrator, _ in self._pending]
        return [pipeline.orchestrator for pipeline in self.served()]

    @property
    def orchestrator(self) -> Orchestrator:
        """Return the orchestrator of the one pipeline served."""
        return self.only.orchestrator

    @property
    def batcher(self) -> Batcher:
        """Return the queue of the one pipeline served."""
        return self.only.batcher

    @property
    def shapes(self) -> Shapes:
        """Return what the one pipeline served produces."""
        return self.only.shapes

    def recompiles(self) -> dict[tuple[str, str], int]:
        """Return each compiled component's recompiles by (pipeline, component) (design §17)."""
        return {
            (name, component): compilation.recompiles
            for name, served in list(self.pipelines.items())
            for component, compilation in served.orchestrator.compilations().items()
        }

    def submit(self, job: Job) -> Future[Job]:
        """Queue ``job`` on the one pipeline served (see ``Batcher.submit``)."""
        return self.only.submit(job)

    # -- start and end ----------------------------------------------------------

    def start(self) -> None:
        """Load every pipeline and warm it up; the worker is ready after (or failed).

        A worker already draining (a signal came first) loads nothing.
        """
        with self._starting:
            if self.phase is not Phase.STARTING:
                return
            try:
                for orchestrator, path in self._pending:
                    self.put(self.serve(orchestrator, path))
            except Exception as err:  # reported by /readyz and the log; the process stays up
                self._lifecycle.fail()
                self.error = f"{type(err).__name__}: {err}"
                log.error("serving.failed", error=self.error)
                self.board.changed()
                return
            self._lifecycle.ready()
            for served in self.pipelines.values():
                log.info(
                    "serving.ready",
                    pipeline=served.name,
                    shapes=served.shapes,
                    **msgspec.structs.asdict(self.startup[served.name]),
                )
        self.board.changed()

    def serve(self, orchestrator: Orchestrator, path: Path | None) -> ServedPipeline:
        """Load ``orchestrator``, warm it up and give it a queue; return it, not yet listed.

        Raises:
            AdmissionRefused, TransitionRefused, TransitionFailed: it could not be loaded.
        """
        loaded = orchestrator.load()
        warming = time.perf_counter()
        warmup = orchestrator.spec.serving.warmup
        shapes = warm_up(orchestrator, warmup)
        self.startup[orchestrator.spec.name] = Startup(
            admit_ms=round(self._admit_ms.get(orchestrator.spec.name, 0.0), 3),
            load_ms=loaded.duration_ms,
            components_ms=loaded.components,
            parallel=loaded.parallel,
            warmup_ms=round((time.perf_counter() - warming) * 1e3, 3),
            compile_s={
                name: round(compilation.seconds, 3)
                for name, compilation in orchestrator.compilations().items()
            },
            warmup=warmup,
        )
        batcher = Batcher(
            orchestrator,
            orchestrator.spec.serving,
            shapes,
            on_batch=self.metrics.batch_size.observe,
            on_change=self.board.changed,
        )
        return ServedPipeline(orchestrator, batcher, shapes, path)

    def put(self, served: ServedPipeline) -> None:
        """List ``served`` under its name (replacing the pipeline of that name, if any)."""
        with self._lock:
            self.pipelines[served.name] = served
        self.board.changed()

    def drop(self, served: ServedPipeline) -> None:
        """Stop listing ``served`` (unless another pipeline replaced it under its name)."""
        with self._lock:
            if self.pipelines.get(served.name) is served:
                del self.pipelines[served.name]
                self.startup.pop(served.name, None)
        self.board.changed()

    def build(self, spec: PipelineSpec) -> Orchestrator:
        """Return an orchestrator of ``spec`` on the worker's device, observed by its
        metrics and its status board."""
        orchestrator = Orchestrator(
            spec, platform=self.platform, shared=self.shared, observer=self.metrics.observe
        )
        orchestrator.observe(self.board.observer(spec.name))
        orchestrator.observe(self.metrics.pipeline_observer(spec.name))
        return orchestrator

    def drain(self) -> bool:
        """Stop taking jobs, finish the queued ones and release every pipeline.

        Returns whether every job finished within its pipeline's ``serving.drain_timeout``
        and every component was released (its offload files removed).
        """
        with self._starting:  # a load in progress finishes first; none starts after
            if self.phase is not Phase.DRAINING:  # a second signal drains no further
                self._lifecycle.drain()
        self.board.changed()
        try:
            with self.changing:  # a change in progress finishes first
                served = self.served()
                finished = True
                for pipeline in served:
                    finished = self.retire(pipeline) and finished
                    pipeline.gate.wake_waiters()  # requests waiting at a gate are answered 503
        finally:
            self.board.close()  # the event streams end, so that the server can stop
        return finished

    def retire(self, served: ServedPipeline) -> bool:
        """Drain ``served``'s queue and release it (a component another pipeline shares stays).

        Returns whether its jobs finished within ``serving.drain_timeout`` and it was released.
        """
        timeout = served.settings.drain_timeout
        problems = []
        if not served.batcher.drain(timeout):
            problems.append(
                f"{served.batcher.in_flight} job(s) still running after serving.drain_timeout "
                f"= {timeout:g} s were abandoned"
            )
        try:
            served.orchestrator.close()
        except (TransitionRefused, ExceptionGroup) as err:  # a job outlived the drain: its
            problems.append(str(err))  # components stay, every other one is released
        if problems:
            log.error("serving.drain_failed", pipeline=served.name, reason="; ".join(problems))
        return not problems

    @property
    def abandoned(self) -> int:
        """Return how many jobs still run once a drain gave up waiting for them."""
        if self.phase is not Phase.DRAINING:
            return 0
        return sum(served.batcher.in_flight for served in self.served())

    # -- requests ------------------------------------------------------------------

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
        for served in self.served():
            found = served.batcher.status(request_id)
            if found is not None:
                return found
        return None

    def cancel(self, request_id: str, reason: str) -> RequestStatus | None:
        """Cancel job ``request_id`` (see ``Batcher.cancel``); None when no pipeline
        queued or ran it (a job still waiting at a gate is not queued yet)."""
        for served in self.served():
            found = served.batcher.cancel(request_id, reason)
            if found is not None:
                return found
        return None

    def served(self) -> list[ServedPipeline]:
        """Return the pipelines served now."""
        with self._lock:
            return list(self.pipelines.values())

    def resolve(self, model: str | None) -> ServedPipeline:
        """Return the pipeline a request's ``model`` names (None: the only one).

        Raises:
            UnknownModel: no pipeline has that name, or none was named where several are.
        """
        with self._lock:
            if model is None and len(self.pipelines) == 1:
                return next(iter(self.pipelines.values()))
            served = None if model is None else self.pipelines.get(model)
            names = ", ".join(f"'{name}'" for name in self.pipelines) or "none"
        if served is not None:
            return served
        if names == "none":
            raise UnknownModel(
                "this worker serves no pipeline now; add one with POST /v1/pipelines",
                "model_not_found",
            )
        if model is None:
            raise UnknownModel(
                f"this worker serves several pipelines ({names}): name one in `model`",
                "model_required",
            )
        raise UnknownModel(
            f"model {shown(model)} is not served here; this worker serves {names}",
            "model_not_found",
        )

    async def run(self, served: ServedPipeline, job: Job) -> Job:
        """Queue ``job`` on ``served`` once it takes jobs, and wait for it.

        It waits at the pipeline's gate while the pipeline is being replaced (then runs on
        the new one), and while it sleeps, up to ``serving.wake_timeout`` (waking it first
        when ``serving.auto_wake`` is true). A job that found its pipeline fallen asleep
        under it goes back to the gate.

        Raises:
            Asleep: the pipeline still slept after ``serving.wake_timeout``.
            UnknownModel: the pipeline was removed while the job waited.
            Draining: the worker is shutting down.
            QueueFull: the pipeline's queue is full.
            Refused, TransitionFailed: the job was refused or failed.
        """
        deadline = time.monotonic() + served.settings.wake_timeout
        while True:
            served = await self.pass_gate(served, deadline)
            try:
                future = served.submit(job)
            except Draining:
                if self.phase is not Phase.READY:
                    raise
                served = self.resolve(served.name)  # a change drains it: wait at its gate
                continue
            try:
                return await asyncio.wrap_future(future)
            except TransitionRefused as err:
                if RefusalCode.PIPELINE_ASLEEP not in err.codes:
                    raise

    async def pass_gate(self, served: ServedPipeline, deadline: float) -> ServedPipeline:
        """Wait at ``served``'s gate until its pipeline (or the one replacing it) is open;
        return the pipeline open now. ``deadline`` (``time.monotonic()``) bounds a wait
        for a sleeping one.

        Raises:
            Asleep: the pipeline still slept at ``deadline``.
            UnknownModel: the pipeline was removed while the job waited.
            Draining: the worker is shutting down.
        """
        name = served.name
        while not served.gate.is_open:
            if self.phase is Phase.DRAINING:
                raise Draining()
            if served.gate.closed_for == SLEEPING:
                if served.settings.auto_wake:
                    self.wake_soon(served)
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise Asleep(
                        f"pipeline '{name}' sleeps and did not wake within serving.wake_timeout "
                        f"= {served.settings.wake_timeout:g} s"
                        + ("" if served.settings.auto_wake else " (serving.auto_wake is false)")
                    )
                await served.gate.wait(remaining)
            else:  # being replaced or removed: that always ends, and wakes the waiters
                await served.gate.wait(None)
            served = self.resolve(name)
        return served

    # -- sleep and wake --------------------------------------------------------------

    def sleep(self, name: str) -> ServedPipeline:
        """Put pipeline ``name`` to sleep once its queued and running jobs are done.

        New requests wait at its gate meanwhile; they wait on while it sleeps.

        Raises:
            UnknownModel: no such pipeline.
            InvalidTransition: it is not serving.
            TransitionRefused: its jobs were not done within ``serving.drain_timeout``.
            TransitionFailed: an offload failed; nothing moved.
        """
        with self.changing:
            served = self.resolve(name)
            orchestrator = served.orchestrator
            if served.state is not PipelineState.SERVING:
                orchestrator.sleep()  # raises InvalidTransition, with the states it is valid from
            served.gate.close(SLEEPING)
            try:
                deadline = time.monotonic() + served.settings.drain_timeout
                served.batcher.wait_idle(served.settings.drain_timeout)
                orchestrator.sleep(timeout=max(deadline - time.monotonic(), 0.0))
            except BaseException:
                served.gate.open()
                raise
            return served

    def wake(self, name: str) -> ServedPipeline:
        """Wake pipeline ``name``; its waiting requests go on.

        Raises:
            UnknownModel: no such pipeline.
            InvalidTransition: it does not sleep.
            TransitionRefused: its resident components cannot fit the budget.
            TransitionFailed: an onload failed or was refused; it still sleeps.
        """
        with self.changing:
            served = self.resolve(name)
            served.orchestrator.wake()
            served.gate.open()
            return served

    def wake_soon(self, served: ServedPipeline) -> None:
        """Wake ``served`` on a thread of its own, unless a wake of it is under way."""
        name = served.name
        with self._lock:
            if name in self._waking:
                return
            self._waking.add(name)

        def wake() -> None:
            try:
                self.wake(name)
            except Exception as err:  # the waiting requests are answered 503 at their timeout
                log.error(
                    "serving.wake_failed", pipeline=name, error=f"{type(err).__name__}: {err}"
                )
            finally:
                with self._lock:
                    self._waking.discard(name)

        threading.Thread(target=wake, name=f"wake-{name}", daemon=True).start()

    # -- what it serves --------------------------------------------------------------

    def listing(self) -> dict[str, Any]:
        """Return ``GET /v1/pipelines``: each pipeline, its state and its components' users."""
        served = self.served()
        data = []
        for pipeline in served:
            snapshot = pipeline.orchestrator.snapshot()
            data.append(
                {
                    "name": pipeline.name,
                    "state": pipeline.state.value,
                    "gate": pipeline.gate.closed_for or "open",
                    "waiting": pipeline.gate.waiting,
                    "path": None if pipeline.path is None else str(pipeline.path),
                    "components": {
                        name: {
                            "state": component.state.value,
                            "users": sorted({self.shared.name_of(k) for k in component.users}),
                            "kind": component.kind,
                            "residency": component.residency.value,
                        }
                        for name, component in snapshot.components.items()
                    },
                }
            )
        return {
            "object": "list",
            "data": data,
            "shared_bytes_saved": self.shared.saved_bytes(),
            "resident_bytes": self.shared.resident_bytes(),
            "device_budget": self.shared.budget.limit,
        }
