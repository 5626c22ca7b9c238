"""The serving worker's lifecycle (design §13): starting, ready, failed, draining.

Built from ``lifecycle.machines.tables.WORKER_TRANSITIONS`` on the same guarded machine as the
components and the pipelines, so that a worker's own moves are checked against the one
table the diagrams draw (``diagrams/worker_lifecycle.*``): a trigger not valid from
where the worker stands raises ``InvalidTransition`` and changes nothing.
"""

from __future__ import annotations

from lifecycle.logs import get_logger
from lifecycle.machines.engine import (
    Guarded,
    GuardedMachine,
    TransitionContext,
    Trigger,
)
from lifecycle.machines.tables import INITIAL_WORKER_STATE, WORKER_TRANSITIONS, WorkerState

__all__ = ["WorkerMachine"]

log = get_logger("lifecycle")


class WorkerLifecycle(Guarded):
    """A worker's place in its lifecycle; its triggers are typed attributes.

    Create it with ``WorkerMachine.lifecycle``.
    """

    rules = WORKER_TRANSITIONS
    noun = "worker"
    state: WorkerState

    # one per trigger of the table (a test holds them against it)
    ready = Trigger()
    fail = Trigger()
    drain = Trigger()


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
