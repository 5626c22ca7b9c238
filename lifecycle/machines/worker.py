"""The serving worker's lifecycle (design §13): starting, ready, failed, draining.

Built from ``lifecycle.machines.tables.WORKER_TRANSITIONS`` on the same guarded machine as the
components and the pipelines, so that a worker's own moves are checked against the one
table the diagrams draw (``diagrams/worker_lifecycle.*``): a trigger not valid from
where the worker stands raises ``InvalidTransition`` and changes nothing.
"""

from __future__ import annotations

from lifecycle.logs import get_logger
from lifecycle.machines.engine import NO_ARGS, Guarded, GuardedMachine, MoveArgs, TransitionContext
from lifecycle.machines.tables import INITIAL_WORKER_STATE, WORKER_TRANSITIONS, WorkerState

log = get_logger("lifecycle")


class WorkerLifecycle(Guarded):
    """A worker's place in its lifecycle; the triggers are typed methods.

    Create it with ``WorkerMachine.lifecycle``.
    """

    rules = WORKER_TRANSITIONS
    noun = "worker"
    state: WorkerState

    # The machine binds these; the bodies exist so that type checkers see them.
    def ready(self, args: MoveArgs = NO_ARGS) -> bool:
        """Starting -> ready."""
        raise NotImplementedError

    def fail(self, args: MoveArgs = NO_ARGS) -> bool:
        """Starting -> failed."""
        raise NotImplementedError

    def drain(self, args: MoveArgs = NO_ARGS) -> bool:
        """Starting, ready or failed -> draining."""
        raise NotImplementedError

    def may_ready(self, args: MoveArgs = NO_ARGS) -> bool:
        """Return whether ``ready`` would pass now."""
        raise NotImplementedError

    def may_fail(self, args: MoveArgs = NO_ARGS) -> bool:
        """Return whether ``fail`` would pass now."""
        raise NotImplementedError

    def may_drain(self, args: MoveArgs = NO_ARGS) -> bool:
        """Return whether ``drain`` would pass now."""
        raise NotImplementedError

    def is_STARTING(self) -> bool:  # noqa: N802  (transitions names them after the state)
        """Return whether the worker is STARTING."""
        raise NotImplementedError

    def is_READY(self) -> bool:  # noqa: N802
        """Return whether the worker is READY."""
        raise NotImplementedError

    def is_FAILED(self) -> bool:  # noqa: N802
        """Return whether the worker is FAILED."""
        raise NotImplementedError

    def is_DRAINING(self) -> bool:  # noqa: N802
        """Return whether the worker is DRAINING."""
        raise NotImplementedError


class WorkerMachine(GuardedMachine):
    """The machine of one serving worker."""

    states_enum = WorkerState
    rules = WORKER_TRANSITIONS
    initial_state = INITIAL_WORKER_STATE

    def lifecycle(self, name: str) -> WorkerLifecycle:
        """Return a worker called ``name``, attached in the initial state."""
        worker = WorkerLifecycle(name, checks={})
        with self.lock:
            self.add_model(worker)
        return worker

    def report_done(self, model: Guarded, context: TransitionContext, duration_ms: float) -> None:
        """Log ``worker.transition``."""
        if context.is_logged:
            log.info(
                "worker.transition",
                worker=model.name,
                trigger=context.trigger,
                source=context.source.value,
                dest=context.dest.value,
                duration_ms=duration_ms,
            )
