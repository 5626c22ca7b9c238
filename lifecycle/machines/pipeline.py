"""The pipeline lifecycle (design §13): serving, sleeping, swapping, draining, released.

Built from ``lifecycle.machines.tables.PIPELINE_TRANSITIONS`` on the same guarded machine as the
components (every guard checked, refusals with reasons, atomic work), and on the lock
of the components' machine, so that a sleep's offloads and a request's onloads never
interleave. Guards and work are injected by the orchestrator that owns the pipeline.
"""

from __future__ import annotations

import msgspec

from lifecycle.events import PipelineSlept, PipelineTransitioned, PipelineWoke
from lifecycle.logs import get_logger
from lifecycle.machines.engine import (
    Guarded,
    GuardedMachine,
    TransitionContext,
    Trigger,
)
from lifecycle.machines.tables import INITIAL_PIPELINE_STATE, PIPELINE_TRANSITIONS, PipelineState

__all__ = ["PipelineLifecycle", "PipelineMachine"]

log = get_logger("lifecycle")

_EVENTS: dict[str, type[PipelineTransitioned]] = {
    "sleep": PipelineSlept,
    "wake": PipelineWoke,
}
"""The event of a trigger that has one of its own; others are ``PipelineTransitioned``."""


class PipelineLifecycle(Guarded):
    """One pipeline's place in its lifecycle; its triggers are typed attributes.

    Create it, then ``PipelineMachine.add_pipeline`` it (see ``Guarded`` for the
    arguments).
    """

    rules = PIPELINE_TRANSITIONS
    noun = "pipeline"
    state: PipelineState

    # one per trigger of the table (a test holds them against it)
    sleep = Trigger()
    wake = Trigger()
    swap = Trigger()
    drain = Trigger()
    release = Trigger()


class PipelineMachine(GuardedMachine):
    """The machine the pipelines of a ``SharedDevice`` share, on its components' lock.

    Args:
        name: the machine's name.
        lock: the lock its triggers run under (the components' machine's).
    """

    states_enum = PipelineState
    rules = PIPELINE_TRANSITIONS
    initial_state = INITIAL_PIPELINE_STATE

    def add_pipeline(self, pipeline: PipelineLifecycle) -> None:
        """Attach ``pipeline`` in the initial state; its triggers become live."""
        with self.lock:
            self.add_model(pipeline)

    def report_done(self, model: Guarded, context: TransitionContext, duration_ms: float) -> None:
        """Log the pipeline's event (``pipeline.slept``, ...) and emit it."""
        kind = _EVENTS.get(context.trigger, PipelineTransitioned)
        done = kind(
            pipeline=model.name,
            trigger=context.trigger,
            source=context.source.value,
            dest=context.dest.value,
            duration_ms=duration_ms,
        )
        if context.is_logged:
            log.info(str(kind.__struct_config__.tag), **msgspec.structs.asdict(done))
        if model.observers.attached:
            model.observers.emit(done)
